/* bf16 <-> fp32 for the CPU kernels that read or write bf16: a bf16 is the top 16 bits of an fp32,
 * so widening is exact (the bits moved up) and narrowing rounds to nearest even. Included by those
 * kernels' sources; kernels/cpu_native.py hashes this header into each build's cache key. */
#ifndef PDSERVE_BF16_H
#define PDSERVE_BF16_H
#include <stdint.h>

typedef uint16_t bf16x8u __attribute__((vector_size(16), aligned(2)));
typedef uint16_t bf16x16u __attribute__((vector_size(32), aligned(2)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x16 __attribute__((vector_size(64)));

static inline float bf16_to_f32(uint16_t x) {
    const uint32_t bits = (uint32_t)x << 16;
    float f;
    __builtin_memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even (outputs are finite) */
    uint32_t bits;
    __builtin_memcpy(&bits, &f, sizeof bits);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

static inline f32x8 bf16_widen8(const uint16_t *p) { /* 8 bf16 at p (any alignment) as floats */
    const u32x8 bits = __builtin_convertvector(*(const bf16x8u *)p, u32x8) << 16;
    f32x8 out;
    __builtin_memcpy(&out, &bits, sizeof out);
    return out;
}

#if defined(__AVX512F__) /* (only the AVX-512 tiles use it; a 64-byte vector return wants zmm) */
static inline f32x16 bf16_widen16(const uint16_t *p) { /* 16 bf16 at p as floats */
    const u32x16 bits = __builtin_convertvector(*(const bf16x16u *)p, u32x16) << 16;
    f32x16 out;
    __builtin_memcpy(&out, &bits, sizeof out);
    return out;
}
#endif

#endif
