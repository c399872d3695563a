/* int4_rows_half: whole rows of a packed weight with fp16 scales (Q8_0, Q4_0, Q5_0: `half` in
 * cpu_int4_groups.h), dequantized in fp32 exactly as the source format does (scale * q, one
 * rounding), for an LM head's refined logits and embedding lookups. Plain C, in both builds;
 * layout in cpu_int4.h. */
#include <stdint.h>
#include <string.h>

#include "cpu_kernels.h"
#include "cpu_team.h"

/* an fp16 value in fp32 (exact, subnormals included) */
static float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    uint32_t bits;
    if (exp == 0x1F)
        bits = sign | 0x7F800000u | (man << 13);
    else if (exp)
        bits = sign | ((exp + 112) << 23) | (man << 13);
    else if (!man)
        bits = sign;
    else { /* subnormal: man * 2^-24 */
        float f = (float)man * 0x1p-24f;
        memcpy(&bits, &f, 4);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* out[i][k] (fp32 [T][K]) = the weight of row ids[i] at column k: one plane, (c - 8) s; two
 * planes (q = 16 h + l), ((h - 8) 16 + l) s; s = sz[k / gs][row] (fp16 [K / gs][n_pad]). The
 * caller checks 0 <= ids[i] < rows. */
void int4_rows_half(const uint8_t *packed, const uint16_t *sz, int64_t K, int64_t n_pad,
                    int64_t planes, int64_t gs, const int64_t *ids, int64_t T, float *out) {
    const int64_t K2 = planes * K;
    OWN_ROWS(T, T >= 32, i, {
        const int64_t n = ids[i], shift = n % 64 >= 32 ? 4 : 0;
        const uint8_t *hi = packed + (n / 64) * K2 * 32 + n % 32; /* column 0's byte */
        const uint8_t *lo = hi + K * 32;                          /* plane 1 (two planes) */
        for (int64_t g = 0; g < K / gs; g++) {
            const float s = half_to_float(sz[g * n_pad + n]);
            float *o = out + i * K + g * gs;
            for (int64_t j = 0, k = g * gs; j < gs; j++, k++) {
                const int c = ((hi[k * 32] >> shift) & 15) - 8;
                o[j] = (float)(planes == 2 ? c * 16 + ((lo[k * 32] >> shift) & 15) : c) * s;
            }
        }
    });
}

/* For each row m of x (bf16 [M][ldx]): the k largest of logits[m] (fp32 [M][ldl], N used;
 * top_k's choice, ties to the lower index) recomputed in place as the fp32 dot product of x's
 * row with the weight rows of int4_rows_half: products rounded to fp32, summed in 16
 * interleaved partial sums (column c into sum c % 16), those added in order. Rows split across
 * the threads; one row's k candidates too. The caller checks K (a multiple of 16, <= 16384). */
void int4_refine_half(float *logits, int64_t ldl, int64_t M, int64_t N, const uint16_t *x,
                      int64_t ldx, const uint8_t *packed, const uint16_t *sz, int64_t K,
                      int64_t n_pad, int64_t planes, int64_t gs, int64_t k) {
    int64_t ids[64 * 64]; /* [M <= 64][k <= 64] */
    top_k(logits, ldl, M, N, k, ids);
#pragma omp parallel for schedule(static) if (M * k >= 16)
    for (int64_t t = 0; t < M * k; t++) {
        const int64_t m = t / k;
        float w[16384];
        int4_rows_half(packed, sz, K, n_pad, planes, gs, ids + t, 1, w);
        float part[16] = {0};
        for (int64_t c = 0; c < K; c += 16)
            for (int j = 0; j < 16; j++) {
                const uint32_t bits = (uint32_t)x[m * ldx + c + j] << 16;
                float xf;
                memcpy(&xf, &bits, 4);
                part[j] += w[c + j] * xf;
            }
        float dot = 0.0f;
        for (int j = 0; j < 16; j++) dot += part[j];
        logits[m * ldl + ids[t]] = dot;
    }
}
