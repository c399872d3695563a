/* The few-rows path of int4_mm for codebook weights (IQ4_NL, IQ4_XS, NF4) on AVX-512 BF16
 * (layout and formula: cpu_int4.h; weights without a codebook take cpu_int4_vnni.c).
 *
 * One 64-byte load holds columns k and k+1 of a 64-row tile. Each nibble c becomes its
 * codebook value hi[c] (bf16; with a second term lo[c] where the codebook is not exact in
 * bf16), laid out as (k, k+1) pairs per row, so that `vdpbf16ps` adds x[k] hi[c[n,k]] +
 * x[k+1] hi[c[n,k+1]] into one fp32 lane per row. Per group of gs columns, with a = that sum
 * (and the lo terms') and sx = sum of x:
 *     sum_k x (hi[c] + lo[c]) s + z x  =  s a + z sx
 * Products of bf16 numbers are exact in fp32; sums are fp32. Rows are split across OpenMP
 * threads by tiles.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#include "cpu_int4.h"
#include "cpu_int4_tiles.h"
#include "cpu_team.h"
#include "cpu_kernels.h"
#include "cpu_simd.h"

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
ROW_PATHS(32, 1)
ROW_PATHS(16, 1)
ROW_PATHS(32, 2)
ROW_PATHS(16, 2)

/* the paths of one (group size, codebook terms): 8 rows, 4, two tiles of 1, 2, 1; then half
 * tiles: 1 row low half, high half, 2 rows low, high, 8 rows low, high */
static inline const RowPath *row_paths(const int GS, const int USE_LUT) {
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

/* Half tiles u0 .. u1 - 1 (half tile u: rows 32 (u % 2) .. + 31 of tile u / 2) for the M rows
 * of x, groups of GS columns (operands of int4_mm_avx512): whole tiles where both halves are
 * in the range, `step` at a time */
static inline __attribute__((always_inline)) void tile_range(
    const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *packed,
    const Scales *sz, int64_t N, int64_t K2, const float *xsum, uint16_t *y, int64_t ldy,
    const int GS, const int USE_LUT, __m512i lut, __m512i lut_lo, int64_t u0, int64_t u1,
    int64_t step) {
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

/* Thread id's tiles among nth for the M rows of x (operands of int4_mm_avx512): its share,
 * then what it takes of the others' (share_next with the team's `ranges`; NULL: its share). */
static inline __attribute__((always_inline)) void tile_share(
    const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *packed,
    const Scales *sz, int64_t N, int64_t n_pad, int64_t K2, const float *xsum, uint16_t *y,
    int64_t ldy, const int GS, const int USE_LUT, __m512i lut, __m512i lut_lo,
    int64_t *ranges, int64_t nth, int64_t id) {
    const int64_t tiles = n_pad / TILE;
    /* one row of x: tiles go two at a time (independent sums hide vdpbf16ps's latency), and
     * are shared out two at a time; more rows: one tile at a time, rows eight (then four,
     * two, one) at a time, shared out in half tiles, so that where the tiles do not split
     * evenly (9 tiles on 2 threads: 4.5 and 4.5, not 4 and 5) a tile's two halves go to two
     * threads (both read its bytes; each sums its rows). One row reads more than it computes:
     * whole tiles (a half tile of one row has only two independent sums, and both threads
     * would read it) */
    const int64_t step = M == 1 ? 2 : 1, per = M == 1 ? 2 : 1; /* half tiles a unit */
    Share share = share_of(ranges, M == 1 ? tiles : 2 * tiles, 2, nth, id);
    int64_t u0, u1;
    while (share_next(&share, &u0, &u1))
        tile_range(x, M, K, ldx, packed, sz, N, K2, xsum, y, ldy, GS, USE_LUT, lut, lut_lo,
                   u0 * per, u1 * per, step);
}

/* All tiles, shared by the calling team (cpu_team.h) or by a team of their own */
static inline __attribute__((always_inline)) void tile_loop(
    const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *packed,
    const Scales *sz, int64_t N, int64_t n_pad, int64_t K2, const float *xsum, uint16_t *y,
    int64_t ldy, const int GS, const int USE_LUT, __m512i lut, __m512i lut_lo,
    int64_t *claim) {
    SHARE_OWN(own, claim);
    int64_t *ranges = share_ranges(claim, own);
    TEAM_RUN(nth, id, tile_share(x, M, K, ldx, packed, sz, N, n_pad, K2, xsum, y, ldy, GS,
                                 USE_LUT, lut, lut_lo, ranges, nth, id));
}

void int4_mm_avx512(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *packed,
                    const Scales *sz, int64_t N, int64_t n_pad, int64_t K2, const float *xsum,
                    uint16_t *y, int64_t ldy, int64_t gs, const uint16_t *lut, int64_t *claim) {
    const __m512i lutv = _mm512_maskz_loadu_epi16(0xFFFF, lut);
    const __m512i lutlo = _mm512_maskz_loadu_epi16(0xFFFF, lut + 16);
    /* a codebook exact in bf16 (lo all zero: 0x0000 or 0x8000) takes one product per weight */
    const int two = _mm512_test_epi16_mask(lutlo, _mm512_set1_epi16(0x7FFF)) != 0;
    if (gs == 32 && !two)
        tile_loop(x, M, K, ldx, packed, sz, N, n_pad, K2, xsum, y, ldy, 32, 1, lutv, lutlo,
                  claim);
    else if (gs == 16 && !two)
        tile_loop(x, M, K, ldx, packed, sz, N, n_pad, K2, xsum, y, ldy, 16, 1, lutv, lutlo,
                  claim);
    else if (gs == 32)
        tile_loop(x, M, K, ldx, packed, sz, N, n_pad, K2, xsum, y, ldy, 32, 2, lutv, lutlo,
                  claim);
    else
        tile_loop(x, M, K, ldx, packed, sz, N, n_pad, K2, xsum, y, ldy, 16, 2, lutv, lutlo,
                  claim);
}
