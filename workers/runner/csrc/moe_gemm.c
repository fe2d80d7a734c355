/* Mixture-of-experts matmuls in float32 on CPU: every expert of a projection in one call.

   Rows [offsets[e], offsets[e + 1]) of x (the (token, expert) pairs sorted by expert) go
   through expert e: y[rows] = x[rows] . w_e^T, for all experts at once. Each expert's weight
   [n, k] is packed (moe_pack_f32) in panels of C column blocks of 16: for each k, the panel's
   C 64-byte lines side by side, read in order. A work item is (expert, panel);
   it keeps R rows x C blocks of sums in registers, and each step over k loads C weight lines
   and broadcasts R values of x, so every weight line serves R rows. Decode steps (a few rows
   per expert) are bound by reading the weights once; prefill chunks (hundreds of rows per
   expert) by the multiply-adds.

   Written with GCC's vector extensions in the CPU's own register width: one 16-float column
   block is one AVX-512 register, or two AVX2 ones (the build is -march=native, cbuild.py). A
   64-byte vector type on AVX2 is not split into register pairs by GCC 12: it kept the sums on
   the stack and ran 24x slower than a plain matmul, so the type is the native width. */
#include <stdint.h>
#include <string.h>

/* Weight lines are fetched this many steps over k ahead of the multiply (8 KB of a 4-block
   panel): a decode step's experts stream from memory, and the hardware's prefetcher alone
   left them at 12-16 GB/s (64 tokens of Qwen3-MoE, 2-core AMX Xeon); with it 9-11 against
   11.5-12.6 ms for a layer's two projections (docs/benchmarks.md). */
#define PF_K 32

/* Multiply-adds fused (one rounding, twice the throughput): ISO C mode leaves them apart. */
#if defined(__clang__)
#pragma clang fp contract(fast)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=fast")
#endif

#if defined(__AVX512F__)
typedef float vf __attribute__((vector_size(64)));
#define VW 16
#define TILE_R 6 /* rows x column blocks of sums: 24 of the 32 zmm registers */
#define TILE_C 4
/* One float in every lane (a macro: a function returning a vector changes the ABI). */
#define SPLAT(s) ((vf){s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s})
#else
typedef float vf __attribute__((vector_size(32)));
#define VW 8
#define TILE_R 6 /* 6 rows x 1 block (2 ymm each): 12 of the 16 ymm registers */
#define TILE_C 1
#define SPLAT(s) ((vf){s, s, s, s, s, s, s, s})
#endif
#define LANES (16 / VW) /* registers per 16-column block */

/* w [n, k] row-major -> packed panels of TILE_C column blocks (the last one may have fewer):
   panel [k][blocks][16], so one step over k reads the panel's lines one after another. 0, or
   -1 where n is not whole blocks. */
int moe_pack_f32(const float *w, float *packed, int64_t n, int64_t k) {
    if (n % 16 != 0) return -1;
    const int64_t blocks = n / 16, panels = (blocks + TILE_C - 1) / TILE_C;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        const int64_t nb = p * TILE_C;
        const int64_t here = blocks - nb < TILE_C ? blocks - nb : TILE_C;
        float *panel = packed + nb * 16 * k;
        for (int64_t kk = 0; kk < k; kk++)
            for (int64_t c = 0; c < here * 16; c++)
                panel[kk * here * 16 + c] = w[(nb * 16 + c) * k + kk];
    }
    return 0;
}

static inline __attribute__((always_inline)) void tile(const float *x, int64_t ldx,
                                                       const float *w, int64_t k, float *y,
                                                       int64_t ldy, const int R, const int C) {
    vf acc[TILE_R][TILE_C * LANES];
    const int V = C * LANES; /* registers across the tile's columns */
    for (int r = 0; r < R; r++)
        for (int v = 0; v < V; v++) acc[r][v] = (vf){0};
    for (int64_t kk = 0; kk < k; kk++) {
        vf wv[TILE_C * LANES];
        for (int c = 0; c < C; c++) __builtin_prefetch(w + (kk + PF_K) * C * 16 + c * 16, 0, 3);
        for (int v = 0; v < V; v++) memcpy(&wv[v], w + kk * C * 16 + v * VW, sizeof(vf));
        for (int r = 0; r < R; r++) {
            const float xs = x[r * ldx + kk];
            const vf xv = SPLAT(xs);
            for (int v = 0; v < V; v++) acc[r][v] += xv * wv[v];
        }
    }
    for (int r = 0; r < R; r++)
        for (int v = 0; v < V; v++) memcpy(y + r * ldy + v * VW, &acc[r][v], sizeof(vf));
}

#define TILE_CASE(R, C)                                                                       \
    case R:                                                                                   \
        tile(x, ldx, w, k, y, ldy, R, C);                                                     \
        break;

/* `rows` (1..TILE_R) rows by `blocks` (1..TILE_C) column blocks. */
static void rows_tile(const float *x, int64_t ldx, const float *w, int64_t k, float *y,
                      int64_t ldy, int rows, int blocks) {
#if TILE_C == 4
    if (blocks == 4) {
        switch (rows) { TILE_CASE(1, 4) TILE_CASE(2, 4) TILE_CASE(3, 4) TILE_CASE(4, 4)
                        TILE_CASE(5, 4) TILE_CASE(6, 4) }
        return;
    }
    if (blocks == 3) {
        switch (rows) { TILE_CASE(1, 3) TILE_CASE(2, 3) TILE_CASE(3, 3) TILE_CASE(4, 3)
                        TILE_CASE(5, 3) TILE_CASE(6, 3) }
        return;
    }
    if (blocks == 2) {
        switch (rows) { TILE_CASE(1, 2) TILE_CASE(2, 2) TILE_CASE(3, 2) TILE_CASE(4, 2)
                        TILE_CASE(5, 2) TILE_CASE(6, 2) }
        return;
    }
    switch (rows) { TILE_CASE(1, 1) TILE_CASE(2, 1) TILE_CASE(3, 1) TILE_CASE(4, 1)
                    TILE_CASE(5, 1) TILE_CASE(6, 1) }
#else
    (void)blocks; /* one block a panel */
    switch (rows) { TILE_CASE(1, 1) TILE_CASE(2, 1) TILE_CASE(3, 1) TILE_CASE(4, 1)
                    TILE_CASE(5, 1) TILE_CASE(6, 1) }
#endif
}

/* y [offsets[experts], n] (row stride ldy) = each expert's run of x [., k] (row stride ldx)
   times its packed weight (`experts` packs of n * k floats, one after another). 0, or -1
   where n is not whole column blocks. */
int moe_gemm_f32(const float *x, const float *packed, float *y, const int64_t *offsets,
                 int64_t experts, int64_t n, int64_t k, int64_t ldx, int64_t ldy, int threads) {
    if (n % 16 != 0 || experts < 1 || threads < 1) return -1;
    const int64_t blocks = n / 16, panels = (blocks + TILE_C - 1) / TILE_C;
    const int64_t items = experts * panels;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 2)
    for (int64_t item = 0; item < items; item++) {
        const int64_t e = item / panels, p = item % panels;
        const int64_t nb = p * TILE_C;
        const int here = (int)(blocks - nb < TILE_C ? blocks - nb : TILE_C);
        const float *w = packed + e * n * k + nb * k * 16;
        for (int64_t m0 = offsets[e]; m0 < offsets[e + 1]; m0 += TILE_R) {
            const int64_t left = offsets[e + 1] - m0;
            rows_tile(x + m0 * ldx, ldx, w, k, y + m0 * ldy + nb * 16, ldy,
                      (int)(left < TILE_R ? left : TILE_R), here);
        }
    }
    return 0;
}
