/* The ISA-neutral part of the int4 kernels' packed format, shared by the AVX-512 build
 * (cpu_int4.h) and the AVX2 build (cpu_int4_avx2.c): the forms of a weight's scales, and the
 * per-group sums of x that the zero terms multiply (one definition, so both builds and every
 * batch size sum them in one order). */
#ifndef LOCALLLM_CPU_INT4_GROUPS_H
#define LOCALLLM_CPU_INT4_GROUPS_H

#include <stdint.h>
#include <stdlib.h>

/* A weight's per-group scales and zeros, in one of two forms:
 *   pairs: bf16 [K2 / gs][n_pad][2], (scale, zero) per group and row;
 *   half:  fp16 [K / gs][n_pad], the scale s alone of a symmetric weight, exact as stored in the
 *          file; one plane: (c - 8) s; two planes (q = 16 h + l, the same s for both):
 *          plane H (c - 8) 16 s, plane L (c - 8) s + 8 s. */
typedef struct {
    const uint16_t *p;
    int64_t n_pad, plane_groups; /* plane_groups = K / gs */
    int half, planes;
} Scales;

static inline Scales scales_of(const uint16_t *sz, int64_t n_pad, int64_t K, int64_t gs,
                               int64_t planes, int64_t half) {
    const Scales s = {sz, n_pad, K / gs, half != 0, (int)planes};
    return s;
}

/* sx[m * groups + g] = sum of the gs bf16 values of x row m in group g (groups = planes K /
 * gs; plane p reads x[k - p K]), summed in order in fp32. malloc'd: the caller frees it; NULL
 * when out of memory. */
static inline float *x_group_sums(const uint16_t *x, int64_t M, int64_t K, int64_t ldx,
                                  int64_t gs, int64_t groups) {
    float *xsum = malloc(sizeof(float) * (size_t)(M * groups));
    if (!xsum) return NULL;
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < groups; g++) {
            const uint16_t *xg = x + m * ldx + (g * gs) % K;
            float acc = 0.0f;
            for (int i = 0; i < gs; i++) {
                uint32_t bits = (uint32_t)xg[i] << 16;
                float f;
                __builtin_memcpy(&f, &bits, 4);
                acc += f;
            }
            xsum[m * groups + g] = acc;
        }
    return xsum;
}

#endif
