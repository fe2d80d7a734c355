/* Element-wise parts of a Llama layer on CPU, each one pass over memory, for float32 and
 * bfloat16 tensors (computed in float32 either way; bfloat16 results are rounded once).
 *
 * PyTorch runs RMSNorm as six kernels (square, mean, add, rsqrt, two multiplies) with a fresh
 * tensor after each, SiLU-and-multiply as two (the SiLU on a strided half), the residual add
 * as one more, and RoPE as a gather, four multiplies, two adds and a concatenation per q and
 * k. Here each is one loop that reads its input once and writes its output once, parallel over
 * rows with OpenMP (the runtime PyTorch already loaded).
 *
 * Built at run time by workers/runner/cpu_fused.py with the flags in cbuild.FLAGS, like the
 * decode kernel; loops are written for the compiler to vectorize (AVX-512, AVX2 or plain).
 * Each operation is written once, as a macro over the element type, and instantiated below.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "fast_exp.h"

/* Below this many elements a loop runs on the calling thread: waking the team costs more. */
#define PARALLEL_MIN 32768

static inline float load_f32(const float *p) { return *p; }
static inline void store_f32(float *p, float x) { *p = x; }
static inline float load_bf16(const bf16 *p) { return bf16_to_f32(*p); }
static inline void store_bf16(bf16 *p, float x) { *p = f32_to_bf16(x); }

/* silu(g) * u, the sigmoid from e = exp(-|g|) <= 1, which never overflows. */
static inline float silu_times(float g, float u) {
    const float e = exp_nonpositive(-fabsf(g));
    return g * ((g >= 0.0f ? 1.0f : e) / (1.0f + e)) * u;
}

/* out[r, i] = silu(x[r, i]) * x[r, n + i]: the fused gate_up projection's two halves. */
#define DEFINE_SILU_MUL(T, SUFFIX)                                                            \
    void silu_mul_##SUFFIX(const T *x, T *out, int64_t rows, int64_t n, int64_t x_stride,    \
                           int64_t out_stride, int threads) {                                 \
        _Pragma("omp parallel for num_threads(threads) if (rows * n >= PARALLEL_MIN)") \
        for (int64_t r = 0; r < rows; r++) {                                                  \
            const T *gate = x + r * x_stride;                                                 \
            const T *up = gate + n;                                                           \
            T *o = out + r * out_stride;                                                      \
            int64_t i = 0;                                                                    \
            SILU_MUL_VECTORS(SUFFIX) /* AVX-512 builds: 16 at a time, the rest below */       \
            _Pragma("omp simd")                                                               \
            for (int64_t j = i; j < n; j++)                                                   \
                store_##SUFFIX(o + j, silu_times(load_##SUFFIX(gate + j),                     \
                                                 load_##SUFFIX(up + j)));                     \
        }                                                                                     \
    }

/* With `add`, residual[r] += x[r] first (rounded to T, as the residual stream is stored);
 * then out[r] = residual[r] / rms(residual[r]) * w. Without it, out = rmsnorm(residual)
 * (the first layer: the residual is the embedding). Each pass may start with a vector part
 * (`RMS_*_VECTORS`, AVX-512 builds) that advances `i`; the element loops finish the row. */
#define DEFINE_ADD_RMS_NORM(T, SUFFIX)                                                        \
    void add_rms_norm_##SUFFIX(const T *x, T *residual, T *out, const T *w, int64_t rows,    \
                               int64_t n, float eps, int add, int threads) {                  \
        _Pragma("omp parallel for num_threads(threads) if (rows * n >= PARALLEL_MIN)") \
        for (int64_t r = 0; r < rows; r++) {                                                  \
            T *h = residual + r * n;                                                          \
            T *o = out + r * n;                                                               \
            float squares = 0.0f;                                                             \
            int64_t i = 0;                                                                    \
            const T *xr = add ? x + r * n : NULL; /* read only with `add` */                 \
            if (add) {                                                                        \
                RMS_ADD_VECTORS(SUFFIX)                                                       \
                _Pragma("omp simd reduction(+ : squares)")                                    \
                for (int64_t j = i; j < n; j++) {                                             \
                    store_##SUFFIX(h + j, load_##SUFFIX(h + j) + load_##SUFFIX(xr + j));      \
                    const float v = load_##SUFFIX(h + j);                                     \
                    squares += v * v;                                                         \
                }                                                                             \
            } else {                                                                          \
                RMS_SQUARES_VECTORS(SUFFIX)                                                   \
                _Pragma("omp simd reduction(+ : squares)")                                    \
                for (int64_t j = i; j < n; j++) {                                             \
                    const float v = load_##SUFFIX(h + j);                                     \
                    squares += v * v;                                                         \
                }                                                                             \
            }                                                                                 \
            const float inv = 1.0f / sqrtf(squares / (float)n + eps);                         \
            i = 0;                                                                            \
            RMS_SCALE_VECTORS(SUFFIX)                                                         \
            _Pragma("omp simd")                                                               \
            for (int64_t j = i; j < n; j++)                                                   \
                store_##SUFFIX(o + j, load_##SUFFIX(h + j) * inv * load_##SUFFIX(w + j));     \
        }                                                                                     \
    }

/* Rotate halves (HF's layout) of `heads` heads per token, in place: the q and k heads lead
 * each row of the fused qkv output. cos/sin are the model's float32 tables
 * [positions, dim / 2]. */
#define DEFINE_ROPE(T, SUFFIX)                                                                \
    void rope_##SUFFIX(T *x, const int64_t *positions, const float *cos_table,               \
                       const float *sin_table, int64_t tokens, int64_t stride, int heads,     \
                       int dim, int threads) {                                                \
        const int half = dim / 2;                                                             \
        _Pragma("omp parallel for num_threads(threads) if (tokens * heads * dim >= PARALLEL_MIN)") \
        for (int64_t t = 0; t < tokens; t++) {                                                \
            const float *c = cos_table + positions[t] * half;                                 \
            const float *s = sin_table + positions[t] * half;                                 \
            for (int h = 0; h < heads; h++) {                                                 \
                T *x1 = x + t * stride + (int64_t)h * dim;                                    \
                T *x2 = x1 + half;                                                            \
                int i = 0;                                                                    \
                ROPE_VECTORS(SUFFIX) /* AVX-512 builds: 16 pairs at a time, the rest below */ \
                _Pragma("omp simd")                                                           \
                for (int j = i; j < half; j++) {                                              \
                    const float a = load_##SUFFIX(x1 + j), b = load_##SUFFIX(x2 + j);         \
                    store_##SUFFIX(x1 + j, a * c[j] - b * s[j]);                              \
                    store_##SUFFIX(x2 + j, b * c[j] + a * s[j]);                              \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
    }

/* The step's new K and V rows, which follow the q heads in each row of the fused qkv output
 * (k at column k_col, v at k_col + kv_heads * dim), copied into the pools at `rows`
 * ([tokens * kv_heads] row indices into the pools viewed as [-1, dim]). */
#define DEFINE_STORE_KV(T, SUFFIX)                                                            \
    void store_kv_##SUFFIX(const T *qkv, int64_t tokens, int64_t stride, int64_t k_col,      \
                           int kv_heads, int dim, const int64_t *rows, T *k_pool, T *v_pool,  \
                           int threads) {                                                     \
        const int64_t v_col = k_col + (int64_t)kv_heads * dim;                                \
        _Pragma("omp parallel for num_threads(threads) if (tokens * kv_heads * dim >= PARALLEL_MIN)") \
        for (int64_t t = 0; t < tokens; t++) {                                                \
            for (int h = 0; h < kv_heads; h++) {                                              \
                const int64_t row = rows[t * kv_heads + h] * dim;                             \
                memcpy(k_pool + row, qkv + t * stride + k_col + (int64_t)h * dim,             \
                       (size_t)dim * sizeof(T));                                              \
                memcpy(v_pool + row, qkv + t * stride + v_col + (int64_t)h * dim,             \
                       (size_t)dim * sizeof(T));                                              \
            }                                                                                 \
        }                                                                                     \
    }

/* Mixture-of-experts: y[t] = sum_j w[t * k + j] * rows[index[t * k + j]] for each token t:
 * the experts' output rows (sorted by expert) gathered back to their tokens and weighted by
 * the router, summed in float32 and rounded once; 512 columns at a time. */
#define MOE_SUM_COLUMNS 512
#define DEFINE_MOE_SUM(T, SUFFIX)                                                             \
    void moe_sum_##SUFFIX(const T *rows, const int64_t *index, const float *w, T *y,         \
                          int64_t tokens, int64_t k, int64_t n, int64_t rows_stride,          \
                          int64_t y_stride, int threads) {                                    \
        _Pragma("omp parallel for num_threads(threads) if (tokens * k * n >= PARALLEL_MIN)") \
        for (int64_t t = 0; t < tokens; t++) {                                                \
            float acc[MOE_SUM_COLUMNS];                                                       \
            for (int64_t c0 = 0; c0 < n; c0 += MOE_SUM_COLUMNS) {                             \
                const int64_t width = n - c0 < MOE_SUM_COLUMNS ? n - c0 : MOE_SUM_COLUMNS;    \
                _Pragma("omp simd")                                                           \
                for (int64_t i = 0; i < width; i++) acc[i] = 0.0f;                            \
                for (int64_t j = 0; j < k; j++) {                                             \
                    const T *row = rows + index[t * k + j] * rows_stride + c0;                \
                    const float weight = w[t * k + j];                                        \
                    _Pragma("omp simd")                                                       \
                    for (int64_t i = 0; i < width; i++)                                       \
                        acc[i] += weight * load_##SUFFIX(row + i);                            \
                }                                                                             \
                T *o = y + t * y_stride + c0;                                                 \
                _Pragma("omp simd")                                                           \
                for (int64_t i = 0; i < width; i++) store_##SUFFIX(o + i, acc[i]);            \
            }                                                                                 \
        }                                                                                     \
    }

DEFINE_STORE_KV(float, f32)
DEFINE_STORE_KV(bf16, bf16)
#if defined(__AVX512F__)
#include <immintrin.h>

/* The instances with AVX-512 written out: GCC 12 left the macro's bfloat16 loops scalar (5.7
 * GB/s against 31-34 here, 2,048 tokens of Qwen3-MoE on an AMX Xeon; float32 14 -> 50).
 * Sixteen lanes of T to and from float32: */
static inline __m512 load16_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline void store16_f32(float *p, __m512 v) { _mm512_storeu_ps(p, v); }

static inline __m512 load16_bf16(const bf16 *p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

/* f32_to_bf16 on 16 lanes: round to nearest even, NaN kept quiet. */
static inline void store16_bf16(bf16 *p, __m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i out = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    out = _mm512_mask_mov_epi32(out, nan, _mm512_or_si512(bits, _mm512_set1_epi32(0x400000)));
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(out, 16)));
}

#define DEFINE_MOE_SUM_AVX512(T, SUFFIX)                                                      \
    void moe_sum_##SUFFIX(const T *rows, const int64_t *index, const float *w, T *y,         \
                          int64_t tokens, int64_t k, int64_t n, int64_t rows_stride,          \
                          int64_t y_stride, int threads) {                                    \
        _Pragma("omp parallel for num_threads(threads) if (tokens * k * n >= PARALLEL_MIN)") \
        for (int64_t t = 0; t < tokens; t++) {                                                \
            T *o = y + t * y_stride;                                                          \
            int64_t c = 0;                                                                    \
            for (; c + 64 <= n; c += 64) { /* four vectors of sums a pass over the k rows */  \
                __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                   \
                for (int64_t j = 0; j < k; j++) {                                             \
                    const T *row = rows + index[t * k + j] * rows_stride + c;                 \
                    const __m512 wj = _mm512_set1_ps(w[t * k + j]);                           \
                    a0 = _mm512_fmadd_ps(wj, load16_##SUFFIX(row), a0);                       \
                    a1 = _mm512_fmadd_ps(wj, load16_##SUFFIX(row + 16), a1);                  \
                    a2 = _mm512_fmadd_ps(wj, load16_##SUFFIX(row + 32), a2);                  \
                    a3 = _mm512_fmadd_ps(wj, load16_##SUFFIX(row + 48), a3);                  \
                }                                                                             \
                store16_##SUFFIX(o + c, a0);                                                  \
                store16_##SUFFIX(o + c + 16, a1);                                             \
                store16_##SUFFIX(o + c + 32, a2);                                             \
                store16_##SUFFIX(o + c + 48, a3);                                             \
            }                                                                                 \
            for (; c < n; c++) { /* a width off 64 */                                        \
                float acc = 0.0f;                                                             \
                for (int64_t j = 0; j < k; j++)                                               \
                    acc += w[t * k + j] * load_##SUFFIX(rows + index[t * k + j] * rows_stride \
                                                        + c);                                 \
                store_##SUFFIX(o + c, acc);                                                   \
            }                                                                                 \
        }                                                                                     \
    }

/* silu_mul's vector part: the sigmoid's exp(-|g|) as 2^(-|g| log2 e) by exp2_avx512. */
#define SILU_MUL_VECTORS(SUFFIX)                                                              \
    for (; i + 16 <= n; i += 16) {                                                            \
        const __m512 g = load16_##SUFFIX(gate + i);                                           \
        const __m512 e = exp2_avx512(                                                         \
            _mm512_mul_ps(_mm512_abs_ps(g), _mm512_set1_ps(-1.44269504088896341f)));          \
        const __m512 one = _mm512_set1_ps(1.0f);                                              \
        const __mmask16 positive = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_GE_OQ);    \
        const __m512 sigmoid = _mm512_div_ps(_mm512_mask_mov_ps(e, positive, one),            \
                                             _mm512_add_ps(one, e));                          \
        store16_##SUFFIX(o + i, _mm512_mul_ps(_mm512_mul_ps(g, sigmoid),                      \
                                              load16_##SUFFIX(up + i)));                      \
    }

/* add_rms_norm's vector parts: the residual (rounded to T) and its squares, summed in one
 * vector, then the scaled row. GCC 12 left the bfloat16 loops scalar: 2,048 x 1,024 took 2.37
 * ms (7 GB/s) against float32's 0.72 on an AMX Xeon. */
#define RMS_SQUARES_PART(SUFFIX, ADD)                                                         \
    {                                                                                         \
        __m512 sq = _mm512_setzero_ps();                                                      \
        for (; i + 16 <= n; i += 16) {                                                        \
            if (ADD)                                                                          \
                store16_##SUFFIX(h + i, _mm512_add_ps(load16_##SUFFIX(h + i),                 \
                                                      load16_##SUFFIX(xr + i)));              \
            const __m512 v = load16_##SUFFIX(h + i);                                          \
            sq = _mm512_fmadd_ps(v, v, sq);                                                   \
        }                                                                                     \
        squares += _mm512_reduce_add_ps(sq);                                                  \
    }
#define RMS_ADD_VECTORS(SUFFIX) RMS_SQUARES_PART(SUFFIX, 1)
#define RMS_SQUARES_VECTORS(SUFFIX) RMS_SQUARES_PART(SUFFIX, 0)
#define RMS_SCALE_VECTORS(SUFFIX)                                                             \
    {                                                                                         \
        const __m512 scale = _mm512_set1_ps(inv);                                             \
        for (; i + 16 <= n; i += 16)                                                          \
            store16_##SUFFIX(o + i, _mm512_mul_ps(_mm512_mul_ps(load16_##SUFFIX(h + i), scale), \
                                                  load16_##SUFFIX(w + i)));                   \
    }

/* rope's vector part: bfloat16 1.31 -> 0.88 ms for 2,048 tokens of 24 heads of 128 here. */
#define ROPE_VECTORS(SUFFIX)                                                                  \
    for (; i + 16 <= half; i += 16) {                                                         \
        const __m512 a = load16_##SUFFIX(x1 + i), b = load16_##SUFFIX(x2 + i);                \
        const __m512 ci = _mm512_loadu_ps(c + i), si = _mm512_loadu_ps(s + i);                \
        store16_##SUFFIX(x1 + i, _mm512_sub_ps(_mm512_mul_ps(a, ci), _mm512_mul_ps(b, si)));  \
        store16_##SUFFIX(x2 + i, _mm512_add_ps(_mm512_mul_ps(b, ci), _mm512_mul_ps(a, si)));  \
    }

DEFINE_MOE_SUM_AVX512(float, f32)
DEFINE_MOE_SUM_AVX512(bf16, bf16)
#else
#define ROPE_VECTORS(SUFFIX)
#define SILU_MUL_VECTORS(SUFFIX)
#define RMS_ADD_VECTORS(SUFFIX)
#define RMS_SQUARES_VECTORS(SUFFIX)
#define RMS_SCALE_VECTORS(SUFFIX)
DEFINE_MOE_SUM(float, f32)
DEFINE_MOE_SUM(bf16, bf16)
#endif
DEFINE_SILU_MUL(float, f32)
DEFINE_SILU_MUL(bf16, bf16)
DEFINE_ADD_RMS_NORM(float, f32)
DEFINE_ADD_RMS_NORM(bf16, bf16)
DEFINE_ROPE(float, f32)
DEFINE_ROPE(bf16, bf16)
