/* bfloat16 <-> float32 for the CPU kernels in this folder: a bfloat16 is the high half of a
 * float32, so widening is a shift and narrowing rounds to nearest even (as PyTorch does).
 * Plain integer code, which the compiler vectorizes inside the kernels' loops. */
#ifndef SWITCHBOARD_BF16_H
#define SWITCHBOARD_BF16_H

#include <stdint.h>
#include <string.h>

typedef uint16_t bf16;

static inline float bf16_to_f32(bf16 b) {
    const uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline bf16 f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (bf16)((bits >> 16) | 0x40u); /* quiet NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (bf16)(bits >> 16);
}

#endif
