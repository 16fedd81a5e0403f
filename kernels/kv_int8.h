/* Reading an int8 KV row (--kv-cache-dtype int8, kernels/kv_int8.py) in the CPU kernels: a row is
 * a head's D int8 values followed by their fp32 scale (4 bytes, native order), so x[c] = q[c] *
 * scale. Included by the attention kernels that read int8 pools; kernels/cpu_native.py hashes this
 * header into each build's cache key. */
#ifndef PDSERVE_KV_INT8_H
#define PDSERVE_KV_INT8_H
#include <stdint.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define KV_INT8_SCALE_BYTES 4

typedef int8_t i8x8u __attribute__((vector_size(8), aligned(1)));
typedef float kv_f32x8 __attribute__((vector_size(32)));

/* 8 int8 values at p (any alignment) as floats, unscaled. With AVX2 one vpmovsxbd + vcvtdq2ps
 * (GCC 12 lowers the generic conversion below to eight scalar byte loads: 3x slower decode). */
static inline kv_f32x8 q8_widen8(const int8_t *p) {
#if defined(__AVX2__)
    return (kv_f32x8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    return __builtin_convertvector(*(const i8x8u *)p, kv_f32x8);
#endif
}

/* the scale of the row starting at `row` that holds d values */
static inline float q8_scale(const int8_t *row, int d) {
    float s;
    __builtin_memcpy(&s, row + d, sizeof s);
    return s;
}

#endif
