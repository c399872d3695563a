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

/* The hint of every prefetch of a weight's stream (bytes and scales), in both builds: into L2.
 * A thread reading one row's matmul from memory needs more lines in flight than L1 can track;
 * prefetched into L1 (_MM_HINT_T0), the 30 layers' matmuls at one row took 1.12-1.4x as long
 * (Zen 4; decode of one sequence 1.16x, the AVX2 build 1.07x; the loads then hit L2). */
#define STREAM_HINT _MM_HINT_T1

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
 * added lane by lane (v[i] + v[i + half]) until one value is left. Written in GCC's vector
 * types, so that each level is one vector add in either build (as plain C over an array the
 * compiler stored the widened values and summed them one scalar at a time: a decode step's
 * group sums took 7% of its time at 8 rows). */
typedef float GroupF16 __attribute__((vector_size(64)));
typedef float GroupF8 __attribute__((vector_size(32)));
typedef float GroupF4 __attribute__((vector_size(16)));
typedef uint16_t GroupU16 __attribute__((vector_size(32)));
typedef uint32_t GroupU32 __attribute__((vector_size(64)));

/* 16 bf16 values -> fp32 (exact: the bits moved up) */
static inline GroupF16 group_widen(const uint16_t *p) {
    GroupU16 h;
    __builtin_memcpy(&h, p, sizeof h);
    const GroupU32 w = __builtin_convertvector(h, GroupU32) << 16;
    GroupF16 f;
    __builtin_memcpy(&f, &w, sizeof f);
    return f;
}

static inline float group_sum(const uint16_t *xg, int gs) {
    GroupF16 v = group_widen(xg);
    if (gs == 32) v += group_widen(xg + 16);
    const GroupF8 v8 = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                       __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    const GroupF4 v4 = __builtin_shufflevector(v8, v8, 0, 1, 2, 3) +
                       __builtin_shufflevector(v8, v8, 4, 5, 6, 7);
    return (v4[0] + v4[2]) + (v4[1] + v4[3]);
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
    const int64_t per_plane = K / gs; /* group g reads x from column (g % per_plane) gs */
    for (int64_t m = 0; m < M; m++)
        for (int64_t g0 = 0; g0 < groups; g0 += per_plane)
            for (int64_t g = 0; g < per_plane && g0 + g < groups; g++)
                xsum[m * groups + g0 + g] = group_sum(x + m * ldx + g * gs, (int)gs);
    return xsum;
}

#endif
