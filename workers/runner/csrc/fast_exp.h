/* exp for non-positive arguments, shared by the CPU kernels in this folder. */
#ifndef SWITCHBOARD_FAST_EXP_H
#define SWITCHBOARD_FAST_EXP_H

#include <stdint.h>
#include <string.h>

/* exp(x) for x <= 0, to about 2 ulp, written so the compiler vectorizes the loop that calls it
 * (libm's expf would be one scalar call per score). x = k ln2 + r with |r| <= ln2 / 2 (k
 * rounded by the 1.5 * 2^23 trick); exp(r) by a degree-6 Taylor polynomial; 2^k built in the
 * exponent bits. Below -87, 0. */
static inline float exp_nonpositive(float x) {
    const float clamped = x < -87.0f ? -87.0f : x;
    const float round = 12582912.0f;
    const float k = (clamped * 1.44269504088896341f + round) - round;
    const float r = clamped - k * 0.693145751953125f - k * 1.428606765330187e-06f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t bits = ((int32_t)k + 127) << 23;
    float two_k;
    memcpy(&two_k, &bits, sizeof two_k);
    return x < -87.0f ? 0.0f : p * two_k;
}

/* 2^f for |f| <= 1/2: its degree-7 Taylor polynomial's coefficients, highest first (to
 * float32 rounding), for the vector versions below. */
static const float EXP2_TAYLOR[8] = {1.5252733804e-5f, 1.5403530393e-4f, 1.3333558146e-3f,
                                     9.6181291076e-3f, 5.5504108665e-2f, 2.4022650696e-1f,
                                     6.9314718056e-1f, 1.0f};

#if defined(__AVX512F__)
#include <immintrin.h>

/* 2^x for x <= 0, 16 lanes, to float32 rounding: x = k + f with |f| <= 1/2, 2^f by
 * EXP2_TAYLOR, 2^k by scalef. Below -126, about 0 (callers mask what must be exactly 0).
 * The attention kernels keep their scores in log2 units, so this is their exp. */
static inline __m512 exp2_avx512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    const __m512 k = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, k);
    __m512 p = _mm512_set1_ps(EXP2_TAYLOR[0]);
    for (int i = 1; i < 8; i++) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_TAYLOR[i]));
    return _mm512_scalef_ps(p, k);
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* The same for 8 lanes: 2^k put into the exponent bits, as AVX2 has no scalef. */
static inline __m256 exp2_avx2(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-126.0f));
    const __m256 k = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(x, k);
    __m256 p = _mm256_set1_ps(EXP2_TAYLOR[0]);
    for (int i = 1; i < 8; i++) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP2_TAYLOR[i]));
    const __m256i two_k = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(two_k));
}
#endif

#endif
