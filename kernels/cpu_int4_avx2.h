/* What the two sources of the AVX2 build's int4 matmul share (cpu_int4_avx2.c: the fp32 path of
 * codebook weights, the entry points; cpu_int4_avx2_int.c: the integer path of the others): the
 * tile, how far ahead the weights are read, and the weights' scales tile by tile. */
#ifndef LOCALLLM_CPU_INT4_AVX2_H
#define LOCALLLM_CPU_INT4_AVX2_H

#include <immintrin.h>
#include <stdint.h>

#include "cpu_int4_groups.h"

#define TILE 64
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 4096 /* weight bytes read ahead of use */
#endif
#define CHUNK_ROWS 8 /* rows of x per pass over a tile: running sums fp32 [8][64] on the stack */

/* The order of a tile's 64 rows in the AVX2 build's 8-lane sums ("W order", in-lane unpacks of
 * 32-row byte vectors): vector j < 4 holds rows 4j..4j+3 (lanes 0-3) and 16+4j..16+4j+3 (lanes
 * 4-7), vector 4 + j the same rows + 32. w_row(j): the first row of vector j. */
static inline int w_row(int j) { return j < 4 ? 4 * j : 32 + 4 * (j - 4); }

/* a tile's 64 fp32 sums in W order (o, 32-byte aligned) -> rows in order: r[i] holds rows
 * 8 i .. 8 i + 7 (two permutes per 8 rows) */
static inline __attribute__((always_inline)) void w_order_rows(const float *o, __m256 r[8]) {
    for (int h = 0; h < 2; h++) { /* 32 rows a half */
        const __m256 w0 = _mm256_load_ps(o + 32 * h), w1 = _mm256_load_ps(o + 32 * h + 8);
        const __m256 w2 = _mm256_load_ps(o + 32 * h + 16), w3 = _mm256_load_ps(o + 32 * h + 24);
        r[4 * h] = _mm256_permute2f128_ps(w0, w1, 0x20);
        r[4 * h + 1] = _mm256_permute2f128_ps(w2, w3, 0x20);
        r[4 * h + 2] = _mm256_permute2f128_ps(w0, w1, 0x31);
        r[4 * h + 3] = _mm256_permute2f128_ps(w2, w3, 0x31);
    }
}

/* where the scales of group g (g < K2 / gs) begin for the tile whose first row is row0; a row
 * takes one value there (half) or a pair (scale, zero), the rows of a tile in order (the forms of
 * cpu_int4_groups.h's `Scales`) */
static inline const uint16_t *tile_scales(const Scales *s, int64_t g, int64_t row0) {
    return s->half ? s->p + (g % s->plane_groups) * s->n_pad + row0 : s->p + pair_at(s, g, row0);
}

/* scales of 8 rows of group g in fp32, from p = tile_scales(s, g, row0): rows row0 + ra ..
 * + 3 in lanes 0-3, row0 + rb .. + 3 in lanes 4-7; *zz = zero - bias * scale */
static inline __m256 group_scales(const Scales *s, const uint16_t *p, int64_t g, int ra, int rb,
                                  float bias, __m256 *zz) {
    __m256 sc, zr;
    if (s->half) {
        const __m128i lo = _mm_loadl_epi64((const __m128i *)(p + ra));
        const __m128i hi = _mm_loadl_epi64((const __m128i *)(p + rb));
        const __m256 h = _mm256_cvtph_ps(_mm_unpacklo_epi64(lo, hi));
        const int two = s->planes == 2, plane_h = two && g < s->plane_groups;
        sc = plane_h ? _mm256_mul_ps(h, _mm256_set1_ps(16.0f)) : h;
        zr = two && !plane_h ? _mm256_mul_ps(h, _mm256_set1_ps(8.0f)) : _mm256_setzero_ps();
    } else {
        const __m256i v = _mm256_set_m128i(_mm_loadu_si128((const __m128i *)(p + 2 * rb)),
                                           _mm_loadu_si128((const __m128i *)(p + 2 * ra)));
        sc = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        zr = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xFFFF0000u)));
    }
    *zz = _mm256_fnmadd_ps(sc, _mm256_set1_ps(bias), zr);
    return sc;
}

/* int4_mm_shared of cpu_kernels.h for a weight without a codebook (cpu_int4_avx2_int.c):
 * sz its scales, K2 = planes K; 0, or -1 if out of memory */
int int4_mm_int(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *packed,
                const Scales *sz, int64_t N, int64_t n_pad, int64_t K2, uint16_t *y, int64_t ldy,
                int64_t gs, int64_t *claim);

#endif
