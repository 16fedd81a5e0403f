/* The blocks of a GGUF file's Q4_K, Q5_K, Q6_K and Q8_0 tensors as ggml stores them, and their
 * widening to fp32 exactly as ggml dequantizes them: shared by the kernels that read the blocks in
 * place (cpu_block_dot.c: int8 activations; cpu_block_bf16.c: prompts in bf16). */
#ifndef PDSERVE_BLOCK_FORMATS_H
#define PDSERVE_BLOCK_FORMATS_H
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#define QK 256 /* inputs a super-block (and a block of x's quantized row) */

enum { Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 }; /* ggml's type ids */

/* v's value is taken as computed: the compiler may not fuse or regroup the operations around it */
#if defined(__x86_64__) && defined(__SSE2__)
#define KEEP(v) __asm__("" : "+x"(v)) /* a float */
#else
#define KEEP(v) __asm__("" : "+m"(v))
#endif
#if defined(__x86_64__) && defined(__AVX2__)
#define KEEPV(v) __asm__("" : "+v"(v)) /* an 8-float vector */
#else
#define KEEPV(v) __asm__("" : "+m"(v))
#endif

typedef float v8f __attribute__((vector_size(32)));

/* bytes of one super-block's worth (256 inputs) of a row; 0: not a type this kernel reads */
static int64_t sb_bytes(int type) {
    switch (type) {
    case Q8_0: return 8 * 34;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    default: return 0;
    }
}

static inline float f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    uint32_t bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (man << 13);
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (!man) {
        bits = sign;
    } else { /* subnormal: normalise */
        int e = -1;
        uint32_t m = man;
        do {
            e++;
            m <<= 1;
        } while (!(m & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((m & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* Q4_K / Q5_K's 12 bytes -> 6-bit scales and mins [8] each (ggml's packing), four bytes at a time:
 * bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7, bytes 4-7 the same for
 * the mins, bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and mins 4-7 (high nibble). */
static inline void scale_min_k4(const uint8_t *p, uint8_t sc[8], uint8_t mn[8]) {
    uint32_t u[3], out[4];
    memcpy(u, p, 12);
    out[0] = u[0] & 0x3F3F3F3Fu;
    out[1] = (u[2] & 0x0F0F0F0Fu) | (((u[0] >> 6) & 0x03030303u) << 4);
    out[2] = u[1] & 0x3F3F3F3Fu;
    out[3] = ((u[2] >> 4) & 0x0F0F0F0Fu) | (((u[1] >> 6) & 0x03030303u) << 4);
    memcpy(sc, out, 8);
    memcpy(mn, out + 2, 8);
}

/* ---- widening, as ggml dequantizes ---- */

typedef uint8_t v8u8 __attribute__((vector_size(8)));
typedef int8_t v8s8 __attribute__((vector_size(8)));

/* y[0..8) = p - m with p = d * float(q) rounded first (as ggml: no fused multiply-add) */
static inline __attribute__((always_inline)) void scaled8(float *y, v8f q, float d, float m) {
    v8f p = q * d;
    KEEPV(p);
    const v8f v = p - m;
    memcpy(y, &v, sizeof v);
}

__attribute__((unused)) static void dequant_row(const int type, const uint8_t *w, int64_t nsb, float *y) {
    for (int64_t b = 0; b < nsb; b++, y += QK) {
        if (type == Q4_K || type == Q5_K) {
            const uint8_t *blk = w + b * (type == Q4_K ? 144 : 176);
            const uint8_t *qh = blk + 16, *qs = blk + (type == Q4_K ? 16 : 48);
            uint8_t sc[8], mn[8];
            scale_min_k4(blk + 4, sc, mn);
            const float d = f16(blk), dmin = f16(blk + 2);
            for (int j = 0; j < 8; j++) {
                float d1 = d * (float)sc[j], m1 = dmin * (float)mn[j];
                KEEP(d1);
                KEEP(m1);
                const int c = j / 2, h = j % 2;
                for (int l = 0; l < 32; l += 8) {
                    v8u8 q;
                    memcpy(&q, qs + 32 * c + l, 8);
                    q = h ? q >> 4 : q & 15;
                    if (type == Q5_K) {
                        v8u8 hb;
                        memcpy(&hb, qh + l, 8);
                        q |= ((hb >> j) & 1) << 4;
                    }
                    scaled8(y + 32 * j + l, __builtin_convertvector(q, v8f), d1, m1);
                }
            }
        } else if (type == Q6_K) {
            const uint8_t *blk = w + b * 210, *ql = blk, *qh = blk + 128;
            const int8_t *sc = (const int8_t *)(blk + 192);
            const float d = f16(blk + 208);
            for (int n = 0; n < 2; n++)
                for (int k = 0; k < 4; k++)
                    for (int l = 0; l < 32; l += 8) {
                        v8u8 lb, hb;
                        memcpy(&lb, ql + 64 * n + l + (k & 1) * 32, 8);
                        memcpy(&hb, qh + 32 * n + l, 8);
                        const v8u8 u = ((k < 2 ? lb : lb >> 4) & 15) | (((hb >> (2 * k)) & 3) << 4);
                        const int e = 128 * n + 32 * k + l;
                        float ds = d * (float)sc[e / 16];
                        KEEP(ds);
                        const v8s8 q = (v8s8)u - 32;
                        scaled8(y + e, __builtin_convertvector(q, v8f), ds, 0.0f);
                    }
        } else {
            const uint8_t *blk = w + b * 8 * 34;
            for (int k = 0; k < 8; k++) {
                const float d = f16(blk + 34 * k);
                for (int l = 0; l < 32; l += 8) {
                    v8s8 q;
                    memcpy(&q, blk + 34 * k + 2 + l, 8);
                    scaled8(y + 32 * k + l, __builtin_convertvector(q, v8f), d, 0.0f);
                }
            }
        }
    }
}

#endif
