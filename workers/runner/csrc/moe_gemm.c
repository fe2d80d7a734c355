/* Mixture-of-experts matmuls in float32 on CPU: every expert of a projection in one call.

   Rows [offsets[e], offsets[e + 1]) of x (the (token, expert) pairs sorted by expert) go
   through expert e: y[rows] = x[rows] . w_e^T, for all experts at once. Each expert's weight
   [n, k] is packed (moe_pack_f32) as n / 16 column blocks, each block k rows of 16 floats: one
   64-byte line per k, read in order. A work item is (expert, panel of up to C column blocks);
   it keeps R rows x C blocks of sums in registers, and each step over k loads C weight lines
   and broadcasts R values of x, so every weight line serves R rows. Decode steps (a few rows
   per expert) are bound by reading the weights once; prefill chunks (hundreds of rows per
   expert) by the multiply-adds.

   Written with GCC's vector extensions: 16 floats are one AVX-512 register, or two AVX2 ones,
   where the register tile is smaller (the build is -march=native, cbuild.py). */
#include <stdint.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));

#if defined(__AVX512F__)
#define TILE_R 6 /* rows x column blocks of sums: 24 of the 32 zmm registers */
#define TILE_C 4
#else
#define TILE_R 3 /* 12 of the 16 ymm registers (each v16 is two) */
#define TILE_C 2
#endif

/* w [n, k] row-major -> packed [n / 16][k][16]. 0, or -1 where n is not whole blocks. */
int moe_pack_f32(const float *w, float *packed, int64_t n, int64_t k) {
    if (n % 16 != 0) return -1;
#pragma omp parallel for schedule(static)
    for (int64_t nb = 0; nb < n / 16; nb++)
        for (int64_t kk = 0; kk < k; kk++)
            for (int c = 0; c < 16; c++)
                packed[(nb * k + kk) * 16 + c] = w[(nb * 16 + c) * k + kk];
    return 0;
}

static inline __attribute__((always_inline)) void tile(const float *x, int64_t ldx,
                                                       const float *w, int64_t k, float *y,
                                                       int64_t ldy, const int R, const int C) {
    v16 acc[TILE_R][TILE_C];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = (v16){0};
    for (int64_t kk = 0; kk < k; kk++) {
        v16 wv[TILE_C];
        for (int c = 0; c < C; c++) memcpy(&wv[c], w + (c * k + kk) * 16, sizeof(v16));
        for (int r = 0; r < R; r++) {
            const v16 xv = (v16){0} + x[r * ldx + kk];
            for (int c = 0; c < C; c++) acc[r][c] += xv * wv[c];
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) memcpy(y + r * ldy + 16 * c, &acc[r][c], sizeof(v16));
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
    if (blocks == 2) {
        switch (rows) { TILE_CASE(1, 2) TILE_CASE(2, 2) TILE_CASE(3, 2) }
        return;
    }
    switch (rows) { TILE_CASE(1, 1) TILE_CASE(2, 1) TILE_CASE(3, 1) }
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
