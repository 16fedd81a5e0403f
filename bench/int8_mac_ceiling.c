/* The CPU's int8 multiply-add ceiling as the block kernels use it (bench/block_gemm_ceiling.py):
 * 8 independent chains of AVX2 maddubs + madd (32 int8 products and their sums a pair), so the
 * loop is bound by how many such instructions issue a cycle, not by their latency; and, on an
 * AVX-512 BW build, the zmm pair the K-quant kernels spend (64 products: maddubs, then VNNI's
 * dpwssd where the CPU has it, else madd + add), 12 chains. */
#include <stdint.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

/* Runs `iters` x 8 pairs; returns a value that depends on every result (so nothing is elided). */
int64_t int8_mac_pairs(int64_t iters) {
#if defined(__AVX2__)
    __m256i a[8];
    const __m256i x = _mm256_set1_epi8(3), s = _mm256_set1_epi16(1);
    for (int k = 0; k < 8; k++) a[k] = _mm256_set1_epi8((char)(k + 1));
    for (int64_t i = 0; i < iters; i++)
        for (int k = 0; k < 8; k++) {
            a[k] = _mm256_madd_epi16(_mm256_maddubs_epi16(a[k], x), s);
            __asm__ volatile("" : "+x"(a[k]));
        }
    int64_t r = 0;
    for (int k = 0; k < 8; k++) r += _mm256_extract_epi32(a[k], 0);
    return r;
#else
    (void)iters;
    return -1;
#endif
}

/* The zmm pair, `iters` x 12; -1 on a build without AVX-512 BW. */
int64_t int8_mac_pairs_zmm(int64_t iters) {
#if defined(__AVX512BW__)
    __m512i a[12];
    const __m512i x = _mm512_set1_epi8(3), s = _mm512_set1_epi16(1);
    for (int k = 0; k < 12; k++) a[k] = _mm512_set1_epi8((char)(k + 1));
    for (int64_t i = 0; i < iters; i++)
        for (int k = 0; k < 12; k++) {
            const __m512i p = _mm512_maddubs_epi16(x, a[k] /* (a stays small: no saturation matters) */);
#if defined(__AVX512VNNI__)
            a[k] = _mm512_dpwssd_epi32(a[k], p, s);
#else
            a[k] = _mm512_add_epi32(a[k], _mm512_madd_epi16(p, s));
#endif
            __asm__ volatile("" : "+v"(a[k]));
        }
    int64_t r = 0;
    for (int k = 0; k < 12; k++) r += _mm512_reduce_add_epi32(a[k]) & 0xFFFF; /* (never -1) */
    return r;
#else
    (void)iters;
    return -1;
#endif
}
