/* Quantized KV rows (--kv-cache-dtype int8|fp8, kernels/kv_quant.py) in the CPU kernels: a row is
 * a head's D one-byte values followed by their fp32 scale (4 bytes, native order), x[c] =
 * value(q[c]) * scale; q[c] an int8 integer (int8), or float8 e4m3 bits (fp8: sign, 4 exponent
 * bits of bias 7, 3 mantissa bits, subnormals, S.1111.111 NaN, no infinity; largest 448).
 * Included by the kernels that read or write such pools; kernels/cpu_native.py hashes this header
 * into each build's cache key. */
#ifndef PDSERVE_KV_QUANT_H
#define PDSERVE_KV_QUANT_H
#include <stdint.h>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#define KV_SCALE_BYTES 4

typedef int8_t i8x8u __attribute__((vector_size(8), aligned(1)));
typedef float kv_f32x8 __attribute__((vector_size(32)));
typedef int32_t kv_i32x8 __attribute__((vector_size(32)));
typedef uint32_t kv_u32x8 __attribute__((vector_size(32)));

/* 8 int8 values at p (any alignment) as floats, unscaled. With AVX2 one vpmovsxbd + vcvtdq2ps
 * (GCC 12 lowers the generic conversion below to eight scalar byte loads: 3x slower decode). */
static inline kv_f32x8 q8_widen8(const int8_t *p) {
#if defined(__AVX2__)
    return (kv_f32x8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    return __builtin_convertvector(*(const i8x8u *)p, kv_f32x8);
#endif
}

/* 8 e4m3 values at p (any alignment) as floats, unscaled and exact. With F16C (x86-64-v3 and up)
 * each byte becomes an fp16 with the same sign and its 7 magnitude bits under fp16's exponent
 * field (bits 13..7): e4m3 and fp16 both have subnormals, so that fp16 is the value times 2^-8
 * for every code, normal or subnormal; vcvtph2ps widens it exactly (fp16 subnormals come out as
 * fp32 normals, whatever the CPU's denormal modes) and 256 restores the value. Without F16C: the
 * magnitude bits at fp32 bit 20 with the exponent rebiased (127 - 7) for the normals, a
 * subnormal (magnitude m < 8, value m * 2^-9) converted and scaled, the sign put back last; no
 * fp32 denormal is made. +-0 stay +-0; S.1111.111 (NaN, never stored: the store saturates)
 * reads as +-480. */
static inline kv_f32x8 f8_widen8(const uint8_t *p) {
#if defined(__F16C__)
    const __m128i x = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p)); /* sign-extended to 16 bits */
    const __m128i h = _mm_and_si128(_mm_slli_epi16(x, 7), _mm_set1_epi16((short)0xbfff)); /* S 0 mag 0000000 */
    return (kv_f32x8)_mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f));
#else
    kv_u32x8 x;
    for (int i = 0; i < 8; i++) x[i] = p[i];
    const kv_u32x8 mag = x & 0x7f, sign = (x & 0x80) << 24;
    const kv_u32x8 normal = (mag << 20) + (120u << 23);
    const kv_f32x8 sub = __builtin_convertvector((kv_i32x8)mag, kv_f32x8) * (1.0f / 512.0f);
    kv_u32x8 sub_bits;
    __builtin_memcpy(&sub_bits, &sub, sizeof sub_bits);
    const kv_u32x8 is_sub = (kv_u32x8)(mag < 8); /* all ones where subnormal (or zero) */
    const kv_u32x8 bits = (sub_bits & is_sub) | (normal & ~is_sub) | sign;
    kv_f32x8 out;
    __builtin_memcpy(&out, &bits, sizeof out);
    return out;
#endif
}

/* x as e4m3 bits, as torch's x.clamp(-448, 448).to(torch.float8_e4m3fn) gives them: rounded to
 * nearest, ties to even (subnormals included), |x| >= 448 (and +-inf) saturated to +-448, NaN to
 * S.1111.111, the sign kept (-0 -> 0x80). Integer arithmetic on the bits only, so -ffast-math
 * changes nothing. */
static inline uint8_t f8_from_f32(float x) {
    uint32_t u;
    __builtin_memcpy(&u, &x, sizeof u);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80);
    const uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7f;  /* NaN */
    if (a >= 0x43e00000u) return sign | 0x7e; /* |x| >= 448 */
    if (a >= 0x3c800000u) {                   /* |x| >= 2^-6: an e4m3 normal (or 2^-6 from below) */
        /* drop 20 of fp32's 23 mantissa bits, rounding half to even; a carry moves the exponent */
        const uint32_t r = (a + 0x7ffffu + ((a >> 20) & 1)) >> 20;
        return sign | (uint8_t)(r - (120u << 3)); /* rebias the exponent 127 -> 7 */
    }
    /* below 2^-6: units of 2^-9 (e4m3's subnormal step), rounded half to even; 8 units is 2^-6 */
    const int e = (int)(a >> 23);                  /* fp32's biased exponent, <= 120 here */
    if (e < 127 - 10) return sign;                 /* |x| < 2^-10, half the least subnormal: 0 */
    const uint32_t m = (a & 0x7fffffu) | 0x800000u; /* 1.f * 2^23 */
    const int shift = 23 - (e - 127) - 9;         /* |x| / 2^-9 = m >> shift; 21 <= shift <= 24 */
    const uint32_t q = m >> shift, rest = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    return sign | (uint8_t)(q + (rest > half || (rest == half && (q & 1))));
}

/* the scale of the row starting at `row` that holds d values */
static inline float kv_row_scale(const void *row, int d) {
    float s;
    __builtin_memcpy(&s, (const char *)row + d, sizeof s);
    return s;
}

#endif
