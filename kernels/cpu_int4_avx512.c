/* The few-rows path of int4_mm on AVX-512 BF16 (layout and formula: cpu_int4.h).
 *
 * One 64-byte load holds columns k and k+1 of a 64-row tile. Each nibble c becomes the bf16
 * number 128 + c (bits 0x4300 | c: exact), laid out as (k, k+1) pairs per row, so that
 * `vdpbf16ps` adds x[k] (128 + c[n,k]) + x[k+1] (128 + c[n,k+1]) into one fp32 lane per row.
 * Per group of gs columns, with a = that sum and sx = sum of x:
 *     sum_k x (c - 8) s + z x  =  s a + (z - 136 s) sx
 * Products of bf16 numbers are exact in fp32; sums are fp32. Rows are split across OpenMP
 * threads by tiles.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#include "cpu_int4.h"
#include "cpu_team.h"
#include "cpu_kernels.h"
#include "cpu_simd.h"

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

/* USE_LUT: 0 plain codes, 1 a codebook exact in bf16, 2 a codebook in two bf16 terms */
static inline __attribute__((always_inline)) void unpack(__m512i b, __m512i w[4], __m512i wlo[4],
                                                         const int USE_LUT, __m512i lut,
                                                         __m512i lut_lo) {
    if (USE_LUT)
        unpack_pairs_lut(b, w, wlo, lut, lut_lo, USE_LUT);
    else
        unpack_pairs(b, w);
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
                unpack(_mm512_loadu_si512(p), w, wlo, USE_LUT, lut, lut_lo);
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
                __m512 zz; /* z - 136 s */
                const __m512 sc = group_scale(sz, g, row0 + i * TILE + 16 * r,
                                              USE_LUT ? 0.0f : 136.0f, &zz);
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
            unpack(_mm512_loadu_si512(p), w, wlo, USE_LUT, lut, lut_lo);
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
            __m512 zz; /* z - 136 s */
            const __m512 sc = group_scale(sz, g, row0 + 16 * r, USE_LUT ? 0.0f : 136.0f, &zz);
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
    const __m512i bias = _mm512_set1_epi32(0x43004300); /* bf16 128 = 0x4300 */
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
                if (USE_LUT) {
                    const __m512i c0 = _mm512_maskz_permutexvar_epi8(PAIR_MASK, idx_a, nib);
                    const __m512i c1 = _mm512_maskz_permutexvar_epi8(PAIR_MASK, idx_b, nib);
                    w[0] = _mm512_permutexvar_epi16(c0, lut);
                    w[1] = _mm512_permutexvar_epi16(c1, lut);
                    if (USE_LUT == 2) {
                        wlo[0] = _mm512_permutexvar_epi16(c0, lut_lo);
                        wlo[1] = _mm512_permutexvar_epi16(c1, lut_lo);
                    }
                } else {
                    w[0] = _mm512_mask_permutexvar_epi8(bias, PAIR_MASK, idx_a, nib);
                    w[1] = _mm512_mask_permutexvar_epi8(bias, PAIR_MASK, idx_b, nib);
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
                __m512 zz; /* z - 136 s */
                const __m512 sc = group_scale(sz, g, row0 + 16 * (2 * h + r),
                                              USE_LUT ? 0.0f : 136.0f, &zz);
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

/* Each row-count path compiled on its own for each (group size, codebook terms), called
 * from tile_unit: inlined there side by side, tile_rows8's loop ran 20% slower (the register
 * allocation of the combined function). */
#define PATH_ARGS                                                                             \
    const uint8_t *tile, int64_t tile_bytes, const Scales *sz, int64_t row0, const uint16_t *x, \
        int64_t ldx, int64_t K, int64_t groups, const float *xsum, float *out, __m512i lut,      \
        __m512i lut_lo
/* one half of a tile (row blocks r0 .. r1 - 1) for mr (1 or 2) rows of x, and for 8 */
#define HALF_PATH(gs, terms, mr, name, r0, r1)                                                 \
    static __attribute__((noinline)) void half##mr##_##name##_##gs##_##terms(PATH_ARGS) {      \
        tiles_rows(tile, tile_bytes, sz, row0, x, ldx, K, groups, xsum, out, 1, mr, gs, terms, \
                   lut, lut_lo, r0, r1);                                                       \
    }
#define HALF_PATH8(gs, terms, name, h)                                                         \
    static __attribute__((noinline)) void half8_##name##_##gs##_##terms(PATH_ARGS) {          \
        (void)tile_bytes;                                                                      \
        tile_rows8(tile, sz, row0, x, ldx, K, groups, xsum, out, gs, terms, lut, lut_lo, h,    \
                   h + 1);                                                                     \
    }
#define ROW_PATHS(gs, terms)                                                                   \
    static __attribute__((noinline)) void rows8_##gs##_##terms(PATH_ARGS) {                    \
        (void)tile_bytes;                                                                      \
        tile_rows8(tile, sz, row0, x, ldx, K, groups, xsum, out, gs, terms, lut, lut_lo, 0, 2); \
    }                                                                                          \
    static __attribute__((noinline)) void rows4_##gs##_##terms(PATH_ARGS) {                    \
        (void)tile_bytes;                                                                      \
        tile_rows4(tile, sz, row0, x, ldx, K, groups, xsum, out, gs, terms, lut, lut_lo);      \
    }                                                                                          \
    static __attribute__((noinline)) void two_tiles_##gs##_##terms(PATH_ARGS) {                \
        tiles_rows(tile, tile_bytes, sz, row0, x, ldx, K, groups, xsum, out, 2, 1, gs, terms,  \
                   lut, lut_lo, 0, 4);                                                         \
    }                                                                                          \
    static __attribute__((noinline)) void rows2_##gs##_##terms(PATH_ARGS) {                    \
        tiles_rows(tile, tile_bytes, sz, row0, x, ldx, K, groups, xsum, out, 1, 2, gs, terms,  \
                   lut, lut_lo, 0, 4);                                                         \
    }                                                                                          \
    static __attribute__((noinline)) void rows1_##gs##_##terms(PATH_ARGS) {                    \
        tiles_rows(tile, tile_bytes, sz, row0, x, ldx, K, groups, xsum, out, 1, 1, gs, terms,  \
                   lut, lut_lo, 0, 4);                                                         \
    }                                                                                          \
    HALF_PATH(gs, terms, 1, lo, 0, 2)                                                          \
    HALF_PATH(gs, terms, 1, hi, 2, 4)                                                          \
    HALF_PATH(gs, terms, 2, lo, 0, 2)                                                          \
    HALF_PATH(gs, terms, 2, hi, 2, 4)                                                          \
    HALF_PATH8(gs, terms, lo, 0)                                                               \
    HALF_PATH8(gs, terms, hi, 1)                                                               \
    static const RowPath paths_##gs##_##terms[11] = {                                          \
        rows8_##gs##_##terms,    rows4_##gs##_##terms,    two_tiles_##gs##_##terms,            \
        rows2_##gs##_##terms,    rows1_##gs##_##terms,    half1_lo_##gs##_##terms,             \
        half1_hi_##gs##_##terms, half2_lo_##gs##_##terms, half2_hi_##gs##_##terms,             \
        half8_lo_##gs##_##terms, half8_hi_##gs##_##terms};

typedef void (*RowPath)(PATH_ARGS);
ROW_PATHS(32, 0)
ROW_PATHS(16, 0)
ROW_PATHS(32, 1)
ROW_PATHS(16, 1)
ROW_PATHS(32, 2)
ROW_PATHS(16, 2)

/* the paths of one (group size, codebook terms): 8 rows, 4, two tiles of 1, 2, 1; then half
 * tiles: 1 row low half, high half, 2 rows low, high, 8 rows low, high */
static inline const RowPath *row_paths(const int GS, const int USE_LUT) {
    if (USE_LUT == 0) return GS == 32 ? paths_32_0 : paths_16_0;
    if (USE_LUT == 1) return GS == 32 ? paths_32_1 : paths_16_1;
    return GS == 32 ? paths_32_2 : paths_16_2;
}

/* nt (1 or 2) consecutive tiles from tile t for the M rows of x, or with half = 0 or 1 (nt 1)
 * only rows 32 half .. 32 half + 31 of tile t (operands of int4_mm_avx512) */
static inline __attribute__((always_inline)) void tile_unit(
    const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *packed,
    const Scales *sz, int64_t N, int64_t K2, const float *xsum, uint16_t *y, int64_t ldy,
    int64_t t, int64_t nt, int half, const int GS, const int USE_LUT, __m512i lut,
    __m512i lut_lo) {
    const int64_t groups = K2 / GS, tile_bytes = K2 * 32;
    float out[8 * TILE];
    const uint8_t *tile = packed + t * tile_bytes;
    const int64_t row0 = t * TILE, first = half < 0 ? 0 : 32 * half; /* rows of a tile stored */
    const int64_t span = half < 0 ? TILE : 32;
    const RowPath *paths = row_paths(GS, USE_LUT);
    for (int64_t m = 0; m < M;) {
        /* half tiles: 8, 2 or 1 rows of x at a time (paths 9, 7, 5 + half) */
        const int64_t mr = ROWS8 && M - m >= 8 ? 8 : half < 0 && M - m >= 4 ? 4 : M - m >= 2 ? 2 : 1;
        const int which = half >= 0 ? (mr == 8 ? 9 : mr == 2 ? 7 : 5) + half
                          : mr == 8 ? 0 : mr == 4 ? 1 : nt == 2 ? 2 : mr == 2 ? 3 : 4;
        paths[which](tile, tile_bytes, sz, row0, x + m * ldx, ldx, K, groups, xsum + m * groups,
                     out, lut, lut_lo);
        /* out holds (tile i, row m + j) at (i * mr + j) * 64 */
        for (int64_t i = 0; i < nt; i++) {
            const int64_t n0 = (t + i) * TILE + first;
            const int64_t rows = N - n0 < span ? N - n0 : span;
            for (int64_t j = 0; j < mr; j++)
                for (int64_t r = 0; r < rows; r += 16)
                    store_floats_bf16(out + (i * mr + j) * TILE + first + r,
                                      y + (m + j) * ldy + n0 + r, rows - r);
        }
        m += mr;
    }
}

/* Thread id's share of nth of the tiles for the M rows of x, groups of GS columns (operands of
 * int4_mm_avx512). */
static inline __attribute__((always_inline)) void tile_share(
    const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *packed,
    const Scales *sz, int64_t N, int64_t n_pad, int64_t K2, const float *xsum, uint16_t *y,
    int64_t ldy, const int GS, const int USE_LUT, __m512i lut, __m512i lut_lo, int64_t nth,
    int64_t id) {
    const int64_t tiles = n_pad / TILE;
    /* one row of x: tiles go two at a time (independent sums hide vdpbf16ps's latency);
     * more rows: one tile at a time, rows eight (then four, two, one) at a time. Each thread
     * takes an equal share (pairs of tiles as the unit of a static schedule gave 9 tiles on 2
     * threads as 6 and 3) */
    const int64_t step = M == 1 ? 2 : 1;
    /* more than one row of x: shares of half tiles, so that where the tiles do not split
     * evenly (9 tiles on 2 threads: 4.5 and 4.5, not 4 and 5) a tile's two halves go to two
     * threads (both read its bytes; each sums its rows). One row reads more than it computes:
     * whole tiles (a half tile of one row has only two independent sums, and both threads
     * would read it) */
    const int64_t units = M == 1 ? tiles : 2 * tiles, per = M == 1 ? 2 : 1;
    const int64_t u0 = units * id / nth * per, u1 = units * (id + 1) / nth * per;
    const int64_t t_end = u1 / 2;
    if (u0 % 2 && u0 < u1)
        tile_unit(x, M, K, ldx, packed, sz, N, K2, xsum, y, ldy, u0 / 2, 1, 1, GS, USE_LUT, lut,
                  lut_lo);
    for (int64_t t = (u0 + 1) / 2; t < t_end; t += step)
        tile_unit(x, M, K, ldx, packed, sz, N, K2, xsum, y, ldy, t,
                  t_end - t < step ? t_end - t : step, -1, GS, USE_LUT, lut, lut_lo);
    if (u1 % 2 && u0 < u1)
        tile_unit(x, M, K, ldx, packed, sz, N, K2, xsum, y, ldy, u1 / 2, 1, 0, GS, USE_LUT, lut,
                  lut_lo);
}

/* All tiles, shared by the calling team (cpu_team.h) or by a team of their own */
static inline __attribute__((always_inline)) void tile_loop(
    const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *packed,
    const Scales *sz, int64_t N, int64_t n_pad, int64_t K2, const float *xsum, uint16_t *y,
    int64_t ldy, const int GS, const int USE_LUT, __m512i lut, __m512i lut_lo) {
    TEAM_RUN(nth, id, tile_share(x, M, K, ldx, packed, sz, N, n_pad, K2, xsum, y, ldy, GS,
                                 USE_LUT, lut, lut_lo, nth, id));
}

void int4_mm_avx512(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *packed,
                    const Scales *sz, int64_t N, int64_t n_pad, int64_t K2, const float *xsum,
                    uint16_t *y, int64_t ldy, int64_t gs, const uint16_t *lut) {
    if (sz->planes == 2 && sz->half && !lut) {
        int4_mm_u8(x, M, K, ldx, packed, sz, N, n_pad, xsum, y, ldy, gs);
        return;
    }
    const __m512i lutv = lut ? _mm512_maskz_loadu_epi16(0xFFFF, lut) : _mm512_setzero_si512();
    const __m512i lutlo = lut ? _mm512_maskz_loadu_epi16(0xFFFF, lut + 16) : _mm512_setzero_si512();
    /* a codebook exact in bf16 (lo all zero: 0x0000 or 0x8000) takes one product per weight */
    const int terms = !lut ? 0
                      : _mm512_test_epi16_mask(lutlo, _mm512_set1_epi16(0x7FFF)) ? 2 : 1;
    if (gs == 32 && terms == 0)
        tile_loop(x, M, K, ldx, packed, sz, N, n_pad, K2, xsum, y, ldy, 32, 0, lutv, lutlo);
    else if (gs == 16 && terms == 0)
        tile_loop(x, M, K, ldx, packed, sz, N, n_pad, K2, xsum, y, ldy, 16, 0, lutv, lutlo);
    else if (gs == 32 && terms == 1)
        tile_loop(x, M, K, ldx, packed, sz, N, n_pad, K2, xsum, y, ldy, 32, 1, lutv, lutlo);
    else if (gs == 16 && terms == 1)
        tile_loop(x, M, K, ldx, packed, sz, N, n_pad, K2, xsum, y, ldy, 16, 1, lutv, lutlo);
    else if (gs == 32)
        tile_loop(x, M, K, ldx, packed, sz, N, n_pad, K2, xsum, y, ldy, 32, 2, lutv, lutlo);
    else
        tile_loop(x, M, K, ldx, packed, sz, N, n_pad, K2, xsum, y, ldy, 16, 2, lutv, lutlo);
}
