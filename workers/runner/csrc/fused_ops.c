/* Element-wise parts of a Llama layer for float32 on CPU, each one pass over memory.
 *
 * PyTorch runs RMSNorm as six kernels (square, mean, add, rsqrt, two multiplies) with a fresh
 * tensor after each, SiLU-and-multiply as two (the SiLU on a strided half), the residual add
 * as one more, and RoPE as a gather, four multiplies, two adds and a concatenation per q and
 * k. Here each is one loop that reads its input once and writes its output once, parallel over
 * rows with OpenMP (the runtime PyTorch already loaded).
 *
 * Built at run time by workers/runner/cpu_fused.py (cc -O3 -march=native -fopenmp), like the
 * decode kernel; loops are written for the compiler to vectorize (AVX-512, AVX2 or plain).
 */
#include <math.h>
#include <stdint.h>

#include "fast_exp.h"

/* Below this many elements a loop runs on the calling thread: waking the team costs more. */
#define PARALLEL_MIN 32768

/* out[r, i] = silu(x[r, i]) * x[r, n + i]: the fused gate_up projection's two halves. */
void silu_mul_f32(const float *x, float *out, int64_t rows, int64_t n, int64_t x_stride,
                  int64_t out_stride, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * n >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = x + r * x_stride;
        const float *up = gate + n;
        float *o = out + r * out_stride;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) {
            const float g = gate[i];
            /* sigmoid from e = exp(-|g|) <= 1, which never overflows */
            const float e = exp_nonpositive(-fabsf(g));
            const float sigmoid = (g >= 0.0f ? 1.0f : e) / (1.0f + e);
            o[i] = g * sigmoid * up[i];
        }
    }
}

/* With `add`, residual[r] += x[r] first; then out[r] = residual[r] / rms(residual[r]) * w.
 * Without it, out = rmsnorm(residual) (the first layer: the residual is the embedding). */
void add_rms_norm_f32(const float *x, float *residual, float *out, const float *w,
                      int64_t rows, int64_t n, float eps, int add, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * n >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        float *h = residual + r * n;
        float *o = out + r * n;
        float squares = 0.0f;
        if (add) {
            const float *xr = x + r * n;
#pragma omp simd reduction(+ : squares)
            for (int64_t i = 0; i < n; i++) {
                const float v = h[i] + xr[i];
                h[i] = v;
                squares += v * v;
            }
        } else {
#pragma omp simd reduction(+ : squares)
            for (int64_t i = 0; i < n; i++) squares += h[i] * h[i];
        }
        const float inv = 1.0f / sqrtf(squares / (float)n + eps);
#pragma omp simd
        for (int64_t i = 0; i < n; i++) o[i] = h[i] * inv * w[i];
    }
}

/* Rotate halves (HF's layout) of `heads` heads per token, in place: the q and k heads lead
 * each row of the fused qkv output. cos/sin are the model's tables [positions, dim / 2]. */
void rope_f32(float *x, const int64_t *positions, const float *cos_table,
              const float *sin_table, int64_t tokens, int64_t stride, int heads, int dim,
              int threads) {
    const int half = dim / 2;
#pragma omp parallel for num_threads(threads) schedule(static) \
    if (tokens * heads * dim >= PARALLEL_MIN)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos_table + positions[t] * half;
        const float *s = sin_table + positions[t] * half;
        for (int h = 0; h < heads; h++) {
            float *x1 = x + t * stride + (int64_t)h * dim;
            float *x2 = x1 + half;
#pragma omp simd
            for (int i = 0; i < half; i++) {
                const float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[i] + a * s[i];
            }
        }
    }
}
