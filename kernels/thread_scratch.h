/* Scratch memory per calling thread, grown to the largest call and kept: the int8-activation
 * kernels (cpu_quant_dot.c, cpu_block_dot.c) quantize x into it on every call. */
#ifndef PDSERVE_THREAD_SCRATCH_H
#define PDSERVE_THREAD_SCRATCH_H
#include <stdlib.h>

static __thread void *scratch_mem;
static __thread size_t scratch_cap;

static void *scratch(size_t bytes) {
    if (bytes > scratch_cap) {
        free(scratch_mem);
        scratch_cap = (bytes + 4095) / 4096 * 4096;
        scratch_mem = aligned_alloc(64, scratch_cap);
        if (!scratch_mem) scratch_cap = 0;
    }
    return scratch_mem;
}
#endif
