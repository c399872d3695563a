/* The row paths of the AVX-512 few-rows int4 kernel (cpu_int4_avx512.c, which compiles each on
 * its own and chooses between them): one or two 64-row tiles for 1, 2, 4 or 8 rows of x, whole
 * tiles or half tiles, every (tile, row) pair summed in one order whatever the path (layout
 * and formula: cpu_int4.h). Internal to that file. USE_LUT: the codebook's bf16 terms, 1 (exact
 * in bf16) or 2 (hi + lo). */
#ifndef LOCALLLM_CPU_INT4_TILES_H
#define LOCALLLM_CPU_INT4_TILES_H

#include <immintrin.h>
#include <stdint.h>

#include "cpu_int4.h"

#define PREFETCH_GROUPS 4
#ifndef ROWS8
#define ROWS8 1 /* 0: batches of 8 rows take tile_rows4 twice (A/B builds) */
#endif

/* The same four vectors for a codebook weight: each code c becomes lut[c], a bf16 value, and
 * with TERMS = 2 also wlo[r] = lut_lo[c] (the codebook's remainder); the epilogue adds no
 * bias. */
static inline __attribute__((always_inline)) void unpack_pairs_lut(
    __m512i b, __m512i w[4], __m512i wlo[4], __m512i lut, __m512i lut_lo, const int TERMS) {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const __m512i idx_a = _mm512_load_si512(PAIR_INDEX[0]);
    const __m512i idx_b = _mm512_load_si512(PAIR_INDEX[1]);
    const __m512i lo = _mm512_and_si512(b, low4);
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), low4);
    /* 16-bit lanes holding the codes, then a 16-entry table lookup (vpermw) */
    const __m512i c[4] = {_mm512_maskz_permutexvar_epi8(PAIR_MASK, idx_a, lo),
                          _mm512_maskz_permutexvar_epi8(PAIR_MASK, idx_b, lo),
                          _mm512_maskz_permutexvar_epi8(PAIR_MASK, idx_a, hi),
                          _mm512_maskz_permutexvar_epi8(PAIR_MASK, idx_b, hi)};
    for (int r = 0; r < 4; r++) {
        w[r] = _mm512_permutexvar_epi16(c[r], lut);
        if (TERMS == 2) wlo[r] = _mm512_permutexvar_epi16(c[r], lut_lo);
    }
}

/* NT consecutive 64-row tiles for MR rows of x (NT * MR <= 2: 16 accumulators and 16 sums
 * fit the 32 vector registers), their row blocks R0 .. R1 - 1 of 16 rows (0 .. 3: whole
 * tiles; 0 .. 1 or 2 .. 3: one half of one tile). out[(i * MR + m) * 64 + row] gets tile i's
 * rows for x row m, in fp32. Every (tile, row) pair is summed in the same order whatever NT,
 * MR and the blocks are, so a row of x gets the same result alone or in a batch. */
static inline __attribute__((always_inline)) void tiles_rows(
    const uint8_t *tile, int64_t tile_bytes, const Scales *sz, int64_t row0,
    const uint16_t *x, int64_t ldx, int64_t K, int64_t groups, const float *xsum, float *out,
    const int NT, const int MR, const int GS, const int USE_LUT, __m512i lut, __m512i lut_lo,
    const int R0, const int R1) {
    __m512 y[2][2][4]; /* [NT][MR][4]: fixed sizes, so that they live in registers */
    for (int i = 0; i < NT; i++)
        for (int m = 0; m < MR; m++)
            for (int r = R0; r < R1; r++) y[i][m][r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        if (g + PREFETCH_GROUPS < groups) {
            for (int i = 0; i < NT; i++) {
                const char *ps = scales_at(sz, g + PREFETCH_GROUPS, row0 + i * TILE);
                for (int l = 0; l < 4; l++) _mm_prefetch(ps + 64 * l, STREAM_HINT);
            }
        }
        __m512 a[2][2][4];
        for (int i = 0; i < NT; i++)
            for (int m = 0; m < MR; m++)
                for (int r = R0; r < R1; r++) a[i][m][r] = _mm512_setzero_ps();
        const int64_t kx = g * GS - (g * GS >= K ? K : 0); /* plane 1 reads x again */
        for (int kp = 0; kp < GS / 2; kp++) {
            int32_t pair[2];
            for (int m = 0; m < MR; m++) __builtin_memcpy(&pair[m], x + m * ldx + kx + 2 * kp, 4);
            for (int i = 0; i < NT; i++) {
                const int64_t o = (g * GS + 2 * kp) * 32;
                const uint8_t *p = tile + i * tile_bytes + o;
                /* with two tiles, PREFETCH_BYTES past tile i's end is tile i + 1, already
                 * being read: take those bytes of tile i + 2 (the next pair's) instead */
                _mm_prefetch((const char *)p + PREFETCH_BYTES +
                                 (NT == 2 && o + PREFETCH_BYTES >= tile_bytes ? tile_bytes : 0),
                             STREAM_HINT);
                __m512i w[4], wlo[4];
                unpack_pairs_lut(_mm512_loadu_si512(p), w, wlo, lut, lut_lo, USE_LUT);
                for (int m = 0; m < MR; m++) {
                    const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair[m]);
                    for (int r = R0; r < R1; r++) {
                        a[i][m][r] = _mm512_dpbf16_ps(a[i][m][r], (__m512bh)w[r], xb);
                        if (USE_LUT == 2)
                            a[i][m][r] = _mm512_dpbf16_ps(a[i][m][r], (__m512bh)wlo[r], xb);
                    }
                }
            }
        }
        for (int i = 0; i < NT; i++) {
            for (int r = R0; r < R1; r++) {
                __m512 zz; /* z: a codebook has no bias */
                const __m512 sc = group_scale(sz, g, row0 + i * TILE + 16 * r,
                                              0.0f, &zz);
                for (int m = 0; m < MR; m++) {
                    y[i][m][r] = _mm512_fmadd_ps(sc, a[i][m][r], y[i][m][r]);
                    y[i][m][r] = _mm512_fmadd_ps(zz, _mm512_set1_ps(xsum[m * groups + g]),
                                                 y[i][m][r]);
                }
            }
        }
    }
    for (int i = 0; i < NT; i++)
        for (int m = 0; m < MR; m++)
            for (int r = R0; r < R1; r++)
                _mm512_storeu_ps(out + (i * MR + m) * TILE + 16 * r, y[i][m][r]);
}

/* One 64-row tile for 4 rows of x: the same sums as tiles_rows, in the same order, with the
 * 16 group sums in registers and the running outputs in out[m][64] (fp32) instead. */
static inline __attribute__((always_inline)) void tile_rows4(
    const uint8_t *tile, const Scales *sz, int64_t row0, const uint16_t *x,
    int64_t ldx, int64_t K, int64_t groups, const float *xsum, float *out, const int GS,
    const int USE_LUT, __m512i lut, __m512i lut_lo) {
    for (int i = 0; i < 4 * TILE; i += 16) _mm512_storeu_ps(out + i, _mm512_setzero_ps());
    for (int64_t g = 0; g < groups; g++) {
        if (g + PREFETCH_GROUPS < groups) {
            const char *ps = scales_at(sz, g + PREFETCH_GROUPS, row0);
            for (int l = 0; l < 4; l++) _mm_prefetch(ps + 64 * l, STREAM_HINT);
        }
        __m512 a[4][4];
        for (int m = 0; m < 4; m++)
            for (int r = 0; r < 4; r++) a[m][r] = _mm512_setzero_ps();
        const int64_t kx = g * GS - (g * GS >= K ? K : 0); /* plane 1 reads x again */
        for (int kp = 0; kp < GS / 2; kp++) {
            const uint8_t *p = tile + (g * GS + 2 * kp) * 32;
            _mm_prefetch((const char *)p + PREFETCH_BYTES, STREAM_HINT);
            __m512i w[4], wlo[4];
            unpack_pairs_lut(_mm512_loadu_si512(p), w, wlo, lut, lut_lo, USE_LUT);
            for (int m = 0; m < 4; m++) {
                int32_t pair;
                __builtin_memcpy(&pair, x + m * ldx + kx + 2 * kp, 4);
                const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
                for (int r = 0; r < 4; r++) {
                    a[m][r] = _mm512_dpbf16_ps(a[m][r], (__m512bh)w[r], xb);
                    if (USE_LUT == 2)
                        a[m][r] = _mm512_dpbf16_ps(a[m][r], (__m512bh)wlo[r], xb);
                }
            }
        }
        for (int r = 0; r < 4; r++) {
            __m512 zz; /* z: a codebook has no bias */
            const __m512 sc = group_scale(sz, g, row0 + 16 * r, 0.0f, &zz);
            for (int m = 0; m < 4; m++) {
                float *o = out + m * TILE + 16 * r;
                __m512 y = _mm512_fmadd_ps(sc, a[m][r], _mm512_loadu_ps(o));
                y = _mm512_fmadd_ps(zz, _mm512_set1_ps(xsum[m * groups + g]), y);
                _mm512_storeu_ps(o, y);
            }
        }
    }
}

/* One 64-row tile for 8 rows of x, loading each weight line once per half tile: the same sums
 * as tiles_rows, in the same order. Per group, rows 0-31 of the tile (the low nibbles), then
 * rows 32-63 (the high nibbles, the group's lines again, now from L1), each with 16 sums in
 * registers (8 rows of x x 2 vectors); the running outputs are in out[m][64] (fp32). */
static inline __attribute__((always_inline)) void tile_rows8(
    const uint8_t *tile, const Scales *sz, int64_t row0, const uint16_t *x,
    int64_t ldx, int64_t K, int64_t groups, const float *xsum, float *out, const int GS,
    const int USE_LUT, __m512i lut, __m512i lut_lo, const int H0, const int H1) {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const __m512i idx_a = _mm512_load_si512(PAIR_INDEX[0]);
    const __m512i idx_b = _mm512_load_si512(PAIR_INDEX[1]);
    for (int i = 0; i < 8 * TILE; i += 16) _mm512_storeu_ps(out + i, _mm512_setzero_ps());
    for (int64_t g = 0; g < groups; g++) {
        if (g + PREFETCH_GROUPS < groups) {
            const char *ps = scales_at(sz, g + PREFETCH_GROUPS, row0);
            for (int l = 0; l < 4; l++) _mm_prefetch(ps + 64 * l, STREAM_HINT);
        }
        const int64_t kx = g * GS - (g * GS >= K ? K : 0); /* plane 1 reads x again */
        for (int h = H0; h < H1; h++) { /* halves H0 .. H1 - 1 (a half tile: one) */
            __m512 a[8][2];
            for (int m = 0; m < 8; m++) a[m][0] = a[m][1] = _mm512_setzero_ps();
            for (int kp = 0; kp < GS / 2; kp++) {
                const uint8_t *p = tile + (g * GS + 2 * kp) * 32;
                if (h == H0) _mm_prefetch((const char *)p + PREFETCH_BYTES, STREAM_HINT);
                const __m512i b = _mm512_loadu_si512(p);
                const __m512i nib = h ? _mm512_and_si512(_mm512_srli_epi16(b, 4), low4)
                                      : _mm512_and_si512(b, low4);
                __m512i w[2], wlo[2];
                const __m512i c0 = _mm512_maskz_permutexvar_epi8(PAIR_MASK, idx_a, nib);
                const __m512i c1 = _mm512_maskz_permutexvar_epi8(PAIR_MASK, idx_b, nib);
                w[0] = _mm512_permutexvar_epi16(c0, lut);
                w[1] = _mm512_permutexvar_epi16(c1, lut);
                if (USE_LUT == 2) {
                    wlo[0] = _mm512_permutexvar_epi16(c0, lut_lo);
                    wlo[1] = _mm512_permutexvar_epi16(c1, lut_lo);
                }
                for (int m = 0; m < 8; m++) {
                    int32_t pair;
                    __builtin_memcpy(&pair, x + m * ldx + kx + 2 * kp, 4);
                    const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
                    for (int r = 0; r < 2; r++) {
                        a[m][r] = _mm512_dpbf16_ps(a[m][r], (__m512bh)w[r], xb);
                        if (USE_LUT == 2)
                            a[m][r] = _mm512_dpbf16_ps(a[m][r], (__m512bh)wlo[r], xb);
                    }
                }
            }
            for (int r = 0; r < 2; r++) {
                __m512 zz; /* z: a codebook has no bias */
                const __m512 sc = group_scale(sz, g, row0 + 16 * (2 * h + r),
                                              0.0f, &zz);
                for (int m = 0; m < 8; m++) {
                    float *o = out + m * TILE + 16 * (2 * h + r);
                    __m512 y = _mm512_fmadd_ps(sc, a[m][r], _mm512_loadu_ps(o));
                    y = _mm512_fmadd_ps(zz, _mm512_set1_ps(xsum[m * groups + g]), y);
                    _mm512_storeu_ps(o, y);
                }
            }
        }
    }
}

#endif
