/* A large copy whose destination this process will not read back (a KV transfer into another
 * worker's pool): non-temporal stores write whole cache lines straight to memory, skipping the
 * read-for-ownership a cached store costs and leaving the caches to the compute. glibc's memcpy
 * does the same only above about three quarters of the L3 per thread, and a KV run is smaller
 * (a layer's K or V of one request: ~2 MiB of the benchmark's 32 MiB). kvtransfer/sender.py
 * `copy_blocks` uses it for runs of at least STREAM_MIN_BYTES (kernels/stream_copy.py). */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

void stream_copy(void *dst_, const void *src_, int64_t nbytes) {
    char *dst = (char *)dst_;
    const char *src = (const char *)src_;
    int64_t head = (int64_t)((64 - ((uintptr_t)dst & 63)) & 63); /* to the destination's first line */
    if (head > nbytes) head = nbytes;
    memcpy(dst, src, (size_t)head);
    int64_t i = head;
#if defined(__AVX512F__)
    for (; i + 64 <= nbytes; i += 64)
        _mm512_stream_si512((__m512i *)(dst + i), _mm512_loadu_si512((const void *)(src + i)));
#elif defined(__AVX__)
    for (; i + 32 <= nbytes; i += 32)
        _mm256_stream_si256((__m256i *)(dst + i), _mm256_loadu_si256((const __m256i *)(src + i)));
#else
    for (; i + 16 <= nbytes; i += 16)
        _mm_stream_si128((__m128i *)(dst + i), _mm_loadu_si128((const __m128i *)(src + i)));
#endif
    memcpy(dst + i, src + i, (size_t)(nbytes - i));
    _mm_sfence(); /* the streamed lines are globally visible before the caller signals them */
}
