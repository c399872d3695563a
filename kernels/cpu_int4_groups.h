/* The ISA-neutral part of the int4 kernels' packed format, shared by the AVX-512 build
 * (cpu_int4.h) and the AVX2 build (cpu_int4_avx2.c): the forms of a weight's scales, and the
 * per-group sums of x that the zero terms multiply (one definition, so both builds and every
 * batch size sum them in one order). */
#ifndef LOCALLLM_CPU_INT4_GROUPS_H
#define LOCALLLM_CPU_INT4_GROUPS_H

#include <stdint.h>
#include <stdlib.h>

/* A weight's per-group scales and zeros, in one of three forms (SCALES_* below):
 *   pairs: bf16 [K2 / gs][n_pad][2], (scale, zero) per group and row;
 *   tiled pairs: the same pairs as [n_pad / 64][K2 / gs][64][2], a tile's groups side by side,
 *          so that a thread reading its tiles reads their scales in one run (not K2 / gs runs
 *          n_pad * 4 bytes apart);
 *   half:  fp16 [K / gs][n_pad], the scale s alone of a symmetric weight, exact as stored in the
 *          file; one plane: (c - 8) s; two planes (q = 16 h + l, the same s for both):
 *          plane H (c - 8) 16 s, plane L (c - 8) s + 8 s. */
enum { SCALES_PAIRS = 0, SCALES_HALF = 1, SCALES_TILED = 2 }; /* the kernels' `scales_form` */

typedef struct {
    const uint16_t *p;
    int64_t n_pad, plane_groups; /* plane_groups = K / gs */
    int half, planes, tiled;
} Scales;

static inline Scales scales_of(const uint16_t *sz, int64_t n_pad, int64_t K, int64_t gs,
                               int64_t planes, int64_t form) {
    const Scales s = {sz, n_pad, K / gs, form == SCALES_HALF, (int)planes, form == SCALES_TILED};
    return s;
}

/* where the (scale, zero) pair of group g (g < K2 / gs) and row `row` begins in a pairs or
 * tiled-pairs form, in bf16 values from s->p (rows row..row+15 follow it when row % 16 == 0) */
static inline int64_t pair_at(const Scales *s, int64_t g, int64_t row) {
    if (s->tiled)
        return (((row / 64) * s->planes * s->plane_groups + g) * 64 + row % 64) * 2;
    return (g * s->n_pad + row) * 2;
}

/* The sum of the gs (16 or 32) bf16 values at xg in fp32, as a fixed pairwise tree: halves
 * added lane by lane (v[i] + v[i + half]) until one value is left. Plain C that the compiler
 * vectorizes without reordering (the tree's independent adds take a few cycles where a running
 * sum waited on gs dependent adds). */
static inline float group_sum(const uint16_t *xg, int gs) {
    float v[32];
    for (int i = 0; i < 32; i++) {
        const uint32_t bits = i < gs ? (uint32_t)xg[i] << 16 : 0u;
        __builtin_memcpy(&v[i], &bits, 4);
    }
    if (gs == 32)
        for (int i = 0; i < 16; i++) v[i] += v[i + 16];
    for (int i = 0; i < 8; i++) v[i] += v[i + 8];
    for (int i = 0; i < 4; i++) v[i] += v[i + 4];
    for (int i = 0; i < 2; i++) v[i] += v[i + 2];
    return v[0] + v[1];
}

/* Where x_group_sums writes when the caller has no room: a decode step's few rows always fit
 * (so that a kernel called by every thread of a team cannot fail on one of them alone) */
#define XSUM_ROOM 8192

/* sx[m * groups + g] = sum of the gs bf16 values of x row m in group g (groups = planes K /
 * gs; plane p reads x[k - p K]), in fp32 (group_sum), into room (XSUM_ROOM floats) where it
 * fits, else malloc'd (the caller frees a result other than room); NULL when out of memory. */
static inline float *x_group_sums(const uint16_t *x, int64_t M, int64_t K, int64_t ldx,
                                  int64_t gs, int64_t groups, float *room) {
    float *xsum = M * groups <= XSUM_ROOM ? room : malloc(sizeof(float) * (size_t)(M * groups));
    if (!xsum) return NULL;
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < groups; g++)
            xsum[m * groups + g] = group_sum(x + m * ldx + (g * gs) % K, (int)gs);
    return xsum;
}

#endif
