/* A decoder layer's elementwise work on the CPU, one pass over the rows instead of torch's
 * six to eight ops (each a separate sweep over memory, with its temporaries and dispatch):
 *
 *   rmsnorm_f32       out = w * x / sqrt(mean(x^2) + eps)                         (HF LlamaRMSNorm)
 *   add_rmsnorm_f32   sum = x + delta; out = rmsnorm(sum)   (the residual add fused into the norm)
 *   silu_mul_f32      out = silu(gate) * up, gate_up rows = [gate | up]        (Llama MLP input)
 *                     silu(g) = g / (1 + e^-g), computed as g * e / (1 + e) with e = e^g for g < 0:
 *                     e^-g overflows there, and fast-math's reciprocal of inf is NaN, not 0.
 *   rope_store_f32    q and k of the fused qkv rows rotated (HF rotate-half), k and v written to
 *                     their KV-pool slots (-1: not stored); rotated q and k also written out
 *                     dense for the attention that follows.
 *   rope_store_q8     the same into an int8 pool (--kv-cache-dtype int8): each K and V row of a
 *                     head stored as int8 values and their fp32 scale (kernels/kv_quant.py's
 *                     quantize, bit for bit: scale = max|x| / 127, q = rint(x * (127 / max|x|))).
 *   rope_store_f8     the same into an fp8 pool (--kv-cache-dtype fp8, dtype uint8): e4m3 values
 *                     (scale = max|x| / 448, q = e4m3(x * (448 / max|x|)), rounded to nearest
 *                     even and saturating as torch's conversion, kernels/kv_quant.h f8_from_f32).
 *   f8_from_f32_n     that conversion alone, over an array (what the tests check against torch).
 *
 * fp32, rows contiguous (`ld*` = floats between rows). Threads split rows (OpenMP on torch's
 * own libgomp, see cpu_decode_attention.c); a row's result does not depend on the thread count.
 */
#include <math.h>
#include <stdint.h>

#include "kv_quant.h"

static float sum_squares(const float *x, int64_t n) {
    float acc[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += x[i + j] * x[i + j];
    float s = 0.f;
    for (int j = 0; j < 8; j++) s += acc[j];
    for (; i < n; i++) s += x[i] * x[i];
    return s;
}

static void norm_row(const float *x, const float *w, float *out, int64_t n, float eps) {
    const float inv = 1.0f / sqrtf(sum_squares(x, n) / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = w[i] * (x[i] * inv);
}

static int threads_for(int64_t rows, int nthreads) {
    if (nthreads < 1) nthreads = 1;
    return rows < nthreads ? (int)(rows > 0 ? rows : 1) : nthreads;
}

int rmsnorm_f32(const float *x, int64_t ldx, const float *w, float *out, int64_t rows, int64_t n, float eps,
                int nthreads) {
    const int parts = threads_for(rows, nthreads);
#pragma omp parallel for num_threads(parts) schedule(static) if (parts > 1)
    for (int64_t r = 0; r < rows; r++) norm_row(x + r * ldx, w, out + r * n, n, eps);
    return 0;
}

int add_rmsnorm_f32(const float *x, const float *delta, int64_t ldd, const float *w, float *sum, float *out,
                    int64_t rows, int64_t n, float eps, int nthreads) {
    const int parts = threads_for(rows, nthreads);
#pragma omp parallel for num_threads(parts) schedule(static) if (parts > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n, *dr = delta + r * ldd;
        float *sr = sum + r * n;
        for (int64_t i = 0; i < n; i++) sr[i] = xr[i] + dr[i];
        norm_row(sr, w, out + r * n, n, eps);
    }
    return 0;
}

int silu_mul_f32(const float *gate_up, int64_t ld, float *out, int64_t rows, int64_t n, int nthreads) {
    const int parts = threads_for(rows, nthreads);
#pragma omp parallel for num_threads(parts) schedule(static) if (parts > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * ld, *u = g + n;
        float *o = out + r * n;
        for (int64_t i = 0; i < n; i++) {  /* vectorised expf, of -|g| only: never overflows */
            const float e = expf(-fabsf(g[i]));
            o[i] = (g[i] >= 0.f ? g[i] : g[i] * e) / (1.0f + e) * u[i];
        }
    }
    return 0;
}

/* x [D] rotated by cos, sin [D] (rotate-half: out[i] = x[i] cos[i] -+ x[i +- D/2] sin[i]) */
static inline void rotate_row(const float *x, const float *c, const float *s, float *out, int64_t d) {
    const int64_t h = d / 2;
    for (int64_t i = 0; i < h; i++) out[i] = x[i] * c[i] - x[i + h] * s[i];
    for (int64_t i = h; i < d; i++) out[i] = x[i] * c[i] + x[i - h] * s[i];
}

/* The quantized row formats (kernels/kv_quant.py): int8 values or e4m3 bits, their QMAX read at
 * run time (see quantize_row) */
#define ROW_Q8 0
#define ROW_F8 1
static volatile float qmax_hidden[2] = {127.0f, 448.0f};

/* x [d] as the format's one-byte values, then their fp32 scale, at out [d + 4]. The divisions stay
 * divisions (QMAX read from a volatile is no constant for -ffast-math's reciprocal rewrite); int8
 * rounds by rintf (half to even), e4m3 by f8_from_f32; so the bytes are torch's
 * (kernels/kv_quant.py quantize). */
static inline __attribute__((always_inline)) void quantize_row(const float *x, void *out, int d, const int FMT) {
    float amax = 0.0f;
    const float qmax = qmax_hidden[FMT];
    for (int i = 0; i < d; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    const float scale = amax / qmax, inv = amax > 0.0f ? qmax / amax : 0.0f;
    for (int i = 0; i < d; i++) {
        if (FMT == ROW_F8) {
            ((uint8_t *)out)[i] = f8_from_f32(x[i] * inv);
        } else {
            const float r = rintf(x[i] * inv);
            ((int8_t *)out)[i] = (int8_t)(r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r);
        }
    }
    __builtin_memcpy((char *)out + d, &scale, sizeof scale);
}

int f8_from_f32_n(const float *x, uint8_t *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = f8_from_f32(x[i]);
    return 0;
}

/* qkv [T, (hq + 2 hkv) d] rows ldq floats apart; cos, sin [T, d]; q_out [T, hq, d];
 * k_out [T, hkv, d]; kv [2, slots, hkv, d] (K then V, slots = blocks x block size);
 * slot [T] int64. Returns -1 (nothing written) when a slot lies past the pool, else 0. */
int rope_store_f32(const float *qkv, int64_t ldq, const float *cos, const float *sin, float *q_out, float *k_out,
                   float *kv, int64_t slots, const int64_t *slot, int64_t rows, int hq, int hkv, int d,
                   int nthreads) {
    for (int64_t t = 0; t < rows; t++)
        if (slot[t] >= slots) return -1;  /* past the pool: refuse before writing anything */
    const int parts = threads_for(rows, nthreads);
    const int64_t kv_row = (int64_t)hkv * d;
#pragma omp parallel for num_threads(parts) schedule(static) if (parts > 1)
    for (int64_t t = 0; t < rows; t++) {
        const float *row = qkv + t * ldq, *c = cos + t * d, *s = sin + t * d;
        for (int h = 0; h < hq; h++) rotate_row(row + (int64_t)h * d, c, s, q_out + (t * hq + h) * d, d);
        float *kr = k_out + t * kv_row;
        for (int h = 0; h < hkv; h++) rotate_row(row + (int64_t)(hq + h) * d, c, s, kr + (int64_t)h * d, d);
        const int64_t at = slot[t];
        if (at < 0) continue;
        const float *v = row + (int64_t)(hq + hkv) * d;
        float *kd = kv + at * kv_row, *vd = kv + (slots + at) * kv_row;
        for (int64_t i = 0; i < kv_row; i++) kd[i] = kr[i];
        for (int64_t i = 0; i < kv_row; i++) vd[i] = v[i];
    }
    return 0;
}

/* rope_store_f32 into a quantized pool: kv [2, slots, hkv, d + 4] (each row d values of format FMT + fp32 scale) */
static inline __attribute__((always_inline)) int rope_store_rows(const float *qkv, int64_t ldq, const float *cos,
                                                                 const float *sin, float *q_out, float *k_out,
                                                                 uint8_t *kv, int64_t slots, const int64_t *slot,
                                                                 int64_t rows, int hq, int hkv, int d, int nthreads,
                                                                 const int FMT) {
    for (int64_t t = 0; t < rows; t++)
        if (slot[t] >= slots) return -1; /* past the pool: refuse before writing anything */
    const int parts = threads_for(rows, nthreads);
    const int64_t hs = d + 4, kv_row = (int64_t)hkv * hs; /* bytes of a head's row, of a token's */
#pragma omp parallel for num_threads(parts) schedule(static) if (parts > 1)
    for (int64_t t = 0; t < rows; t++) {
        const float *row = qkv + t * ldq, *c = cos + t * d, *s = sin + t * d;
        for (int h = 0; h < hq; h++) rotate_row(row + (int64_t)h * d, c, s, q_out + (t * hq + h) * d, d);
        float *kr = k_out + t * (int64_t)hkv * d;
        for (int h = 0; h < hkv; h++) rotate_row(row + (int64_t)(hq + h) * d, c, s, kr + (int64_t)h * d, d);
        const int64_t at = slot[t];
        if (at < 0) continue;
        const float *v = row + (int64_t)(hq + hkv) * d;
        uint8_t *kd = kv + at * kv_row, *vd = kv + (slots + at) * kv_row;
        for (int h = 0; h < hkv; h++) {
            quantize_row(kr + (int64_t)h * d, kd + h * hs, d, FMT);
            quantize_row(v + (int64_t)h * d, vd + h * hs, d, FMT);
        }
    }
    return 0;
}

/* into an int8 pool (--kv-cache-dtype int8) */
int rope_store_q8(const float *qkv, int64_t ldq, const float *cos, const float *sin, float *q_out, float *k_out,
                  int8_t *kv, int64_t slots, const int64_t *slot, int64_t rows, int hq, int hkv, int d, int nthreads) {
    return rope_store_rows(qkv, ldq, cos, sin, q_out, k_out, (uint8_t *)kv, slots, slot, rows, hq, hkv, d, nthreads,
                           ROW_Q8);
}

/* into an fp8 pool (--kv-cache-dtype fp8: e4m3 bits, dtype uint8) */
int rope_store_f8(const float *qkv, int64_t ldq, const float *cos, const float *sin, float *q_out, float *k_out,
                  uint8_t *kv, int64_t slots, const int64_t *slot, int64_t rows, int hq, int hkv, int d, int nthreads) {
    return rope_store_rows(qkv, ldq, cos, sin, q_out, k_out, kv, slots, slot, rows, hq, hkv, d, nthreads, ROW_F8);
}
