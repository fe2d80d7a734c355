/* Causal prefill attention on Intel AMX tiles, bfloat16, head size 64 or 128.

   out[i, h] = softmax(scale * q[i, h] . k[g]^T over keys j <= ctx_len + i) . v[g],
   g = h / group.

   Query i of the chunk sits at position ctx_len + i; keys 0..ctx_len-1 come from the cached
   context (gathered out of the pool), the rest are the chunk's own, so no caller copies them
   together. K and V are packed once per call into AMX B-tile layout (K for q.k^T: 16 keys x
   32 dims a tile; V for p.v: 32 keys x 16 dims). Heads of 128 take twice the tiles: their
   scores sum four 32-dim products (the last two q tiles loaded per piece, since a tile
   register is left for only one), and p.v runs in two passes of 64 dims (four accumulators
   each). Each task (a query head and 16 queries;
   a K/V head's tasks run in a row so its packed K/V stay in L2) walks the keys 128 at a
   time: the scores as tiles, an online softmax over them in float32 with AVX-512 (in log2
   units, 2^x by `exp2_avx512`: p is rounded to bfloat16 next), p times V as tiles
   into four accumulators, and the float32 output rescaled as the running maximum moves
   (flash attention's order).

   With a sliding window (`window` > 0) query i sees only keys j > ctx_len + i - window: a
   task's walk starts at the span holding its first query's first visible key, and each
   row's keys before its window are masked out of the softmax like the causal edge.

   The AMX code exists only in a build for a CPU with amx_tile, amx_bf16 and avx512_bf16;
   other builds export the same function and answer -1. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "fast_exp.h"

#define HEAD_MAX 128 /* the largest head size; 64 is the other */
#define SPAN 128 /* keys per softmax step */

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>

#include "amx_tiles.h"

/* Scores: tmm0, 1 q (dims 0-31, 32-63), tmm2, 3 the sums for keys 0-15, 16-31 of a piece.
   Values: tmm0-3 p . v for dims 0-15 ... 48-63, tmm4 p. tmm5-7: K or V tiles, in turn. */
static void configure(int rows) {
    const int rows_of[8] = {rows, rows, rows, rows, rows, 16, 16, 16};
    const tile_config cfg = tile_rows(rows_of);
    _tile_loadconfig(&cfg);
}

/* Where one head's keys (or values) live: the first `ctx` rows in the cached context, the
   rest in the chunk's own. */
typedef struct {
    const uint16_t *ctx, *fresh;
    int64_t ctx_len, ctx_stride, fresh_stride, len;
} rows_of;

static inline const uint16_t *row_at(const rows_of *r, int64_t key) {
    return key < r->ctx_len ? r->ctx + key * r->ctx_stride
                            : r->fresh + (key - r->ctx_len) * r->fresh_stride;
}

/* K -> [key blocks of 16][dim / 32 dim chunks][16 dim pairs][16 keys][2]; keys past len
   are 0. A key's 32-dim chunk is 16 dim pairs, which land in its column of the tile: one
   scatter of 16 pairs (32-bit) a key and chunk. */
static void pack_k(const rows_of *k, int64_t padded, int dim, uint16_t *out) {
    static const uint16_t zeros[HEAD_MAX];
    const int chunks = dim / 32;
    const __m512i down_rows = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(16)); /* a tile row is 16 pairs */
    for (int64_t b = 0; b < padded / 16; b++)
        for (int c = 0; c < 16; c++) {
            const int64_t key = b * 16 + c;
            const uint16_t *src = key < k->len ? row_at(k, key) : zeros;
            for (int chunk = 0; chunk < chunks; chunk++) {
                uint32_t *tile = (uint32_t *)(out + (b * chunks + chunk) * 512);
                _mm512_i32scatter_epi32(tile + c, down_rows,
                                        _mm512_loadu_si512(src + chunk * 32), 4);
            }
        }
}

/* V -> [key blocks of 32][dim / 16 dim slices][16 key pairs][16 dims][2]; keys past len
   are 0. A tile row is two keys' 16 dims interleaved. */
static void pack_v(const rows_of *v, int64_t padded, int dim, uint16_t *out) {
    static const uint16_t zeros[HEAD_MAX];
    const int slices = dim / 16;
    for (int64_t b = 0; b < padded / 32; b++)
        for (int r = 0; r < 16; r++) {
            const int64_t key = b * 32 + 2 * r;
            const uint16_t *even = key < v->len ? row_at(v, key) : zeros;
            const uint16_t *odd = key + 1 < v->len ? row_at(v, key + 1) : zeros;
            for (int slice = 0; slice < slices; slice++) {
                const __m512i lo = _mm512_cvtepu16_epi32(
                    _mm256_loadu_si256((const __m256i *)(even + slice * 16)));
                const __m512i hi = _mm512_cvtepu16_epi32(
                    _mm256_loadu_si256((const __m256i *)(odd + slice * 16)));
                _mm512_store_si512((__m512i *)(out + (b * slices + slice) * 512 + r * 32),
                                   _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
            }
        }
}

/* Scores of one 32-key piece: tmm2 (keys 0-15) and tmm3 (16-31) = q . k^T, from the piece's
   packed K tiles `kt` (key block 0's dim chunks, then key block 1's). q's first two 32-dim
   chunks are in tmm0 and tmm1; a head of 128's other two come from `q2` (row stride `ldq`
   bytes) into tmm4 in turn. */
static inline void piece_scores(const uint16_t *kt, int dim, const uint16_t *q2, int64_t ldq) {
    _tile_zero(2);
    _tile_zero(3);
    if (dim == 64) {
        _tile_loadd(5, kt, 64);
        _tile_dpbf16ps(2, 0, 5);
        _tile_loadd(6, kt + 512, 64);
        _tile_dpbf16ps(2, 1, 6);
        _tile_loadd(7, kt + 1024, 64);
        _tile_dpbf16ps(3, 0, 7);
        _tile_loadd(5, kt + 1536, 64);
        _tile_dpbf16ps(3, 1, 5);
        return;
    }
    const uint16_t *kt1 = kt + 4 * 512; /* keys 16-31 */
    _tile_loadd(5, kt, 64);
    _tile_dpbf16ps(2, 0, 5);
    _tile_loadd(6, kt1, 64);
    _tile_dpbf16ps(3, 0, 6);
    _tile_loadd(7, kt + 512, 64);
    _tile_dpbf16ps(2, 1, 7);
    _tile_loadd(5, kt1 + 512, 64);
    _tile_dpbf16ps(3, 1, 5);
    _tile_loadd(4, q2, ldq);
    _tile_loadd(6, kt + 1024, 64);
    _tile_dpbf16ps(2, 4, 6);
    _tile_loadd(7, kt1 + 1024, 64);
    _tile_dpbf16ps(3, 4, 7);
    _tile_loadd(4, q2 + 32, ldq);
    _tile_loadd(5, kt + 1536, 64);
    _tile_dpbf16ps(2, 4, 5);
    _tile_loadd(6, kt1 + 1536, 64);
    _tile_dpbf16ps(3, 4, 6);
}

/* p . v for 64 dims from `slice` (of 16) on, over `pieces` 32-key pieces: p's pieces from
   `p16` (rows of SPAN), V's from `vh` at the span's first key block `kb0` (`slices` 16-dim
   tiles a block); the sums into pv (rows of `dim` floats) at that slice. */
static inline void pv_four_slices(const uint16_t *p16, const uint16_t *vh, int64_t kb0, int slices,
                              int slice, int pieces, float *pv, int dim) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int piece = 0; piece < pieces; piece++) {
        const uint16_t *vt = vh + ((kb0 + piece) * slices + slice) * 512;
        _tile_loadd(4, p16 + piece * 32, SPAN * 2);
        _tile_loadd(5, vt, 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, vt + 512, 64);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(7, vt + 1024, 64);
        _tile_dpbf16ps(2, 4, 7);
        _tile_loadd(5, vt + 1536, 64);
        _tile_dpbf16ps(3, 4, 5);
    }
    float *at = pv + slice * 16;
    _tile_stored(0, at, dim * 4);
    _tile_stored(1, at + 16, dim * 4);
    _tile_stored(2, at + 32, dim * 4);
    _tile_stored(3, at + 48, dim * 4);
}

/* q [q_len, heads, dim] (dim 64 or 128) (strides in elements); the cached context's K and V
   [kv_heads, ctx_len, dim] (strides ctx_head, ctx_tok); the chunk's own K and V
   [q_len, kv_heads, dim] (strides new_tok, new_head); out like q. Query i sits at position
   ctx_len + i; with `window` > 0 it sees keys ctx_len + i - window < j <= ctx_len + i. 0; -1 if
   this build has no AMX; -2 if memory runs out. */
int amx_prefill_attention(const uint16_t *q, int64_t q_tok, int64_t q_head,
                          const uint16_t *k_ctx, const uint16_t *v_ctx, int64_t ctx_head,
                          int64_t ctx_tok, const uint16_t *k_new, const uint16_t *v_new,
                          int64_t new_tok, int64_t new_head, uint16_t *out, int64_t o_tok,
                          int64_t o_head, int64_t q_len, int64_t ctx_len, int64_t heads,
                          int64_t kv_heads, int64_t dim, float scale, int threads,
                          int64_t window) {
    if (q_len < 1 || ctx_len < 0 || heads % kv_heads != 0 || (dim != 64 && dim != 128))
        return -1;
    const int64_t kv_len = ctx_len + q_len, start = ctx_len;
    /* whole 32-key pieces: a span's walk stops at the piece holding its last key */
    const int64_t padded = (kv_len + 31) / 32 * 32, group = heads / kv_heads;
    uint16_t *kp = aligned_alloc(64, (size_t)(kv_heads * padded * dim * 2));
    uint16_t *vp = aligned_alloc(64, (size_t)(kv_heads * padded * dim * 2));
    if (kp == NULL || vp == NULL) {
        free(kp);
        free(vp);
        return -2;
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t g = 0; g < 2 * kv_heads; g++) {
        const int64_t head = g / 2;
        const int is_k = g % 2 == 0;
        const rows_of rows = {(is_k ? k_ctx : v_ctx) + head * ctx_head,
                              (is_k ? k_new : v_new) + head * new_head, ctx_len, ctx_tok,
                              new_tok, kv_len};
        if (is_k) pack_k(&rows, padded, (int)dim, kp + head * padded * dim);
        else pack_v(&rows, padded, (int)dim, vp + head * padded * dim);
    }
    const int64_t q_blocks = (q_len + 15) / 16;
#pragma omp parallel num_threads(threads)
    {
        float scores[16 * SPAN] __attribute__((aligned(64)));
        float pv[16 * HEAD_MAX] __attribute__((aligned(64)));
        float acc[16 * HEAD_MAX] __attribute__((aligned(64)));
        uint16_t p16[16 * SPAN] __attribute__((aligned(64)));
        float row_max[16], row_sum[16];
        int configured = -1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < heads * q_blocks; task++) {
            /* a K/V head's tasks in a row (its query heads, then its query blocks), so the
               packed K and V stay in L2 while every task of the head walks them */
            const int64_t g = task / (group * q_blocks), in_g = task % (group * q_blocks);
            const int64_t h = g * group + in_g % group, qb = in_g / group;
            const int64_t q0 = qb * 16;
            const int rows = (int)(q_len - q0 < 16 ? q_len - q0 : 16);
            if (configured != rows) {
                configure(rows);
                configured = rows;
            }
            const uint16_t *qrow = q + q0 * q_tok + h * q_head;
            for (int i = 0; i < 16; i++) {
                row_max[i] = -INFINITY;
                row_sum[i] = 0.0f;
            }
            memset(acc, 0, sizeof acc);
            const int64_t last_key = start + q0 + rows - 1 < kv_len - 1 ? start + q0 + rows - 1
                                                                       : kv_len - 1;
            const uint16_t *kh = kp + g * padded * dim, *vh = vp + g * padded * dim;
            /* the span holding the first query's first visible key */
            const int64_t k_first = window > 0 && start + q0 - window + 1 > 0
                                        ? (start + q0 - window + 1) / SPAN * SPAN : 0;
            for (int64_t k0 = k_first; k0 <= last_key; k0 += SPAN) {
                /* 32-key pieces of this span that hold a key some row sees */
                const int pieces = (int)((last_key - k0) / 32 + 1 < SPAN / 32
                                             ? (last_key - k0) / 32 + 1 : SPAN / 32);
                _tile_loadd(0, qrow, q_tok * 2);
                _tile_loadd(1, qrow + 32, q_tok * 2);
                for (int piece = 0; piece < pieces; piece++) {
                    /* a piece is two 16-key blocks of dim / 32 tiles */
                    piece_scores(kh + (k0 / 32 + piece) * (dim / 16) * 512, (int)dim, qrow + 64,
                                 q_tok * 2);
                    _tile_stored(2, scores + piece * 32, SPAN * 4);
                    _tile_stored(3, scores + piece * 32 + 16, SPAN * 4);
                }
                const int vectors = pieces * 2;
                /* scores in log2 units: p = 2^(s * scale * log2(e) - max) */
                const __m512 ninf = _mm512_set1_ps(-INFINITY);
                const __m512 vc = _mm512_set1_ps(scale * 1.44269504088896341f);
                for (int i = 0; i < rows; i++) {
                    /* keys k0 + c with c <= seen are visible to row i */
                    const int64_t last = start + q0 + i < kv_len - 1 ? start + q0 + i : kv_len - 1;
                    const int64_t seen = last - k0;
                    /* and, with a window, those with c >= from */
                    const int64_t from = window > 0 ? start + q0 + i - window + 1 - k0 : 0;
                    const float *srow = scores + i * SPAN;
                    __mmask16 visible[SPAN / 16];
                    __m512 vmax = ninf;
                    if (seen >= SPAN - 1 && from <= 0) { /* the whole span: no edge, no padding */
                        for (int t = 0; t < vectors; t++) {
                            visible[t] = (__mmask16)0xffff;
                            vmax = _mm512_max_ps(vmax, _mm512_mul_ps(_mm512_load_ps(srow + 16 * t),
                                                                     vc));
                        }
                    } else {
                        for (int t = 0; t < vectors; t++) {
                            const int64_t upto = seen - 16 * t; /* visible lanes: 0..upto */
                            visible[t] = upto >= 15 ? (__mmask16)0xffff
                                         : upto < 0 ? (__mmask16)0
                                                    : (__mmask16)((1u << (upto + 1)) - 1);
                            const int64_t below = from - 16 * t; /* lanes 0..below-1 not seen */
                            if (below > 0)
                                visible[t] &= below >= 16 ? (__mmask16)0
                                                          : (__mmask16)(0xffffu << below);
                            vmax = _mm512_mask_max_ps(
                                vmax, visible[t], vmax,
                                _mm512_mul_ps(_mm512_load_ps(srow + 16 * t), vc));
                        }
                    }
                    const float block_max = _mm512_reduce_max_ps(vmax);
                    const float new_max = block_max > row_max[i] ? block_max : row_max[i];
                    const float alpha =
                        row_max[i] == -INFINITY
                            ? 0.0f
                            : exp_nonpositive((row_max[i] - new_max) * 0.693147180559945f);
                    const __m512 vnew = _mm512_set1_ps(new_max);
                    __m512 vsum = _mm512_setzero_ps();
                    for (int t = 0; t < vectors; t += 2) {
                        const __m512 p0 = _mm512_maskz_mov_ps(
                            visible[t],
                            exp2_avx512(_mm512_fmsub_ps(_mm512_load_ps(srow + 16 * t), vc, vnew)));
                        const __m512 p1 = _mm512_maskz_mov_ps(
                            visible[t + 1], exp2_avx512(_mm512_fmsub_ps(
                                                _mm512_load_ps(srow + 16 * t + 16), vc, vnew)));
                        vsum = _mm512_add_ps(vsum, _mm512_add_ps(p0, p1));
                        _mm512_store_si512((__m512i *)(p16 + i * SPAN + 16 * t),
                                           (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
                    }
                    row_sum[i] = row_sum[i] * alpha + _mm512_reduce_add_ps(vsum);
                    row_max[i] = new_max;
                    float *a = acc + i * dim;
                    const __m512 va = _mm512_set1_ps(alpha);
                    for (int d = 0; d < dim; d += 16)
                        _mm512_store_ps(a + d, _mm512_mul_ps(_mm512_load_ps(a + d), va));
                }
                for (int slice = 0; slice < dim / 16; slice += 4)
                    pv_four_slices(p16, vh, k0 / 32, (int)dim / 16, slice, pieces, pv, (int)dim);
                for (int i = 0; i < rows; i++)
                    for (int d = 0; d < dim; d += 16) {
                        float *a = acc + i * dim + d;
                        _mm512_store_ps(a, _mm512_add_ps(_mm512_load_ps(a),
                                                         _mm512_load_ps(pv + i * dim + d)));
                    }
            }
            for (int i = 0; i < rows; i++) {
                uint16_t *o = out + (q0 + i) * o_tok + h * o_head;
                const float inv = 1.0f / row_sum[i];
                for (int d = 0; d < dim; d++) o[d] = f32_to_bf16(acc[i * dim + d] * inv);
            }
        }
        if (configured != -1) _tile_release();
    }
    free(kp);
    free(vp);
    return 0;
}

#else

int amx_prefill_attention(const uint16_t *q, int64_t q_tok, int64_t q_head,
                          const uint16_t *k_ctx, const uint16_t *v_ctx, int64_t ctx_head,
                          int64_t ctx_tok, const uint16_t *k_new, const uint16_t *v_new,
                          int64_t new_tok, int64_t new_head, uint16_t *out, int64_t o_tok,
                          int64_t o_head, int64_t q_len, int64_t ctx_len, int64_t heads,
                          int64_t kv_heads, int64_t dim, float scale, int threads,
                          int64_t window) {
    (void)dim, (void)q, (void)q_tok, (void)q_head, (void)k_ctx, (void)v_ctx, (void)ctx_head;
    (void)ctx_tok, (void)k_new, (void)v_new, (void)new_tok, (void)new_head, (void)out;
    (void)o_tok, (void)o_head, (void)q_len, (void)ctx_len, (void)heads, (void)kv_heads;
    (void)scale, (void)threads, (void)window;
    return -1;
}

#endif
