/* Decode attention for CPU that reads K/V straight from the paged pool.
 *
 * The pool of a layer is [num_blocks, num_kv_heads, block_size, head_dim], float32 (or int8
 * rows with a scale, below). One task serves one sequence's KV heads (as many as its buffers
 * hold): it walks the sequence's block table and keeps an online softmax for every query head
 * of those KV heads' GQA groups, so each K/V byte is read once and nothing is gathered. While
 * a block is computed, the next one (anywhere in the pool) is prefetched into L2. Tasks are
 * spread over OpenMP threads.
 *
 * Per block and query row, two primitives: the row's scores against the block's keys, and
 * the weighted sum of the block's values into the row's accumulator. Built with AVX-512 they
 * use it when head_dim is a multiple of 16 (accumulators stay in registers across a block);
 * otherwise plain loops the compiler vectorizes.
 *
 * Built at run time by workers/runner/cpu_decode.py (cc -O3 -march=native -fopenmp).
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "fast_exp.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define MAX_GROUP 16
#define MAX_DIM 256
#define MAX_BLOCK 256
#define MAX_ROWS 32 /* query rows one task holds: >= MAX_GROUP */

/* s[t] = exp(s[t] - shift); returns the sum. */
static float exp_shifted(float *s, float shift, int n) {
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int t = 0; t < n; t++) {
        s[t] = exp_nonpositive(s[t] - shift);
        total += s[t];
    }
    return total;
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

/* Prefetch `bytes` from k + base and v + base into L2, one 64-byte line per call. */
static void prefetch_block(const char *k, const char *v, int64_t base, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) {
        __builtin_prefetch(k + base + off, 0, 1);
        __builtin_prefetch(v + base + off, 0, 1);
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

/* One task: `heads` consecutive KV heads of one sequence and their query rows (`group` per
 * KV head, consecutive in q and out, row stride dim); k, v: the pool offset to the first of
 * those heads, in bytes, float32 rows or int8 ones (`int8`). A block's heads lie next to
 * each other in the pool, so the task reads one contiguous run per block (heads x
 * block_size rows of K, the same of V), which the hardware prefetcher follows better than
 * one head's rows alone. */
static inline __attribute__((always_inline)) void decode_task(
    const float *q, const char *k, const char *v, float *out, const int32_t *table, int len,
    int heads, int group, int dim, int block_size, int64_t block_stride, int int8, float scale,
    int wide, float *kf, float *vf) {
    float qs[MAX_ROWS][MAX_DIM];
    float acc[MAX_ROWS][MAX_DIM];
    float m[MAX_ROWS], l[MAX_ROWS];
    float s[MAX_BLOCK];
    const int rows = heads * group;
    const int64_t head_stride = (int64_t)block_size * (int8 ? dim + 4 : dim * 4); /* bytes */
    for (int r = 0; r < rows; r++) {
        for (int d = 0; d < dim; d++) {
            qs[r][d] = q[r * dim + d] * scale;
            acc[r][d] = 0.0f;
        }
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    for (int start = 0, b = 0; start < len; start += block_size, b++) {
        const int64_t base = (int64_t)table[b] * block_stride;
        const int n = len - start < block_size ? len - start : block_size;
        if (start + block_size < len)
            prefetch_block(k, v, (int64_t)table[b + 1] * block_stride, heads * head_stride);
        for (int j = 0; j < heads; j++) {
            const char *kh = k + base + j * head_stride, *vh = v + base + j * head_stride;
            const float *kb = (const float *)kh, *vb = (const float *)vh;
            if (int8) {
                dequantize_block((const int8_t *)kh, n, dim, kf);
                dequantize_block((const int8_t *)vh, n, dim, vf);
                kb = kf;
                vb = vf;
            }
            for (int r = j * group; r < (j + 1) * group; r++) {
#if defined(__AVX512F__)
                if (wide)
                    scores_avx512(qs[r], kb, n, dim, s);
                else
#endif
                    scores_plain(qs[r], kb, n, dim, s);
                float mx = m[r];
                for (int t = 0; t < n; t++) mx = s[t] > mx ? s[t] : mx;
                const float correction = expf(m[r] - mx); /* 0 on the first block: m is -inf */
                m[r] = mx;
                l[r] = l[r] * correction + exp_shifted(s, mx, n);
#if defined(__AVX512F__)
                if (wide)
                    accumulate_avx512(acc[r], s, vb, n, dim, correction);
                else
#endif
                    accumulate_plain(acc[r], s, vb, n, dim, correction);
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        const float inv = 1.0f / l[r];
        for (int d = 0; d < dim; d++) out[r * dim + d] = acc[r][d] * inv;
    }
}

/* decode_task with the pool's type a constant, so each has its own loops. */
static void decode_task_f32(const float *q, const char *k, const char *v, float *out,
                            const int32_t *table, int len, int heads, int group, int dim,
                            int block_size, int64_t block_stride, float scale, int wide) {
    decode_task(q, k, v, out, table, len, heads, group, dim, block_size, block_stride, 0, scale,
                wide, NULL, NULL);
}

static void decode_task_i8(const float *q, const char *k, const char *v, float *out,
                           const int32_t *table, int len, int heads, int group, int dim,
                           int block_size, int64_t block_stride, float scale, int wide) {
    float kf[block_size * dim], vf[block_size * dim]; /* one block of one head, dequantized */
    decode_task(q, k, v, out, table, len, heads, group, dim, block_size, block_stride, 1, scale,
                wide, kf, vf);
}

/* The entry point. The pool is [blocks, kv_heads, block_size, dim] float32 rows, or with
 * `int8` [blocks, kv_heads, block_size, dim + 4] bytes (int8 values and a float32 scale); q
 * and out are float32 either way. Sequences x chunks of KV heads (as many heads per task as
 * the row buffers hold) are spread over OpenMP threads; `plain` forces the portable loops.
 * Returns 0, or -1 when a shape is past this kernel's fixed limits (checked by the caller
 * first; this is the last guard before a stack overrun). */
int paged_decode(const float *q, const void *k_pool, const void *v_pool, float *out,
                 const int32_t *tables, const int32_t *lens, int num_seqs, int num_heads,
                 int num_kv_heads, int head_dim, int block_size, int table_stride,
                 int64_t q_token_stride, int64_t out_token_stride, float scale,
                 int num_threads, int plain, int int8) {
    const char *k_cache = k_pool, *v_cache = v_pool;
    const int group = num_heads / num_kv_heads;
    if (group > MAX_GROUP || head_dim > MAX_DIM || block_size > MAX_BLOCK) return -1;
    const int wide = !plain && head_dim % 16 == 0;
    const int64_t head_stride = (int64_t)block_size * (int8 ? head_dim + 4 : head_dim * 4);
    const int64_t block_stride = (int64_t)num_kv_heads * head_stride;
    const int per_task = MAX_ROWS / group < num_kv_heads ? MAX_ROWS / group : num_kv_heads;
    const int chunks = (num_kv_heads + per_task - 1) / per_task;
    const int tasks = num_seqs * chunks;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
    for (int task = 0; task < tasks; task++) {
        const int seq = task / chunks, h = (task % chunks) * per_task;
        const int heads = num_kv_heads - h < per_task ? num_kv_heads - h : per_task;
        const int64_t q_off = seq * q_token_stride + (int64_t)h * group * head_dim;
        const int64_t o_off = seq * out_token_stride + (int64_t)h * group * head_dim;
        (int8 ? decode_task_i8 : decode_task_f32)(
            q + q_off, k_cache + h * head_stride, v_cache + h * head_stride, out + o_off,
            tables + (int64_t)seq * table_stride, lens[seq], heads, group, head_dim, block_size,
            block_stride, scale, wide);
    }
    return 0;
}
