/* Few-row products with int8 weights for CPU: y = (x @ q.T) * scale (+ bias), float32.
 *
 * At one to a few rows a projection is a walk over its weight, bound by memory: float32
 * weights are 4 bytes a value, int8 ones 1. Casting int8 to float first (the many-row path,
 * workers/runner/quantization.py) writes and rereads the weight at float width, so at few
 * rows int8 was slower than float32. Here each weight row is read once as int8, widened in
 * registers and multiplied by every input row while it is in L1.
 *
 * Output channels are spread over OpenMP threads. Loops are written for the compiler to
 * vectorize (AVX-512, AVX2 or SSE2: the int8 widening and the multiply-add are one loop).
 * Built at run time by workers/runner/cpu_int8.py with the flags in cbuild.FLAGS.
 */
#include <stdint.h>

#define MAX_ROWS 8
#define WIDEN_MAX 2048 /* four widened weight rows: 32 KiB of float, about an L1 */

static inline float finish(float sum, const float *scale, const float *bias, int64_t j) {
    return sum * scale[j] + (bias ? bias[j] : 0.0f);
}

/* The four sums of one input row against four weight rows (int8, or already widened). */
#define FOUR_SUMS(W0, W1, W2, W3)                                                             \
    do {                                                                                      \
        _Pragma("omp simd reduction(+ : s0, s1, s2, s3)") for (int64_t i = 0; i < k; i++) { \
            const float xi = xm[i];                                                           \
            s0 += xi * (float)(W0)[i];                                                        \
            s1 += xi * (float)(W1)[i];                                                        \
            s2 += xi * (float)(W2)[i];                                                        \
            s3 += xi * (float)(W3)[i];                                                        \
        }                                                                                     \
    } while (0)

/* y[m * y_stride + j] = scale[j] * sum_i x[m * x_stride + i] * q[j * k + i] (+ bias[j]),
 * for m < rows (at most MAX_ROWS) and j < n. Four output channels at a time: each input
 * element is loaded once for four weight rows, and the four sums are independent chains of
 * multiply-adds rather than one waiting on its own latency. With more than one input row and
 * k up to WIDEN_MAX, the four weight rows are widened once into an L1-sized float buffer that
 * every input row then reads. Returns -1 for too many rows. */
int int8_gemv(const float *x, const int8_t *q, const float *scale, const float *bias,
              float *y, int rows, int64_t n, int64_t k, int64_t x_stride, int64_t y_stride,
              int threads) {
    if (rows < 1 || rows > MAX_ROWS) return -1;
    const int64_t groups = (n + 3) / 4;
    const int widen = rows > 1 && k <= WIDEN_MAX;
#pragma omp parallel for num_threads(threads) schedule(static) if (n * k >= 65536)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t j = 4 * g;
        if (j + 4 <= n) {
            const int8_t *q0 = q + j * k, *q1 = q0 + k, *q2 = q1 + k, *q3 = q2 + k;
            float w[widen ? 4 * k : 1];
            if (widen) {
#pragma omp simd
                for (int64_t i = 0; i < 4 * k; i++) w[i] = (float)q0[i];
            }
            for (int m = 0; m < rows; m++) {
                const float *xm = x + m * x_stride;
                float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
                if (widen)
                    FOUR_SUMS(w, w + k, w + 2 * k, w + 3 * k);
                else
                    FOUR_SUMS(q0, q1, q2, q3);
                float *ym = y + m * y_stride;
                ym[j] = finish(s0, scale, bias, j);
                ym[j + 1] = finish(s1, scale, bias, j + 1);
                ym[j + 2] = finish(s2, scale, bias, j + 2);
                ym[j + 3] = finish(s3, scale, bias, j + 3);
            }
        } else {
            for (int64_t jj = j; jj < n; jj++) {
                const int8_t *qj = q + jj * k;
                for (int m = 0; m < rows; m++) {
                    const float *xm = x + m * x_stride;
                    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
                    for (int64_t i = 0; i < k; i++) sum += xm[i] * (float)qj[i];
                    y[m * y_stride + jj] = finish(sum, scale, bias, jj);
                }
            }
        }
    }
    return 0;
}
