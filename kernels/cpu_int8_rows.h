/* The rows of x as int8_logits takes them, in both builds (cpu_int8_logits.c, AVX-512 VNNI;
 * cpu_int8_logits_avx2.c): each row rounded, per group of 32 columns, to 16-bit integers.
 * With a = max |x| over the group, v = rint(x * (32767 / a)) and the group's scale
 * sx = a / 32767 (a = 0: v = 0, sx = 0); corr = 128 * sum v, what the weights' bias of 128
 * adds to sum u v (u = q + 128). Plain C, the same in both builds, so that their logits are
 * the same. */
#ifndef LOCALLLM_CPU_INT8_ROWS_H
#define LOCALLLM_CPU_INT8_ROWS_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define INT8_GROUP 32

typedef struct {
    int16_t *v;    /* [M][K] */
    float *sx;     /* [M][K / 32] */
    int32_t *corr; /* [M][K / 32] */
} RoundedRows;

static void round_row(const uint16_t *x, int64_t K, int16_t *v, float *sx, int32_t *corr) {
    for (int64_t g = 0; g < K / INT8_GROUP; g++) {
        float f[INT8_GROUP], a = 0.0f;
        for (int k = 0; k < INT8_GROUP; k++) {
            const uint32_t bits = (uint32_t)x[g * INT8_GROUP + k] << 16;
            memcpy(&f[k], &bits, 4);
            a = fmaxf(a, fabsf(f[k]));
        }
        int32_t sum = 0;
        const float inv = a > 0.0f ? 32767.0f / a : 0.0f;
        for (int k = 0; k < INT8_GROUP; k++) {
            const int32_t q = (int32_t)rintf(f[k] * inv);
            v[g * INT8_GROUP + k] = (int16_t)q;
            sum += q;
        }
        sx[g] = a / 32767.0f;
        corr[g] = 128 * sum;
    }
}

/* the M rows of x (bf16 [M][ldx], K columns) rounded; returns 0, -1 if out of memory */
static int round_rows(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, RoundedRows *r) {
    const int64_t groups = K / INT8_GROUP;
    r->v = aligned_alloc(64, (size_t)((M * K * 2 + 63) / 64 * 64));
    r->sx = malloc(sizeof(float) * (size_t)(M * groups));
    r->corr = malloc(sizeof(int32_t) * (size_t)(M * groups));
    if (!r->v || !r->sx || !r->corr) {
        free(r->v), free(r->sx), free(r->corr);
        return -1;
    }
    for (int64_t m = 0; m < M; m++)
        round_row(x + m * ldx, K, r->v + m * K, r->sx + m * groups, r->corr + m * groups);
    return 0;
}

static void free_rows(RoundedRows *r) { free(r->v), free(r->sx), free(r->corr); }

/* int8_logits' operands checked (K a multiple of 32, n_pad of 64) and x's rows rounded:
 * 0, -1 if out of memory, -2 for K or n_pad off the layout */
static int logits_rows(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, int64_t n_pad,
                       RoundedRows *r) {
    if (K % INT8_GROUP || n_pad % 64) return -2;
    return round_rows(x, M, K, ldx, r);
}

#endif
