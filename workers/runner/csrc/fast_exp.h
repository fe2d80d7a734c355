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

#endif
