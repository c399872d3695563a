/* The integer path of the AVX-512 build's int4_mm, for weights without a codebook: the AVX2
 * build's formula (cpu_int4_avx2_int.c) with x rounded by the same code (cpu_int4_xint.h), so
 * that the two builds give a row the same bits. Per group of gs columns, row m of x and output
 * row n, the sum A = sum_k v[m, k] c[n, k] is an exact integer, and
 *     y = fma(s, A xs, y),  y = fma(zz, sxr, y)      (zz = z - 8 s; cpu_int4_avx2_int.c)
 * group by group from y = 0, the same operations in the same order whatever the batch, so a
 * row gets the same result alone or batched with any others.
 *
 * Products (VNNI): v = 256 h + l is kept as its two bytes, h signed and l unsigned
 * (round_rows_int's split). 128 bytes of a tile (columns k..k+3, 32 bytes each) become four
 * vectors of u8 codes, 16 rows x 4 columns each, in two vpermt2b and four and/shift (quads),
 * and vpdpbusd sums four products a lane:
 *     H += codes (u8) x h (s8),   L += l (u8) x codes (s8, 0..15),   A = 256 H + L
 * exact in int32 (|A| < 2^24 for a group of 32). One row of x takes a whole tile a pass, its
 * eight sums in registers; more rows take half a tile (two of the four row blocks, one
 * vpermt2b) for up to four rows of x at a time. On a Sapphire Rapids core, with the weight in
 * L2 (benchmarks/probe_int_decode.c), a 64-row tile and group of 32 took 28-31 ns at one row
 * against 61-72 for the bf16 dot products of cpu_int4_avx512.c.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "cpu_int4.h"
#include "cpu_int4_xint.h"
#include "cpu_team.h"
#include "cpu_simd.h"

#define VNNI_ROWS 8 /* rows of x per pass over a tile: running sums fp32 [8][64] on the stack */

/* vpermt2b indices for half j of a tile: lane n takes byte 16 j + n of each of the 4 columns
 * (the low nibbles: rows 16 j + n; the high ones: rows 32 + 16 j + n) */
#define QUAD(f, n) (f) + (n), 32 + (f) + (n), 64 + (f) + (n), 96 + (f) + (n)
#define QUADS(f) QUAD(f, 0), QUAD(f, 1), QUAD(f, 2), QUAD(f, 3), QUAD(f, 4), QUAD(f, 5), \
    QUAD(f, 6), QUAD(f, 7), QUAD(f, 8), QUAD(f, 9), QUAD(f, 10), QUAD(f, 11), QUAD(f, 12), \
    QUAD(f, 13), QUAD(f, 14), QUAD(f, 15)
static const uint8_t QUAD_INDEX[2][64] __attribute__((aligned(64))) = {{QUADS(0)}, {QUADS(16)}};

/* Columns 4q..4q+3 of a group (128 bytes at p) for half j: the codes of row block j (rows
 * 16 j ..) in *lo and of row block j + 2 (rows 32 + 16 j ..) in *hi, 4 columns a lane */
static inline __attribute__((always_inline)) void quad_half(const uint8_t *p, const int j,
                                                            __m512i *lo, __m512i *hi) {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const __m512i b = _mm512_permutex2var_epi8(_mm512_loadu_si512(p),
                                               _mm512_load_si512(QUAD_INDEX[j]),
                                               _mm512_loadu_si512(p + 64));
    *lo = _mm512_and_si512(b, low4);
    *hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), low4);
}

/* four bytes of a plane as the 32-bit value every lane gets */
static inline __m512i bytes4(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* y + the group's terms for 16 output rows: A = 256 H + L, y = fma(s, A xs, y), then
 * y = fma(zz, sxr, y) (the AVX2 build's update_int, lane for lane) */
static inline __m512 update(__m512i H, __m512i L, __m512 sc, __m512 zz, float xs, float sxr,
                            __m512 y) {
    const __m512i A = _mm512_add_epi32(_mm512_slli_epi32(H, 8), L);
    const __m512 a = _mm512_mul_ps(_mm512_cvtepi32_ps(A), _mm512_set1_ps(xs));
    return _mm512_fmadd_ps(zz, _mm512_set1_ps(sxr), _mm512_fmadd_ps(sc, a, y));
}

/* the scales of group g for the tile's rows row0 .., block r in sc[r] and zz[r] (bias 8) */
static inline __attribute__((always_inline)) void group_scales4(const Scales *sz, int64_t g,
                                                                int64_t row0, __m512 sc[4],
                                                                __m512 zz[4]) {
    for (int r = 0; r < 4; r++) sc[r] = group_scale(sz, g, row0 + 16 * r, 8.0f, &zz[r]);
}

/* the bytes of a group of GS columns of a tile, read PREFETCH_BYTES ahead */
static inline __attribute__((always_inline)) void prefetch_group(const uint8_t *gcols,
                                                                 const int GS) {
    for (int l = 0; l < GS * 32; l += 64)
        _mm_prefetch((const char *)gcols + PREFETCH_BYTES + l, STREAM_HINT);
}

/* One row of x, a whole tile (64 output rows from row0) into out (fp32 [64]) */
static inline __attribute__((always_inline)) void tile_one_row(
    const uint8_t *tile, const Scales *sz, int64_t row0, const IntRows *xr, int64_t groups,
    int64_t per_plane, float *out, const int GS) {
    __m512 y[4];
    for (int r = 0; r < 4; r++) y[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512 sc[4], zz[4];
        group_scales4(sz, g, row0, sc, zz);
        const uint8_t *gcols = tile + g * GS * 32;
        prefetch_group(gcols, GS);
        const int64_t gx = g % per_plane; /* plane 1 reads x again */
        const int8_t *h = xr->h + gx * GS;
        const uint8_t *l = xr->l + gx * GS;
        __m512i H[4], L[4];
        for (int r = 0; r < 4; r++) H[r] = L[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int q = 0; q < GS / 4; q++) {
            __m512i c[4];
            quad_half(gcols + 128 * q, 0, &c[0], &c[2]);
            quad_half(gcols + 128 * q, 1, &c[1], &c[3]);
            const __m512i bh = bytes4(h + 4 * q), bl = bytes4(l + 4 * q);
            for (int r = 0; r < 4; r++) {
                H[r] = _mm512_dpbusd_epi32(H[r], c[r], bh);
                L[r] = _mm512_dpbusd_epi32(L[r], bl, c[r]);
            }
        }
        for (int r = 0; r < 4; r++)
            y[r] = update(H[r], L[r], sc[r], zz[r], xr->xs[gx], xr->sxr[gx], y[r]);
    }
    for (int r = 0; r < 4; r++) _mm512_store_ps(out + 16 * r, y[r]);
}

/* R (1-4) rows of x (h, l: their planes at the group's first column, K apart; xs, sxr: their
 * group's, `stride` apart), group g of a tile (its bytes at gcols): out (fp32 [R][64], running)
 * += the group's terms, half a tile at a time */
#define BLOCK_ARGS                                                                             \
    const uint8_t *gcols, const int8_t *h, const uint8_t *l, int64_t K, const __m512 *sc,      \
        const __m512 *zz, const float *xs, const float *sxr, int64_t stride, float *out
static inline __attribute__((always_inline)) void rows_block(BLOCK_ARGS, const int GS,
                                                             const int R) {
    for (int j = 0; j < 2; j++) {
        __m512i H[4][2], L[4][2];
        for (int r = 0; r < R; r++)
            for (int i = 0; i < 2; i++) H[r][i] = L[r][i] = _mm512_setzero_si512();
#pragma GCC unroll 2
        for (int q = 0; q < GS / 4; q++) {
            __m512i c[2];
            quad_half(gcols + 128 * q, j, &c[0], &c[1]);
            for (int r = 0; r < R; r++) {
                const __m512i bh = bytes4(h + r * K + 4 * q), bl = bytes4(l + r * K + 4 * q);
                for (int i = 0; i < 2; i++) {
                    H[r][i] = _mm512_dpbusd_epi32(H[r][i], c[i], bh);
                    L[r][i] = _mm512_dpbusd_epi32(L[r][i], bl, c[i]);
                }
            }
        }
        for (int r = 0; r < R; r++)
            for (int i = 0; i < 2; i++) {
                float *o = out + r * TILE + 16 * (j + 2 * i); /* row block j + 2 i */
                _mm512_store_ps(o, update(H[r][i], L[r][i], sc[j + 2 * i], zz[j + 2 * i],
                                          xs[r * stride], sxr[r * stride], _mm512_load_ps(o)));
            }
    }
}

/* rows_block as a function of its own for each shape, so that GCC allocates each one's
 * registers alone */
typedef void (*RowsBlock)(BLOCK_ARGS);
#define ROWS_BLOCK(GS, R)                                                                      \
    static __attribute__((noinline)) void rows_block_##GS##_##R(BLOCK_ARGS) {                  \
        rows_block(gcols, h, l, K, sc, zz, xs, sxr, stride, out, GS, R);                       \
    }
ROWS_BLOCK(32, 1) ROWS_BLOCK(32, 2) ROWS_BLOCK(32, 3) ROWS_BLOCK(32, 4)
ROWS_BLOCK(16, 1) ROWS_BLOCK(16, 2) ROWS_BLOCK(16, 3) ROWS_BLOCK(16, 4)
#undef ROWS_BLOCK
static const RowsBlock ROWS_BLOCKS[2][4] = {
    {rows_block_32_1, rows_block_32_2, rows_block_32_3, rows_block_32_4},
    {rows_block_16_1, rows_block_16_2, rows_block_16_3, rows_block_16_4}};

/* tile t (64 output rows) for the M rows of x, VNNI_ROWS at a time */
static inline __attribute__((always_inline)) void tile_rows(
    const IntRows *xr, int64_t M, int64_t K, const uint8_t *packed, const Scales *sz,
    int64_t N, int64_t K2, uint16_t *y, int64_t ldy, int64_t t, const int GS) {
    const int64_t groups = K2 / GS, per_plane = K / GS, row0 = t * TILE;
    const uint8_t *tile = packed + t * K2 * 32;
    float out[VNNI_ROWS * TILE] __attribute__((aligned(64))); /* [rows][64] */
    for (int64_t m0 = 0; m0 < M; m0 += VNNI_ROWS) {
        const int64_t mc = M - m0 < VNNI_ROWS ? M - m0 : VNNI_ROWS;
        if (mc == 1) {
            IntRows one = *xr;
            one.h += m0 * K, one.l += m0 * K;
            one.xs += m0 * per_plane, one.sxr += m0 * per_plane;
            tile_one_row(tile, sz, row0, &one, groups, per_plane, out, GS);
        } else {
            for (int64_t i = 0; i < mc * TILE; i += 16)
                _mm512_store_ps(out + i, _mm512_setzero_ps());
            for (int64_t g = 0; g < groups; g++) {
                __m512 sc[4], zz[4];
                group_scales4(sz, g, row0, sc, zz);
                const uint8_t *gcols = tile + g * GS * 32;
                prefetch_group(gcols, GS);
                const int64_t gx = g % per_plane, at = m0 * K + gx * GS;
                const float *xs = xr->xs + m0 * per_plane + gx;
                const float *sxr = xr->sxr + m0 * per_plane + gx;
                for (int64_t r0 = 0; r0 < mc; r0 += 4) {
                    const int64_t rows = mc - r0 < 4 ? mc - r0 : 4;
                    ROWS_BLOCKS[GS == 16][rows - 1](
                        gcols, xr->h + at + r0 * K, xr->l + at + r0 * K, K, sc, zz,
                        xs + r0 * per_plane, sxr + r0 * per_plane, per_plane, out + r0 * TILE);
                }
            }
        }
        const int64_t rows = N - row0 < TILE ? N - row0 : TILE;
        for (int64_t m = 0; m < mc; m++)
            for (int64_t r = 0; r < rows; r += 16)
                store_floats_bf16(out + m * TILE + r, y + (m0 + m) * ldy + row0 + r, rows - r);
    }
}

/* Thread id's tiles among nth (cpu_team.h's shares); the group size switches inside the
 * loop, so that each inlined copy of tile_rows has it as a constant */
static __attribute__((noinline)) void tile_share_vnni(
    const IntRows *xr, int64_t M, int64_t K, const uint8_t *packed, const Scales *sz, int64_t N,
    int64_t n_pad, int64_t K2, uint16_t *y, int64_t ldy, int64_t gs, int64_t *ranges,
    int64_t nth, int64_t id) {
    Share share = share_of(ranges, n_pad / TILE, 1, nth, id);
    int64_t t0, t1;
    while (share_next(&share, &t0, &t1))
        for (int64_t t = t0; t < t1; t++) {
            if (gs == 32)
                tile_rows(xr, M, K, packed, sz, N, K2, y, ldy, t, 32);
            else
                tile_rows(xr, M, K, packed, sz, N, K2, y, ldy, t, 16);
        }
}

/* int4_mm_vnni of cpu_int4.h: x rounded, a slab of rows at a time outside a team (a team's
 * call, a decode step's few rows, in one) */
int int4_mm_vnni(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *packed,
                 const Scales *sz, int64_t N, int64_t n_pad, int64_t K2, uint16_t *y,
                 int64_t ldy, int64_t gs, int64_t *claim) {
    SHARE_OWN(own, claim);
    int64_t *ranges = share_ranges(claim, own);
    unsigned char room[INT_ROOM] __attribute__((aligned(64)));
    const int64_t slab = claim || in_team() ? M : int_slab_rows(K, gs);
    void *mem = int_rows_memory(int_rows_bytes(M < slab ? M : slab, K, gs), room);
    if (!mem) return -1;
    for (int64_t m0 = 0; m0 < M; m0 += slab) {
        const int64_t ms = M - m0 < slab ? M - m0 : slab;
        IntRows xr;
        round_rows_int(x + m0 * ldx, ms, K, ldx, gs, mem, 1, &xr);
        if (m0 && ranges == own) memset(own, 0, sizeof(int64_t) * (size_t)(own_n * SHARE_LINE));
        TEAM_RUN(nth, id, tile_share_vnni(&xr, ms, K, packed, sz, N, n_pad, K2, y + m0 * ldy,
                                          ldy, gs, ranges, nth, id));
    }
    return 0;
}
