/* What the CPU kernels share: 16-lane float32 vectors (GCC vector extensions,
 * which the compiler maps onto the CPU it builds for), loads and stores of
 * float32 or bfloat16 arrays through them, and a vector exp. */
#ifndef STORMSERVE_SIMD_H
#define STORMSERVE_SIMD_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))
#define MIN(a, b) ((a) < (b) ? (a) : (b))
#define LANES 16

typedef float f32x16 __attribute__((vector_size(64)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));

INLINE f32x16 select16(i32x16 mask, f32x16 yes, f32x16 no) {
    return (f32x16)(((i32x16)yes & mask) | ((i32x16)no & ~mask));
}

/* 16 elements of a float32 or bfloat16 array, from element `index` on, as float32. */
INLINE f32x16 load16(const void *base, int64_t index, int bf16) {
    if (bf16) {
        u16x16 half;
        memcpy(&half, (const uint16_t *)base + index, sizeof half);
        return (f32x16)(__builtin_convertvector(half, u32x16) << 16);
    }
    f32x16 v;
    memcpy(&v, (const float *)base + index, sizeof v);
    return v;
}

/* float32 bits (a vector of them) rounded to the nearest even bfloat16, in the low 16 bits. */
#define BF16_ROUND(bits) (((bits) + 0x7FFFu + (((bits) >> 16) & 1u)) >> 16)

INLINE void store16(f32x16 v, void *base, int64_t index, int bf16) {
    if (bf16) {
        const u16x16 half = __builtin_convertvector(BF16_ROUND((u32x16)v), u16x16);
        memcpy((uint16_t *)base + index, &half, sizeof half);
    } else {
        memcpy((float *)base + index, &v, sizeof v);
    }
}

INLINE float sum16(f32x16 v) {
    const f32x8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                    __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    const f32x4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

/* e^x: Cephes' expf polynomial after range reduction, about 1e-7 relative
 * error; x is clamped to [-87, 88], where float32 neither underflows to
 * denormals nor overflows. */
INLINE f32x16 exp16(f32x16 x) {
    x = select16(x < -87.0f, x * 0.0f - 87.0f, x);
    x = select16(x > 88.0f, x * 0.0f + 88.0f, x);
    const f32x16 round = x * 0.0f + 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    const f32x16 k = (x * 1.44269504088896341f + round) - round;
    const f32x16 r = x - k * 0.693359375f + k * 2.12194440e-4f;
    f32x16 p = r * 0.0f + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const i32x16 exponent = (__builtin_convertvector(k, i32x16) + 127) << 23;
    return p * (f32x16)exponent;
}

#endif
