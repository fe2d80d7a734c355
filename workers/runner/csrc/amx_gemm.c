/* bfloat16 matmul on Intel AMX tiles, for the few-row matmuls of decode steps.

   y[m, n] = sum_k x[m, k] * w[n, k], bfloat16 in, float32 sums, bfloat16 or float32 out.

   At 1-64 rows a projection is bound by reading its weight once; oneDNN's blocked bfloat16
   matmul reads SmolLM2's 212 MB of weights at 13-17 GB/s on a 2-core Sapphire Rapids VM
   where a plain read runs at 23 GB/s. Here the weight is packed once into AMX's B-tile
   layout (pairs of k interleaved, one 1 KB tile per 16 columns x 32 k, a column block's
   tiles contiguous), so the kernel streams it in order; each thread owns whole pairs of
   column blocks, and every 32-row chunk of x reuses the pair's tiles from L2.

   The AMX code exists only in a build for a CPU with amx_tile and amx_bf16; other builds
   export the same functions and answer -1 (not available). */

#define _GNU_SOURCE /* syscall() under -std=c11 */
#include <stdint.h>
#include <string.h>

/* w [n, k] row-major -> packed (AMX's B tiles; the AVX-512 BF16 kernel below reads the same
 * layout, where a column block's k-pairs are one contiguous run of 64-byte vectors) [n / 16][k / 32][16 k-pairs][16 columns][2]. */
int amx_pack(const uint16_t *w, uint16_t *packed, int64_t n, int64_t k) {
    if (n % 32 != 0 || k % 32 != 0) return -1;
    const int64_t kb_count = k / 32;
#pragma omp parallel for schedule(static)
    for (int64_t nb = 0; nb < n / 16; nb++) {
        for (int64_t kb = 0; kb < kb_count; kb++) {
            uint16_t *tile = packed + (nb * kb_count + kb) * 512;
            for (int r = 0; r < 16; r++)
                for (int c = 0; c < 16; c++) {
                    const uint16_t *src = w + (nb * 16 + c) * k + kb * 32 + 2 * r;
                    tile[r * 32 + c * 2] = src[0];
                    tile[r * 32 + c * 2 + 1] = src[1];
                }
        }
    }
    return 0;
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>

#include "amx_tiles.h"
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Ask Linux for the AMX tile state (once per process): 0, or -1 where it is refused. */
int amx_init(void) {
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : -1;
}

/* Rows of x per pass over the weight: a block of x stays in L2 while the weight streams. */
#define ROW_BLOCK 256

static void configure(int rows0, int rows1) {
    /* tmm0..3: sums (row chunk i, column block j -> tmm 2i + j); tmm4, 5: x; tmm6, 7: w */
    const int rows[8] = {rows0, rows0, rows1, rows1, rows0, rows1, 16, 16};
    const tile_config cfg = tile_rows(rows);
    _tile_loadconfig(&cfg);
}

/* Sums of one tile (rows x 16 floats at `sums`, 32 floats apart) to y at column `col`. */
static void emit(const float *sums, int rows, void *y, int64_t ldy, int64_t row, int64_t col,
                 int out_f32) {
    for (int r = 0; r < rows; r++) {
        __m512 v = _mm512_loadu_ps(sums + r * 32);
        if (out_f32) {
            _mm512_storeu_ps((float *)y + (row + r) * ldy + col, v);
        } else {
            __m256bh h = _mm512_cvtneps_pbh(v);
            _mm256_storeu_si256((__m256i *)((uint16_t *)y + (row + r) * ldy + col),
                                (__m256i)h);
        }
    }
}

/* Rows [m_begin, m_end) of y's 32 columns from `col` = the same rows of x . the column pair's
   packed tiles (w0: its first 16 columns, w1 the next 16), 32 rows at a time. `configured`:
   the row count the tile configuration holds (-1: none yet). */
static void amx_pair(const uint16_t *x, int64_t ldx, const uint16_t *w0, const uint16_t *w1,
                     void *y, int64_t ldy, int64_t m_begin, int64_t m_end, int64_t col,
                     int64_t kb_count, int out_f32, int *configured, float *sums) {
    for (int64_t m0 = m_begin; m0 < m_end; m0 += 32) {
        const int64_t left = m_end - m0;
        const int rows = (int)(left < 32 ? left : 32);
        const int rows0 = rows < 16 ? rows : 16, rows1 = rows - rows0;
        if (*configured != rows) {
            configure(rows0, rows1);
            *configured = rows;
        }
        const uint16_t *x0 = x + m0 * ldx, *x1 = x0 + 16 * ldx;
        _tile_zero(0);
        _tile_zero(1);
        if (rows1) {
            _tile_zero(2);
            _tile_zero(3);
        }
        for (int64_t kb = 0; kb < kb_count; kb++) {
            _tile_loadd(4, x0 + kb * 32, ldx * 2);
            _tile_loadd(6, w0 + kb * 512, 64);
            _tile_loadd(7, w1 + kb * 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            if (rows1) {
                _tile_loadd(5, x1 + kb * 32, ldx * 2);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        _tile_stored(0, sums, 128);
        _tile_stored(1, sums + 16, 128);
        emit(sums, rows0, y, ldy, m0, col, out_f32);
        emit(sums + 16, rows0, y, ldy, m0, col + 16, out_f32);
        if (rows1) {
            _tile_stored(2, sums, 128);
            _tile_stored(3, sums + 16, 128);
            emit(sums, rows1, y, ldy, m0 + 16, col, out_f32);
            emit(sums + 16, rows1, y, ldy, m0 + 16, col + 16, out_f32);
        }
    }
}

/* The same for at most 16 rows [m0, m0 + rows) and 64 columns from `col` (w0..w3: four
   column blocks' packed tiles): four sums in flight, where a pair has two, so a run of few
   rows (a decode step's share of one expert) is not held up by each product's latency. The
   tile configuration (code QUAD + rows) differs from amx_pair's. */
#define QUAD 100
static void amx_quad(const uint16_t *x, int64_t ldx, const uint16_t *w0, int64_t wstride,
                     void *y, int64_t ldy, int64_t m0, int rows, int64_t col,
                     int64_t kb_count, int out_f32, int *configured, float *sums) {
    if (*configured != QUAD + rows) {
        const int shape[8] = {rows, rows, rows, rows, rows, 16, 16, 16};
        const tile_config cfg = tile_rows(shape);
        _tile_loadconfig(&cfg);
        *configured = QUAD + rows;
    }
    const uint16_t *x0 = x + m0 * ldx;
    const uint16_t *w1 = w0 + wstride, *w2 = w1 + wstride, *w3 = w2 + wstride;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kb = 0; kb < kb_count; kb++) {
        _tile_loadd(4, x0 + kb * 32, ldx * 2);
        _tile_loadd(5, w0 + kb * 512, 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, w1 + kb * 512, 64);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(7, w2 + kb * 512, 64);
        _tile_dpbf16ps(2, 4, 7);
        _tile_loadd(5, w3 + kb * 512, 64);
        _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, sums, 128);
    _tile_stored(1, sums + 16, 128);
    emit(sums, rows, y, ldy, m0, col, out_f32);
    emit(sums + 16, rows, y, ldy, m0, col + 16, out_f32);
    _tile_stored(2, sums, 128);
    _tile_stored(3, sums + 16, 128);
    emit(sums, rows, y, ldy, m0, col + 32, out_f32);
    emit(sums + 16, rows, y, ldy, m0, col + 48, out_f32);
}

/* y [m, n] (row stride ldy elements) = x [m, k] (row stride ldx) . w^T, w packed by
   amx_pack. 0, or -1 for shapes the packing does not cover. */
int amx_gemm(const uint16_t *x, const uint16_t *packed, void *y, int64_t m, int64_t n,
             int64_t k, int64_t ldx, int64_t ldy, int out_f32, int threads) {
    if (n % 32 != 0 || k % 32 != 0 || m < 1) return -1;
    const int64_t kb_count = k / 32, pairs = n / 32;
#pragma omp parallel num_threads(threads)
    {
        float sums[32 * 32] __attribute__((aligned(64)));
        int configured = -1;
        for (int64_t mb = 0; mb < m; mb += ROW_BLOCK) {
            const int64_t m_end = mb + ROW_BLOCK < m ? mb + ROW_BLOCK : m;
#pragma omp for schedule(static)
            for (int64_t p = 0; p < pairs; p++) {
                const uint16_t *w0 = packed + (2 * p) * kb_count * 512;
                amx_pair(x, ldx, w0, w0 + kb_count * 512, y, ldy, mb, m_end, p * 32, kb_count,
                         out_f32, &configured, sums);
            }
        }
        if (configured != -1) _tile_release();
    }
    return 0;
}

/* Mixture-of-experts: `experts` weights [n, k] each, packed one after another (amx_pack of
   the stacked [experts * n, k]); rows [offsets[e], offsets[e + 1]) of x go through expert e:
   y [offsets[experts], n] = each run of x . its expert's w^T. All experts in one parallel
   region, shared out by (expert, column pair); an expert without rows costs nothing. */
int amx_grouped_gemm(const uint16_t *x, const uint16_t *packed, void *y, const int64_t *offsets,
                     int64_t experts, int64_t n, int64_t k, int64_t ldx, int64_t ldy,
                     int out_f32, int threads) {
    if (n % 32 != 0 || k % 32 != 0 || experts < 1) return -1;
    /* items of two pairs (64 columns) where they divide n, so an expert of at most 16 rows
       takes amx_quad */
    const int per = n % 64 == 0 ? 2 : 1;
    const int64_t kb_count = k / 32, groups = n / (32 * per), items = experts * groups;
    const int64_t block = kb_count * 512; /* one 16-column block's packed tiles */
#pragma omp parallel num_threads(threads)
    {
        float sums[32 * 32] __attribute__((aligned(64)));
        int configured = -1;
#pragma omp for schedule(dynamic, 2)
        for (int64_t item = 0; item < items; item++) {
            const int64_t e = item / groups, g = item % groups;
            const int64_t rows = offsets[e + 1] - offsets[e];
            if (rows <= 0) continue;
            const uint16_t *w0 = packed + e * n * k + (2 * per * g) * block;
            if (per == 2 && rows <= 16) {
                amx_quad(x, ldx, w0, block, y, ldy, offsets[e], (int)rows, g * 64, kb_count,
                         out_f32, &configured, sums);
                continue;
            }
            for (int q = 0; q < per; q++)
                amx_pair(x, ldx, w0 + 2 * q * block, w0 + (2 * q + 1) * block, y, ldy,
                         offsets[e], offsets[e + 1], (g * per + q) * 32, kb_count, out_f32,
                         &configured, sums);
        }
        if (configured != -1) _tile_release();
    }
    return 0;
}

#else

int amx_init(void) { return -1; }

int amx_gemm(const uint16_t *x, const uint16_t *packed, void *y, int64_t m, int64_t n,
             int64_t k, int64_t ldx, int64_t ldy, int out_f32, int threads) {
    (void)x, (void)packed, (void)y, (void)m, (void)n, (void)k, (void)ldx, (void)ldy;
    (void)out_f32, (void)threads;
    return -1;
}

int amx_grouped_gemm(const uint16_t *x, const uint16_t *packed, void *y, const int64_t *offsets,
                     int64_t experts, int64_t n, int64_t k, int64_t ldx, int64_t ldy,
                     int out_f32, int threads) {
    (void)x, (void)packed, (void)y, (void)offsets, (void)experts, (void)n, (void)k, (void)ldx;
    (void)ldy, (void)out_f32, (void)threads;
    return -1;
}

#endif

#if defined(__AVX512BF16__)
#include <immintrin.h>

/* The same product with AVX-512 BF16 dot products, for CPUs without AMX (Zen 4, Cooper
 * Lake). One k-pair of 16 columns of the packed weight is one vector; a block of R rows x C
 * column blocks keeps R x C float32 sums in registers, and each step loads C weight vectors
 * and broadcasts R pairs of x, so every weight vector serves R rows. Threads own panels of
 * columns; a panel (C x 16 columns x k) stays in L2 while the row blocks pass over it. */
#define DOT_C 4  /* column blocks of the wide shape (6 rows x 64 columns) */
#define DOT_R 12 /* rows of the narrow shape (12 rows x 32 columns) */

static inline __attribute__((always_inline)) void dot_block(
    const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t pairs, void *y, int64_t ldy,
    int out_f32, const char *ahead, int64_t ahead_lines, const int R, const int C) {
    __m512 acc[DOT_R][DOT_C];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();
    const int64_t cstride = pairs * 32; /* one column block's run, in bfloat16 elements */
    for (int64_t kp = 0; kp < pairs; kp++) {
        if (kp < ahead_lines) __builtin_prefetch(ahead + kp * 64, 0, 2);
        __m512bh wv[DOT_C];
        for (int c = 0; c < C; c++) wv[c] = (__m512bh)_mm512_loadu_si512(w + c * cstride + kp * 32);
        for (int r = 0; r < R; r++) {
            int32_t pair;
            memcpy(&pair, x + r * ldx + 2 * kp, sizeof pair);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
            for (int c = 0; c < C; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            if (out_f32)
                _mm512_storeu_ps((float *)y + r * ldy + 16 * c, acc[r][c]);
            else
                _mm256_storeu_si256((__m256i *)((uint16_t *)y + r * ldy + 16 * c),
                                    (__m256i)_mm512_cvtneps_pbh(acc[r][c]));
        }
}

#define DOT_ROWS(R, C)                                                                          \
    case R:                                                                                     \
        dot_block(x, ldx, w, pairs, y, ldy, out_f32, ahead, ahead_lines, R, C);                 \
        break;

/* `rows` rows (at most 6 for 4 column blocks, 12 for 2) of one panel; meanwhile the first
 * `ahead_lines` 64-byte lines at `ahead` (a share of the next panel) are fetched into L2. */
static void dot_rows(const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t pairs, void *y,
                     int64_t ldy, int out_f32, const char *ahead, int64_t ahead_lines, int rows,
                     int blocks) {
    if (blocks == 4) {
        switch (rows) { DOT_ROWS(1, 4) DOT_ROWS(2, 4) DOT_ROWS(3, 4) DOT_ROWS(4, 4)
                        DOT_ROWS(5, 4) DOT_ROWS(6, 4) }
    } else {
        switch (rows) { DOT_ROWS(1, 2) DOT_ROWS(2, 2) DOT_ROWS(3, 2) DOT_ROWS(4, 2)
                        DOT_ROWS(5, 2) DOT_ROWS(6, 2) DOT_ROWS(7, 2) DOT_ROWS(8, 2)
                        DOT_ROWS(9, 2) DOT_ROWS(10, 2) DOT_ROWS(11, 2) DOT_ROWS(12, 2) }
    }
}

/* y [m, n] = x [m, k] . w^T as amx_gemm, w packed by amx_pack; 0, or -1 for shapes the
 * packing does not cover. Panels of 64 columns (6 rows at a time) where they split evenly
 * over the threads or are many, else of 32 (12 rows at a time), so that no thread idles
 * through a ninth panel of SmolLM2's 576 columns; rows are split into blocks of equal size
 * (64 rows: 11 blocks of 5-6, or 6 of 10-11), not full blocks and a short one. Where a panel
 * takes several row blocks, they
 * share out fetching the thread's next panel into L2, so no block waits on memory. */
int dot_gemm(const uint16_t *x, const uint16_t *packed, void *y, int64_t m, int64_t n,
             int64_t k, int64_t ldx, int64_t ldy, int out_f32, int threads) {
    if (n % 32 != 0 || k % 32 != 0 || m < 1 || threads < 1) return -1;
    const int64_t pairs = k / 2, wide_panels = (n / 16 + 3) / 4;
    const int blocks = wide_panels % threads == 0 || wide_panels >= 8 * threads ? 4 : 2;
    const int64_t row_blocks = (m + (blocks == 4 ? 6 : 12) - 1) / (blocks == 4 ? 6 : 12);
    const int64_t panels = (n / 16 + blocks - 1) / blocks;
    const int es = out_f32 ? 4 : 2;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        const int64_t nb = p * blocks;
        const int here = n / 16 - nb < blocks ? (int)(n / 16 - nb) : blocks; /* 4 or 2 */
        const uint16_t *w = packed + nb * pairs * 32;
        /* the next panel this thread takes under the static schedule */
        const int64_t next = p + 1 < panels ? (p + threads < panels ? p + threads : p + 1) : p;
        const char *ahead = (const char *)(packed + next * blocks * pairs * 32);
        const int64_t next_here = n / 16 - next * blocks < blocks ? n / 16 - next * blocks : blocks;
        const int64_t lines = next == p || row_blocks < 2 ? 0 : next_here * pairs;
        const int64_t share = (lines + row_blocks - 1) / row_blocks;
        for (int64_t i = 0; i < row_blocks; i++) {
            const int64_t m0 = m * i / row_blocks;
            const int rows = (int)(m * (i + 1) / row_blocks - m0);
            const int64_t from = i * share < lines ? i * share : lines;
            const int64_t count = lines - from < share ? lines - from : share;
            dot_rows(x + m0 * ldx, ldx, w, pairs, (char *)y + (m0 * ldy + nb * 16) * es, ldy,
                     out_f32, ahead + from * 64, count < pairs ? count : pairs, rows, here);
        }
    }
    return 0;
}

/* amx_grouped_gemm's product by dot products: work shared out by (expert, 32 columns), each
 * expert's rows 12 at a time. */
int dot_grouped_gemm(const uint16_t *x, const uint16_t *packed, void *y, const int64_t *offsets,
                     int64_t experts, int64_t n, int64_t k, int64_t ldx, int64_t ldy,
                     int out_f32, int threads) {
    if (n % 32 != 0 || k % 32 != 0 || experts < 1 || threads < 1) return -1;
    const int64_t pairs = k / 2, panels = n / 32, items = experts * panels;
    const int es = out_f32 ? 4 : 2;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 4)
    for (int64_t item = 0; item < items; item++) {
        const int64_t e = item / panels, p = item % panels;
        const uint16_t *w = packed + e * n * k + p * 2 * pairs * 32;
        for (int64_t m0 = offsets[e]; m0 < offsets[e + 1]; m0 += 12) {
            const int64_t left = offsets[e + 1] - m0;
            dot_rows(x + m0 * ldx, ldx, w, pairs, (char *)y + (m0 * ldy + p * 32) * es, ldy,
                     out_f32, (const char *)w, 0, (int)(left < 12 ? left : 12), 2);
        }
    }
    return 0;
}

#else

int dot_gemm(const uint16_t *x, const uint16_t *packed, void *y, int64_t m, int64_t n,
             int64_t k, int64_t ldx, int64_t ldy, int out_f32, int threads) {
    (void)x, (void)packed, (void)y, (void)m, (void)n, (void)k, (void)ldx, (void)ldy;
    (void)out_f32, (void)threads;
    return -1;
}

int dot_grouped_gemm(const uint16_t *x, const uint16_t *packed, void *y, const int64_t *offsets,
                     int64_t experts, int64_t n, int64_t k, int64_t ldx, int64_t ldy,
                     int out_f32, int threads) {
    (void)x, (void)packed, (void)y, (void)offsets, (void)experts, (void)n, (void)k, (void)ldx;
    (void)ldy, (void)out_f32, (void)threads;
    return -1;
}

#endif
