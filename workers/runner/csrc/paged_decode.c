/* Decode attention for CPU that reads K/V straight from the paged pool.
 *
 * The pool of a layer is [num_blocks, num_kv_heads, block_size, head_dim], float32, bfloat16
 * (with bfloat16 queries and output) or int8 rows with a scale (below). One task serves one
 * sequence's KV heads (as many as its buffers hold): it walks the sequence's block table and
 * keeps an online softmax for every query head of those KV heads' GQA groups, so each K/V
 * byte is read once and nothing is gathered. While a block is computed, the start of the
 * next one (anywhere in the pool) is prefetched. Tasks are spread over OpenMP threads.
 *
 * Per block and query row, two primitives: the row's scores against the block's keys, and
 * the weighted sum of the block's values into the row's accumulator. Built with AVX-512 or
 * AVX2+FMA they use it when head_dim is a multiple of 16 (accumulators stay in registers
 * across a block; with AVX2 eight tokens' scores are reduced at once), and with AVX-512 for
 * head_dim 64 or 128 and GQA groups of up to 4 a block is done for the whole group at once
 * (`block_grouped`); otherwise plain loops the compiler vectorizes.
 *
 * A sliding window (`window` > 0) starts each row's walk at position len - window, in the
 * middle of a block where it falls there: the blocks before it are never read. Soft-capping
 * (`softcap` > 0, Gemma 2) maps each block's scores through softcap * tanh(s / softcap)
 * before they enter the softmax. Attention sinks (`sinks` not NULL, gpt-oss: one logit per
 * query head that joins the softmax's denominator and adds no value) start each row's online
 * softmax at that logit: running max the sink, running sum exp(sink - sink) = 1.
 *
 * Built at run time by workers/runner/cpu_decode.py with the flags in cbuild.FLAGS.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "fast_exp.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define MAX_GROUP 16
#define MAX_DIM 256
#define MAX_BLOCK 256
#define MAX_ROWS 32 /* query rows one task holds: >= MAX_GROUP */

enum { POOL_F32 = 0, POOL_I8 = 1, POOL_BF16 = 2 };

/* s[t] = exp(s[t] - shift); returns the sum. */
static inline __attribute__((always_inline)) float exp_shifted(float *s, float shift, int n) {
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int t = 0; t < n; t++) {
        s[t] = exp_nonpositive(s[t] - shift);
        total += s[t];
    }
    return total;
}

/* One block's scores s[0..n) into a row's online softmax: the running max m and sum l take
 * the block in, s becomes exp(s - max); returns the factor the row's accumulator is rescaled
 * by (0 on the first block, where m is -inf). Both the grouped and the per-row paths call
 * it, so an int8 pool (per row) gives the float pool's bits (grouped). */
static inline __attribute__((always_inline)) float softmax_block(float *s, int n, float *m,
                                                                 float *l) {
    float mx = *m;
#if defined(__AVX512F__)
    if (n == 16) { /* a whole block of the default size: the max in one vector op */
        const float block_max = _mm512_reduce_max_ps(_mm512_loadu_ps(s));
        mx = block_max > mx ? block_max : mx;
    } else
#elif defined(__AVX2__)
    if (n == 16) {
        __m256 v = _mm256_max_ps(_mm256_loadu_ps(s), _mm256_loadu_ps(s + 8));
        v = _mm256_max_ps(v, _mm256_permute2f128_ps(v, v, 1));
        v = _mm256_max_ps(v, _mm256_shuffle_ps(v, v, 0x4e));
        v = _mm256_max_ps(v, _mm256_shuffle_ps(v, v, 0xb1));
        const float block_max = _mm256_cvtss_f32(v);
        mx = block_max > mx ? block_max : mx;
    } else
#endif
        for (int t = 0; t < n; t++) mx = s[t] > mx ? s[t] : mx;
    const float correction = exp_nonpositive(*m - mx);
    *m = mx;
    *l = *l * correction + exp_shifted(s, mx, n);
    return correction;
}

/* s[t] = cap * tanh(s[t] / cap), with tanh from the vectorized exp: tanh|x| = (1 - e) / (1 + e),
 * e = exp(-2|x|) <= 1, so exp_nonpositive serves (to a few float32 ulp of the cap). */
static inline __attribute__((always_inline)) void softcap_scores(float *s, int n, float cap) {
    const float inv = 1.0f / cap;
#pragma omp simd
    for (int t = 0; t < n; t++) {
        const float x = s[t] * inv;
        const float e = exp_nonpositive(-2.0f * fabsf(x));
        const float th = (1.0f - e) / (1.0f + e);
        s[t] = x < 0.0f ? -cap * th : cap * th;
    }
}

static void scores_plain(const float *qg, const float *kb, int n, int dim, float *s) {
    for (int t = 0; t < n; t++) {
        const float *kt = kb + (int64_t)t * dim;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int d = 0; d < dim; d++) sum += qg[d] * kt[d];
        s[t] = sum;
    }
}

/* acc = acc * correction + sum_t p[t] * vb[t] */
static void accumulate_plain(float *acc, const float *p, const float *vb, int n, int dim,
                             float correction) {
#pragma omp simd
    for (int d = 0; d < dim; d++) acc[d] *= correction;
    for (int t = 0; t < n; t++) {
        const float *vt = vb + (int64_t)t * dim;
#pragma omp simd
        for (int d = 0; d < dim; d++) acc[d] += p[t] * vt[d];
    }
}

#if defined(__AVX512F__)
static void scores_avx512(const float *qg, const float *kb, int n, int dim, float *s) {
    for (int t = 0; t < n; t++) {
        const float *kt = kb + (int64_t)t * dim;
        __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qg), _mm512_loadu_ps(kt));
        for (int c = 16; c < dim; c += 16)
            a = _mm512_fmadd_ps(_mm512_loadu_ps(qg + c), _mm512_loadu_ps(kt + c), a);
        s[t] = _mm512_reduce_add_ps(a);
    }
}

/* Four 16-wide column chunks at a time, so four independent FMA chains run across the
 * block's tokens instead of one chain waiting on its own latency. */
static void accumulate_avx512(float *acc, const float *p, const float *vb, int n, int dim,
                              float correction) {
    const __m512 corr = _mm512_set1_ps(correction);
    int c = 0;
    for (; c + 64 <= dim; c += 64) {
        __m512 a0 = _mm512_mul_ps(_mm512_loadu_ps(acc + c), corr);
        __m512 a1 = _mm512_mul_ps(_mm512_loadu_ps(acc + c + 16), corr);
        __m512 a2 = _mm512_mul_ps(_mm512_loadu_ps(acc + c + 32), corr);
        __m512 a3 = _mm512_mul_ps(_mm512_loadu_ps(acc + c + 48), corr);
        for (int t = 0; t < n; t++) {
            const float *vt = vb + (int64_t)t * dim + c;
            const __m512 w = _mm512_set1_ps(p[t]);
            a0 = _mm512_fmadd_ps(w, _mm512_loadu_ps(vt), a0);
            a1 = _mm512_fmadd_ps(w, _mm512_loadu_ps(vt + 16), a1);
            a2 = _mm512_fmadd_ps(w, _mm512_loadu_ps(vt + 32), a2);
            a3 = _mm512_fmadd_ps(w, _mm512_loadu_ps(vt + 48), a3);
        }
        _mm512_storeu_ps(acc + c, a0);
        _mm512_storeu_ps(acc + c + 16, a1);
        _mm512_storeu_ps(acc + c + 32, a2);
        _mm512_storeu_ps(acc + c + 48, a3);
    }
    for (; c < dim; c += 16) {
        __m512 a = _mm512_mul_ps(_mm512_loadu_ps(acc + c), corr);
        for (int t = 0; t < n; t++)
            a = _mm512_fmadd_ps(_mm512_set1_ps(p[t]),
                                _mm512_loadu_ps(vb + (int64_t)t * dim + c), a);
        _mm512_storeu_ps(acc + c, a);
    }
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
/* The same two primitives for AVX2 (8 floats a vector, 16 registers). */

/* Eight 8-wide vectors to one vector of their eight horizontal sums (lane j: sum of v[j]). */
static inline __attribute__((always_inline)) __m256 sum8x8(const __m256 *v) {
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

/* Eight tokens at a time: eight independent FMA chains (one per token) and one reduction
 * for all eight, where one token at a time waits on a single chain and reduces alone. */
static void scores_avx2(const float *qg, const float *kb, int n, int dim, float *s) {
    int t = 0;
    for (; t + 8 <= n; t += 8) {
        __m256 a[8];
        for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
        for (int c = 0; c < dim; c += 8) {
            const __m256 q = _mm256_loadu_ps(qg + c);
            for (int j = 0; j < 8; j++)
                a[j] = _mm256_fmadd_ps(q, _mm256_loadu_ps(kb + (int64_t)(t + j) * dim + c), a[j]);
        }
        _mm256_storeu_ps(s + t, sum8x8(a));
    }
    if (t < n) scores_plain(qg, kb + (int64_t)t * dim, n - t, dim, s + t);
}

/* A row's accumulator stays in registers across the block, 64 columns (eight vectors, eight
 * independent FMA chains) at a time. */
static void accumulate_avx2(float *acc, const float *p, const float *vb, int n, int dim,
                            float correction) {
    const __m256 corr = _mm256_set1_ps(correction);
    int c = 0;
    for (; c + 64 <= dim; c += 64) {
        __m256 a[8];
        for (int j = 0; j < 8; j++) a[j] = _mm256_mul_ps(_mm256_loadu_ps(acc + c + 8 * j), corr);
        for (int t = 0; t < n; t++) {
            const float *vt = vb + (int64_t)t * dim + c;
            const __m256 w = _mm256_set1_ps(p[t]);
            for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vt + 8 * j), a[j]);
        }
        for (int j = 0; j < 8; j++) _mm256_storeu_ps(acc + c + 8 * j, a[j]);
    }
    for (; c < dim; c += 8) {
        __m256 a = _mm256_mul_ps(_mm256_loadu_ps(acc + c), corr);
        for (int t = 0; t < n; t++)
            a = _mm256_fmadd_ps(_mm256_set1_ps(p[t]), _mm256_loadu_ps(vb + (int64_t)t * dim + c), a);
        _mm256_storeu_ps(acc + c, a);
    }
}
#endif

#if defined(__AVX512F__)
#define scores_wide scores_avx512
#define accumulate_wide accumulate_avx512
#elif defined(__AVX2__) && defined(__FMA__)
#define scores_wide scores_avx2
#define accumulate_wide accumulate_avx2
#endif

#if defined(__AVX512F__)
/* 16 elements of a float32 or bfloat16 row as float32 (a bfloat16 is a float32's high half). */
static inline __attribute__((always_inline)) __m512 load16(const char *p, int bf) {
    if (bf)
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
    return _mm512_loadu_ps((const float *)p);
}

/* One block of one KV head for all `G` query rows of its GQA group at once, straight from the
 * pool (float32 or bfloat16 rows, `bf`): each K and V row is loaded (and widened) once for
 * the G rows instead of once per row, and the G rows' accumulators for 64 columns stay in
 * registers across the block. `DIM` and `G` are constants at every call (below), so the
 * column loops unroll and the query chunks stay in registers. */
static inline __attribute__((always_inline)) void block_grouped(
    float (*qs)[MAX_DIM], float (*acc)[MAX_DIM], float *m, float *l, const char *kh,
    const char *vh, int n, const int DIM, const int G, const int bf, float cap) {
    const int es = bf ? 2 : 4;
    float s[4][MAX_BLOCK];
    for (int t = 0; t < n; t++) {
        const char *kt = kh + (int64_t)t * DIM * es;
        __m512 a[4];
        for (int r = 0; r < G; r++) a[r] = _mm512_setzero_ps();
        for (int c = 0; c < DIM; c += 16) {
            const __m512 kv = load16(kt + c * es, bf);
            for (int r = 0; r < G; r++) a[r] = _mm512_fmadd_ps(_mm512_loadu_ps(qs[r] + c), kv, a[r]);
        }
        for (int r = 0; r < G; r++) s[r][t] = _mm512_reduce_add_ps(a[r]);
    }
    if (cap > 0.0f)
        for (int r = 0; r < G; r++) softcap_scores(s[r], n, cap);
    float corr[4];
    for (int r = 0; r < G; r++) corr[r] = softmax_block(s[r], n, &m[r], &l[r]);
    for (int c = 0; c < DIM; c += 64) {
        __m512 o[4][4];
        for (int r = 0; r < G; r++) {
            const __m512 cr = _mm512_set1_ps(corr[r]);
            for (int j = 0; j < 4; j++) o[r][j] = _mm512_mul_ps(_mm512_loadu_ps(acc[r] + c + 16 * j), cr);
        }
        for (int t = 0; t < n; t++) {
            const char *vt = vh + ((int64_t)t * DIM + c) * es;
            __m512 vv[4];
            for (int j = 0; j < 4; j++) vv[j] = load16(vt + 16 * j * es, bf);
            for (int r = 0; r < G; r++) {
                const __m512 w = _mm512_set1_ps(s[r][t]);
                for (int j = 0; j < 4; j++) o[r][j] = _mm512_fmadd_ps(w, vv[j], o[r][j]);
            }
        }
        for (int r = 0; r < G; r++)
            for (int j = 0; j < 4; j++) _mm512_storeu_ps(acc[r] + c + 16 * j, o[r][j]);
    }
}

#define GROUPED_CASE(DIM, G)                                                                 \
    case G:                                                                                  \
        if (bf)                                                                              \
            block_grouped(qs, acc, m, l, kh, vh, n, DIM, G, 1, cap);                         \
        else                                                                                 \
            block_grouped(qs, acc, m, l, kh, vh, n, DIM, G, 0, cap);                         \
        return 1;

/* block_grouped for the shapes it is instantiated for (head_dim 64 or 128, groups of 1-4);
 * returns 0, doing nothing, for any other. */
static int block_grouped_any(float (*qs)[MAX_DIM], float (*acc)[MAX_DIM], float *m, float *l,
                             const char *kh, const char *vh, int n, int dim, int group, int bf,
                             float cap) {
    if (dim == 64) {
        switch (group) { GROUPED_CASE(64, 1) GROUPED_CASE(64, 2) GROUPED_CASE(64, 3)
                         GROUPED_CASE(64, 4) }
    } else if (dim == 128) {
        switch (group) { GROUPED_CASE(128, 1) GROUPED_CASE(128, 2) GROUPED_CASE(128, 3)
                         GROUPED_CASE(128, 4) }
    }
    return 0;
}
#endif

/* Prefetch the first lines of each head's run of the next block: the hardware prefetcher
 * follows a run once it starts, where one software prefetch per line stalled the loop. */
static void prefetch_heads(const char *k, const char *v, int64_t base, int heads,
                           int64_t head_stride) {
    for (int j = 0; j < heads; j++) {
        __builtin_prefetch(k + base + j * head_stride, 0, 1);
        __builtin_prefetch(k + base + j * head_stride + 64, 0, 1);
        __builtin_prefetch(v + base + j * head_stride, 0, 1);
        __builtin_prefetch(v + base + j * head_stride + 64, 0, 1);
    }
}

/* int8 pool (kv_cache_dtype int8, workers/runner/kv_quant.py): a row is head_dim int8 values
 * followed by its float32 scale (4 bytes), x = q * scale. A block's rows of one head are
 * dequantized once into a small float buffer (scales folded in), shared by every query head
 * of its GQA group; the float primitives then run on it unchanged (AVX-512 ones included). */
static void dequantize_block(const int8_t *src, int n, int dim, float *dst) {
    const int64_t stride = dim + 4;
    for (int t = 0; t < n; t++) {
        const int8_t *row = src + (int64_t)t * stride;
        float scale;
        memcpy(&scale, row + dim, sizeof scale);
        float *out = dst + (int64_t)t * dim;
#pragma omp simd
        for (int d = 0; d < dim; d++) out[d] = scale * (float)row[d];
    }
}

/* bfloat16 pool: a block's rows of one head are contiguous, widened once into a float buffer
 * like the int8 rows above; half of float32's bytes are read from memory. */
static void widen_block(const bf16 *src, int n, int dim, float *dst) {
    const int64_t count = (int64_t)n * dim;
#pragma omp simd
    for (int64_t i = 0; i < count; i++) dst[i] = bf16_to_f32(src[i]);
}

/* One task: `heads` consecutive KV heads of one sequence and their query rows (`group` per
 * KV head, consecutive in q and out, row stride dim); k, v: the pool offset to the first of
 * those heads, in bytes, rows of the pool's type `kind`. q and out are float32, or bfloat16
 * with a bfloat16 pool. A block's heads lie next to each other in the pool, so the task reads
 * one contiguous run per block (heads x block_size rows of K, the same of V), which the
 * hardware prefetcher follows better than one head's rows alone. */
static inline __attribute__((always_inline)) void decode_task(
    const void *q, const char *k, const char *v, void *out, const int32_t *table, int len,
    int heads, int group, int dim, int block_size, int64_t block_stride, int kind, float scale,
    int wide, int window, float cap, const float *sinks, float *kf, float *vf) {
    float qs[MAX_ROWS][MAX_DIM];
    float acc[MAX_ROWS][MAX_DIM];
    float m[MAX_ROWS], l[MAX_ROWS];
    float s[MAX_BLOCK];
    const int rows = heads * group;
#if defined(__AVX512F__)
    /* the grouped primitives read float32 and bfloat16 rows in place */
    const int grouped = wide && kind != POOL_I8 && group <= 4 && (dim == 64 || dim == 128);
#endif
    const int row_bytes = kind == POOL_I8 ? dim + 4 : kind == POOL_BF16 ? dim * 2 : dim * 4;
    const int64_t head_stride = (int64_t)block_size * row_bytes;
    for (int r = 0; r < rows; r++) {
        for (int d = 0; d < dim; d++) {
            const float x = kind == POOL_BF16 ? bf16_to_f32(((const bf16 *)q)[r * dim + d])
                                              : ((const float *)q)[r * dim + d];
            qs[r][d] = x * scale;
            acc[r][d] = 0.0f;
        }
        m[r] = sinks ? sinks[r] : -INFINITY; /* a sink: one more term, exp(sink - m) */
        l[r] = sinks ? 1.0f : 0.0f;
    }
    /* the first position the row sees: len - window with a window, else 0 */
    const int lo = window > 0 && len > window ? len - window : 0;
    for (int b = lo / block_size, start = b * block_size; start < len; start += block_size, b++) {
        const int skip = lo > start ? lo - start : 0; /* tokens of the block before the window */
        const int64_t base = (int64_t)table[b] * block_stride + (int64_t)skip * row_bytes;
        const int n = (len - start < block_size ? len - start : block_size) - skip;
        if (start + block_size < len)
            prefetch_heads(k, v, (int64_t)table[b + 1] * block_stride, heads, head_stride);
        for (int j = 0; j < heads; j++) {
            const char *kh = k + base + j * head_stride, *vh = v + base + j * head_stride;
#if defined(__AVX512F__)
            if (grouped && block_grouped_any(qs + j * group, acc + j * group, m + j * group,
                                             l + j * group, kh, vh, n, dim, group,
                                             kind == POOL_BF16, cap))
                continue;
#endif
            const float *kb = (const float *)kh, *vb = (const float *)vh;
            if (kind == POOL_I8) {
                dequantize_block((const int8_t *)kh, n, dim, kf);
                dequantize_block((const int8_t *)vh, n, dim, vf);
            } else if (kind == POOL_BF16) {
                widen_block((const bf16 *)kh, n, dim, kf);
                widen_block((const bf16 *)vh, n, dim, vf);
            }
            if (kind != POOL_F32) {
                kb = kf;
                vb = vf;
            }
            for (int r = j * group; r < (j + 1) * group; r++) {
#if defined(scores_wide)
                if (wide)
                    scores_wide(qs[r], kb, n, dim, s);
                else
#endif
                    scores_plain(qs[r], kb, n, dim, s);
                if (cap > 0.0f) softcap_scores(s, n, cap);
                const float correction = softmax_block(s, n, &m[r], &l[r]);
#if defined(accumulate_wide)
                if (wide)
                    accumulate_wide(acc[r], s, vb, n, dim, correction);
                else
#endif
                    accumulate_plain(acc[r], s, vb, n, dim, correction);
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        const float inv = 1.0f / l[r];
        for (int d = 0; d < dim; d++) {
            if (kind == POOL_BF16)
                ((bf16 *)out)[r * dim + d] = f32_to_bf16(acc[r][d] * inv);
            else
                ((float *)out)[r * dim + d] = acc[r][d] * inv;
        }
    }
}

/* decode_task with the pool's type a constant, so each has its own loops. int8 and bfloat16
 * rows that no grouped path reads in place are turned into float32 in a buffer of one block
 * of one head (`buffered`). */
#define DEFINE_DECODE_TASK(SUFFIX, KIND, BUFFERED)                                             \
    static void decode_task_##SUFFIX(const void *q, const char *k, const char *v, void *out,  \
                                     const int32_t *table, int len, int heads, int group,     \
                                     int dim, int block_size, int64_t block_stride,           \
                                     float scale, int wide, int window, float cap,            \
                                     const float *sinks) {                                    \
        float kf[BUFFERED ? block_size * dim : 1], vf[BUFFERED ? block_size * dim : 1];       \
        decode_task(q, k, v, out, table, len, heads, group, dim, block_size, block_stride,    \
                    KIND, scale, wide, window, cap, sinks, kf, vf);                           \
    }

DEFINE_DECODE_TASK(f32, POOL_F32, 0)
DEFINE_DECODE_TASK(i8, POOL_I8, 1)
DEFINE_DECODE_TASK(bf16, POOL_BF16, 1)

/* The entry point. The pool is [blocks, kv_heads, block_size, dim] rows of `kind`: float32,
 * bfloat16, or int8 ([..., dim + 4] bytes: int8 values and a float32 scale). q and out are
 * bfloat16 with a bfloat16 pool, float32 otherwise. Sequences x chunks of KV heads (as many
 * heads per task as the row buffers hold) are spread over OpenMP threads; `plain` forces the
 * portable loops. `window` > 0: each row attends to its last `window` positions (its own
 * included); `softcap` > 0: scores are soft-capped; `sinks`: NULL, or num_heads float32
 * sink logits. Returns 0, or -1 when a shape is past this kernel's fixed limits or `kind`
 * is unknown (checked by the caller first; this is the last guard before a stack overrun). */
int paged_decode(const void *q, const void *k_pool, const void *v_pool, void *out,
                 const int32_t *tables, const int32_t *lens, int num_seqs, int num_heads,
                 int num_kv_heads, int head_dim, int block_size, int table_stride,
                 int64_t q_token_stride, int64_t out_token_stride, float scale,
                 int num_threads, int plain, int kind, int window, float softcap,
                 const float *sinks) {
    const char *k_cache = k_pool, *v_cache = v_pool;
    const int group = num_heads / num_kv_heads;
    if (group > MAX_GROUP || head_dim > MAX_DIM || block_size > MAX_BLOCK) return -1;
    if (kind != POOL_F32 && kind != POOL_I8 && kind != POOL_BF16) return -1;
    const int wide = !plain && head_dim % 16 == 0;
    const int row_bytes = kind == POOL_I8 ? head_dim + 4 : kind == POOL_BF16 ? head_dim * 2
                                                                             : head_dim * 4;
    const int io_bytes = kind == POOL_BF16 ? 2 : 4; /* q and out elements */
    const int64_t head_stride = (int64_t)block_size * row_bytes;
    const int64_t block_stride = (int64_t)num_kv_heads * head_stride;
    const int per_task = MAX_ROWS / group < num_kv_heads ? MAX_ROWS / group : num_kv_heads;
    const int chunks = (num_kv_heads + per_task - 1) / per_task;
    const int tasks = num_seqs * chunks;
    void (*task_fn)(const void *, const char *, const char *, void *, const int32_t *, int, int,
                    int, int, int, int64_t, float, int, int, float, const float *) =
        kind == POOL_I8 ? decode_task_i8 : kind == POOL_BF16 ? decode_task_bf16
                                                             : decode_task_f32;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
    for (int task = 0; task < tasks; task++) {
        const int seq = task / chunks, h = (task % chunks) * per_task;
        const int heads = num_kv_heads - h < per_task ? num_kv_heads - h : per_task;
        const int64_t q_off = (seq * q_token_stride + (int64_t)h * group * head_dim) * io_bytes;
        const int64_t o_off = (seq * out_token_stride + (int64_t)h * group * head_dim) * io_bytes;
        task_fn((const char *)q + q_off, k_cache + h * head_stride, v_cache + h * head_stride,
                (char *)out + o_off, tables + (int64_t)seq * table_stride, lens[seq], heads,
                group, head_dim, block_size, block_stride, scale, wide, window, softcap,
                sinks ? sinks + (int64_t)h * group : NULL);
    }
    return 0;
}
