/* Internal to the int4 kernel files (cpu_int4.c, cpu_int4_avx512.c, cpu_int4_vnni.c,
 * cpu_int4_amx_int8.c, cpu_int4_amx.c, cpu_int4_dequant.c): the packed weight layout, the
 * helpers that unpack its nibbles and read its scales, and the tile paths that int4_mm chooses
 * between.
 *
 * y[m, n] = sum_k x[m, k mod K] * ((c[n, k] - 8) * s[k / gs, n] + z[k / gs, n]),  k < planes * K
 * with groups of gs = 32 columns (Q4_0, Q4_1, Q4_K, Q8_0, Q5_*) or 16 (Q2_K, Q3_K, Q6_K);
 * codebook weights (IQ4_NL, IQ4_XS, NF4) use lut[c] in place of c - 8: `lut` holds 32 bf16
 * values, the codebook's bf16 roundings hi[16] and what they leave, lo[16] = bf16(v - hi) (zero
 * for the integer IQ4 codebooks), so that hi + lo carries NF4's values to about 2^-17.
 *
 * Layout (the one `torch.ops.aten._weight_int4pack_mm_for_cpu` reads on AVX-512; see
 * localllm/backends/cpu/packing.py): `packed` is [n_pad / 64][K2][32] bytes, K2 = planes * K;
 * byte j of column k in tile t holds row 64t + j in its low nibble and row 64t + 32 + j in its
 * high nibble. `sz` is bf16 [K2 / gs][n_pad][2]: (scale, zero) of each group and row, or those
 * pairs tile by tile, [n_pad / 64][K2 / gs][64][2]; or, for a symmetric weight with fp16 scales
 * (Q4_0, Q5_0, Q8_0, IQ4_NL), the fp16 scales alone, [K / gs][n_pad], with the zeros implied
 * (`scales_form` says which: see `Scales` in cpu_int4_groups.h).
 * With two planes (grouped int8 split as q = 16 h + l), plane p reads x[k - p K].
 */
#ifndef LOCALLLM_CPU_INT4_H
#define LOCALLLM_CPU_INT4_H

#include <immintrin.h>
#include <stdint.h>

#include "cpu_int4_groups.h"
#include "cpu_simd.h"

#define TILE 64
#define GROUP 32
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 4096 /* weight bytes read ahead of use: the tile stream comes from DRAM */
#endif

/* bytes 4i and 4i+2 of every 32-bit lane come from the nibbles; 4i+1 and 4i+3 are zero */
#define PAIR_MASK 0x5555555555555555ULL

/* vpermb indices: 32-bit lane i of the result takes bytes (f + i, 32 + f + i) of the source,
 * f = 0 (rows 0-15 of a nibble plane) or 16 (rows 16-31) */
#define PAIR(f, i) (f) + (i), 0, 32 + (f) + (i), 0
#define PAIRS(f) PAIR(f, 0), PAIR(f, 1), PAIR(f, 2), PAIR(f, 3), PAIR(f, 4), PAIR(f, 5), \
    PAIR(f, 6), PAIR(f, 7), PAIR(f, 8), PAIR(f, 9), PAIR(f, 10), PAIR(f, 11), PAIR(f, 12), \
    PAIR(f, 13), PAIR(f, 14), PAIR(f, 15)
static const uint8_t PAIR_INDEX[2][64] __attribute__((aligned(64), unused)) = {
    {PAIRS(0)}, {PAIRS(16)}};

/* Columns k, k+1 of a 64-row tile (64 bytes) -> four vectors of (k, k+1) bf16 pairs, 128 + c,
 * for rows 0-15, 16-31, 32-47, 48-63. */
static inline __attribute__((always_inline)) void unpack_pairs(__m512i b, __m512i w[4]) {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const __m512i bias = _mm512_set1_epi32(0x43004300); /* bf16 128 = 0x4300 */
    const __m512i idx_a = _mm512_load_si512(PAIR_INDEX[0]);
    const __m512i idx_b = _mm512_load_si512(PAIR_INDEX[1]);
    const __m512i lo = _mm512_and_si512(b, low4);
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), low4);
    /* merge masking: the high byte of each bf16 comes from `bias` (0x43), the low one is c */
    w[0] = _mm512_mask_permutexvar_epi8(bias, PAIR_MASK, idx_a, lo);
    w[1] = _mm512_mask_permutexvar_epi8(bias, PAIR_MASK, idx_b, lo);
    w[2] = _mm512_mask_permutexvar_epi8(bias, PAIR_MASK, idx_a, hi);
    w[3] = _mm512_mask_permutexvar_epi8(bias, PAIR_MASK, idx_b, hi);
}

/* the fp32 codebook hi + lo of a `lut` (see the top of this file) */
static inline __m512 codebook_f32(const uint16_t *lut) {
    return lut ? _mm512_add_ps(load_bf16(lut, 0xFFFF), load_bf16(lut + 16, 0xFFFF))
               : _mm512_setzero_ps();
}

/* where group g's values for row `row` begin (prefetching) */
static inline const char *scales_at(const Scales *s, int64_t g, int64_t row) {
    if (s->half) return (const char *)(s->p + (g % s->plane_groups) * s->n_pad + row);
    return (const char *)(s->p + pair_at(s, g, row));
}

/* Scale of rows row..row+15 in group g (g < K2 / gs), fp32; *zero_adj gets zero - bias * scale.
 * Pairs: 32-bit lane j holds the scale in its low half, the zero in its high half. */
static inline __m512 group_scale(const Scales *s, int64_t g, int64_t row, float bias,
                                 __m512 *zero_adj) {
    __m512 sc, zr;
    if (s->half) {
        const __m512 h = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)scales_at(s, g, row)));
        const int two = s->planes == 2, plane_h = two && g < s->plane_groups;
        sc = plane_h ? _mm512_mul_ps(h, _mm512_set1_ps(16.0f)) : h;
        zr = two && !plane_h ? _mm512_mul_ps(h, _mm512_set1_ps(8.0f)) : _mm512_setzero_ps();
    } else {
        const __m512i v = _mm512_loadu_si512(s->p + pair_at(s, g, row));
        sc = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
        zr = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000u)));
    }
    *zero_adj = _mm512_fnmadd_ps(sc, _mm512_set1_ps(bias), zr);
    return sc;
}

/* ---- the bf16 weights of a tile, for int4_dequant_t and int4_gemm */

/* Per-group scales of every plane for rows 16r..16r+15 of tile t: sc[p][r], and zz[p][r] =
 * zero - bias * scale (bias 8: (c - 8) s + z = c s + zz; codebook weights: bias 0). */
static inline __attribute__((always_inline)) void tile_group_scales(
    const Scales *sz, int64_t K, int64_t gs, int64_t planes, int64_t t, int64_t g, float bias,
    __m512 sc[2][4], __m512 zz[2][4]) {
    for (int64_t p = 0; p < planes; p++)
        for (int r = 0; r < 4; r++)
            sc[p][r] = group_scale(sz, p * K / gs + g, t * TILE + 16 * r, bias, &zz[p][r]);
}

/* Column k of a 64-row tile as fp32 weights, planes summed: w[r] holds rows 16r..16r+15. */
static inline __attribute__((always_inline)) void tile_column(
    const uint8_t *tile, int64_t K, int64_t planes, int64_t k, const uint16_t *lut, __m512 lutf,
    __m512 sc[2][4], __m512 zz[2][4], __m512 w[4]) {
    for (int64_t p = 0; p < planes; p++) {
        const __m256i b = _mm256_loadu_si256((const __m256i *)(tile + (p * K + k) * 32));
        const __m256i lo = _mm256_and_si256(b, _mm256_set1_epi8(0x0F));
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), _mm256_set1_epi8(0x0F));
        const __m128i q[4] = {_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1),
                              _mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1)};
        for (int r = 0; r < 4; r++) {
            const __m512i ci = _mm512_cvtepu8_epi32(q[r]);
            const __m512 c = lut ? _mm512_permutexvar_ps(ci, lutf) : _mm512_cvtepi32_ps(ci);
            const __m512 v = _mm512_fmadd_ps(c, sc[p][r], zz[p][r]);
            w[r] = p ? _mm512_add_ps(w[r], v) : v;
        }
    }
}

/* ---- the two paths of int4_mm (cpu_int4.c chooses): sz as `scales_of` makes it; xsum:
 * fp32 [M][groups], the sum of x over each group of columns; y: bf16 [M][ldy], N written;
 * claim: NULL or the team's work ranges for this call (share_next in cpu_team.h).
 * Hidden: they are not part of the library's exported API (cpu_kernels.h). */
#define INT4_INTERNAL __attribute__((visibility("hidden")))

/* AVX-512 BF16, groups of gs = 32 or 16 columns, a codebook `lut` (cpu_int4_avx512.c) */
INT4_INTERNAL void int4_mm_avx512(const uint16_t *x, int64_t M, int64_t K, int64_t ldx,
                                  const uint8_t *packed, const Scales *sz, int64_t N,
                                  int64_t n_pad, int64_t K2, const float *xsum, uint16_t *y,
                                  int64_t ldy, int64_t gs, const uint16_t *lut,
                                  int64_t *claim);

/* VNNI integer products, groups of gs = 32 or 16 columns without a codebook: x rounded per
 * group to 16-bit integers as the AVX2 build rounds it, exact integer sums, the same bits as
 * the AVX2 build; with `amx` (the caller holds the OS's permission), batches of groups of 32
 * on AMX-INT8 tiles, the same sums (cpu_int4_vnni.c). 0, or -1 if out of memory. */
INT4_INTERNAL int int4_mm_vnni(const uint16_t *x, int64_t M, int64_t K, int64_t ldx,
                               const uint8_t *packed, const Scales *sz, int64_t N,
                               int64_t n_pad, int64_t K2, uint16_t *y, int64_t ldy, int64_t gs,
                               int amx, int64_t *claim);

/* Configures the calling thread's tiles for A and C tiles of mr rows (tmm0-4) and B tiles of
 * 16 (tmm5-7), all 64 bytes a row, unless they are already; int4_tiles_release ends it
 * (cpu_int4_amx.c) */
INT4_INTERNAL void int4_amx_config(int64_t mr);

/* AMX tiles, groups of GROUP columns without a codebook; the caller holds the OS's
 * permission (int4_gemm_ready) (cpu_int4_amx.c) */
INT4_INTERNAL void int4_mm_amx(const uint16_t *x, int64_t M, int64_t K, int64_t ldx,
                               const uint8_t *packed, const Scales *sz, int64_t N, int64_t n_pad,
                               int64_t groups, const float *xsum, uint16_t *y, int64_t ldy,
                               int64_t *claim);

#endif
