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
 * vpermt2b) a pass over all the groups for up to four rows of x at a time, their running sums
 * in registers too, or with `amx` AMX-INT8 tiles (cpu_int4_amx_int8.c).
 * On the Xeon of benchmarks/README.md (one thread, a 3072 x 576 weight in L2,
 * benchmarks/probe_int_decode.c), ns a 64-row tile and group of 32: one row 33-35 on VNNI
 * against 67-75 on the bf16 tiles; eight rows 167-171 on VNNI, 112-114 on AMX-INT8 and 95-97
 * on the bf16 tiles (whose epilogue takes one fp32 sum a group where this one converts and
 * scales two integer ones). With the running sums of several rows in memory, group by group,
 * eight rows on VNNI took 1.07x as long (153-167 against 142-155, alternating builds).
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_int4.h"
#include "cpu_int4_vnni.h"
#include "cpu_int4_xint.h"
#include "cpu_kernels.h"
#include "cpu_team.h"
#include "cpu_simd.h"

/* four bytes of a plane as the 32-bit value every lane gets */
static inline __m512i bytes4(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
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

/* R (1-4) rows of x (h, l: their planes, K apart; xs, sxr: their groups', per_plane apart),
 * halves j0 .. j1 - 1 of a tile (codes at `tile`, rows from row0) into out (fp32 [R][64]):
 * half j (row blocks j and j + 2, one vpermt2b) a pass over all the groups, its sums in
 * registers */
#define ROWS_ARGS                                                                              \
    const uint8_t *tile, const Scales *sz, int64_t row0, const int8_t *h, const uint8_t *l,     \
        int64_t K, const float *xs, const float *sxr, int64_t per_plane, int64_t groups,        \
        float *out, int j0, int j1
static inline __attribute__((always_inline)) void rows_tile(ROWS_ARGS, const int GS,
                                                            const int R) {
    for (int j = j0; j < j1; j++) {
        __m512 y[4][2];
        for (int r = 0; r < R; r++) y[r][0] = y[r][1] = _mm512_setzero_ps();
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *gcols = tile + g * GS * 32;
            if (j == j0) prefetch_group(gcols, GS); /* the first half streams the weights in */
            const int64_t gx = g % per_plane; /* plane 1 reads x again */
            __m512i H[4][2], L[4][2];
            for (int r = 0; r < R; r++)
                for (int i = 0; i < 2; i++) H[r][i] = L[r][i] = _mm512_setzero_si512();
#pragma GCC unroll 8
            for (int q = 0; q < GS / 4; q++) {
                __m512i c[2];
                quad_half(gcols + 128 * q, j, &c[0], &c[1]);
                for (int r = 0; r < R; r++) {
                    const __m512i bh = bytes4(h + r * K + gx * GS + 4 * q);
                    const __m512i bl = bytes4(l + r * K + gx * GS + 4 * q);
                    for (int i = 0; i < 2; i++) {
                        H[r][i] = _mm512_dpbusd_epi32(H[r][i], c[i], bh);
                        L[r][i] = _mm512_dpbusd_epi32(L[r][i], bl, c[i]);
                    }
                }
            }
            for (int i = 0; i < 2; i++) { /* row block j + 2 i */
                __m512 zz;
                const __m512 sc = group_scale(sz, g, row0 + 16 * (j + 2 * i), 8.0f, &zz);
                for (int r = 0; r < R; r++)
                    y[r][i] = update(H[r][i], L[r][i], sc, zz, xs[r * per_plane + gx],
                                     sxr[r * per_plane + gx], y[r][i]);
            }
        }
        for (int r = 0; r < R; r++)
            for (int i = 0; i < 2; i++) _mm512_store_ps(out + r * TILE + 16 * (j + 2 * i), y[r][i]);
    }
}

/* rows_tile as a function of its own for each shape, so that GCC allocates each one's
 * registers alone */
typedef void (*RowsTile)(ROWS_ARGS);
#define ROWS_TILE(GS, R)                                                                       \
    static __attribute__((noinline)) void rows_tile_##GS##_##R(ROWS_ARGS) {                    \
        rows_tile(tile, sz, row0, h, l, K, xs, sxr, per_plane, groups, out, j0, j1, GS, R);    \
    }
ROWS_TILE(32, 1) ROWS_TILE(32, 2) ROWS_TILE(32, 3) ROWS_TILE(32, 4)
ROWS_TILE(16, 1) ROWS_TILE(16, 2) ROWS_TILE(16, 3) ROWS_TILE(16, 4)
#undef ROWS_TILE
static const RowsTile ROWS_TILES[2][4] = {
    {rows_tile_32_1, rows_tile_32_2, rows_tile_32_3, rows_tile_32_4},
    {rows_tile_16_1, rows_tile_16_2, rows_tile_16_3, rows_tile_16_4}};

/* Tile t (64 output rows) for the M rows of x, its row blocks j and j + 2 for j0 <= j < j1:
 * the whole tile or one half of it. Rows VNNI_ROWS at a time; each row block's sums are the
 * same whichever call computes them. */
static inline __attribute__((always_inline)) void tile_rows(
    const IntRows *xr, int64_t M, int64_t K, const uint8_t *packed, const Scales *sz,
    int64_t N, int64_t K2, uint16_t *y, int64_t ldy, int64_t t, int j0, int j1,
    const uint8_t *cells, const int GS) {
    const int64_t groups = K2 / GS, per_plane = K / GS, row0 = t * TILE;
    const uint8_t *tile = packed + t * K2 * 32;
    float out[VNNI_ROWS * TILE] __attribute__((aligned(64))); /* [rows][64] */
    for (int64_t m0 = 0; m0 < M; m0 += VNNI_ROWS) {
        const int64_t mc = M - m0 < VNNI_ROWS ? M - m0 : VNNI_ROWS;
        if (mc == 1 && j1 - j0 == 2) {
            IntRows one = *xr;
            one.h += m0 * K, one.l += m0 * K;
            one.xs += m0 * per_plane, one.sxr += m0 * per_plane;
            tile_one_row(tile, sz, row0, &one, groups, per_plane, out, GS);
        } else if (cells && mc > 1) { /* AMX-INT8: chunk m0 / VNNI_ROWS's cells */
            int4_int8_rows(cells, m0, mc, tile, sz, row0, groups, per_plane,
                           xr->xs + m0 * per_plane, xr->sxr + m0 * per_plane, out, j0, j1);
        } else {
            for (int64_t r0 = 0; r0 < mc; r0 += 4) {
                const int64_t rows = mc - r0 < 4 ? mc - r0 : 4;
                ROWS_TILES[GS == 16][rows - 1](tile, sz, row0, xr->h + (m0 + r0) * K,
                                               xr->l + (m0 + r0) * K, K,
                                               xr->xs + (m0 + r0) * per_plane,
                                               xr->sxr + (m0 + r0) * per_plane, per_plane,
                                               groups, out + r0 * TILE, j0, j1);
            }
        }
        const int64_t rows = N - row0 < TILE ? N - row0 : TILE;
        for (int64_t m = 0; m < mc; m++)
            for (int j = j0; j < j1; j++)
                for (int64_t r = 16 * j; r < rows; r += 32)
                    store_floats_bf16(out + m * TILE + r, y + (m0 + m) * ldy + row0 + r,
                                      rows - r < 16 ? rows - r : 16);
    }
}

/* Thread id's tiles among nth (cpu_team.h's shares); with `amx` (groups of 32), chunks of 2
 * or more rows on AMX-INT8 tiles where this thread's cells can be had (else VNNI: the same
 * bits), the tiles released at the end unless `held` (a team's step releases them). The
 * group size switches inside the loop, so that each inlined copy of tile_rows has it as a
 * constant. */
static __attribute__((noinline)) void tile_share_vnni(
    const IntRows *xr, int64_t M, int64_t K, const uint8_t *packed, const Scales *sz, int64_t N,
    int64_t n_pad, int64_t K2, uint16_t *y, int64_t ldy, int64_t gs, int amx, int held,
    int64_t *ranges, int64_t nth, int64_t id) {
    const uint8_t *cells = amx && gs == GROUP && M > 1 ? int4_int8_cells(xr, M, K, K2 / GROUP)
                                                       : NULL;
    /* the units shared out: one row's whole tiles (its half-tile pass is slower than
     * tile_one_row), a batch's halves of tiles: a thread's last whole tile of 8 rows kept the
     * other waiting at the team's barrier (the engine's 8 streams 5% faster, in-process A/B) */
    const int halves = M > 1;
    Share share = share_of(ranges, (halves ? 2 : 1) * (n_pad / TILE), 1, nth, id);
    int64_t u0, u1;
    while (share_next(&share, &u0, &u1))
        for (int64_t u = u0; u < u1;) {
            const int whole = !halves || (u % 2 == 0 && u + 1 < u1);
            const int j0 = whole ? 0 : (int)(u % 2), j1 = whole ? 2 : j0 + 1;
            const int64_t t = halves ? u / 2 : u;
            if (gs == 32)
                tile_rows(xr, M, K, packed, sz, N, K2, y, ldy, t, j0, j1, cells, 32);
            else
                tile_rows(xr, M, K, packed, sz, N, K2, y, ldy, t, j0, j1, NULL, 16);
            u += whole && halves ? 2 : 1;
        }
    if (cells && !held) int4_tiles_release();
}

/* int4_mm_vnni of cpu_int4.h: x rounded, a slab of rows at a time outside a team (a team's
 * call, a decode step's few rows, in one) */
int int4_mm_vnni(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *packed,
                 const Scales *sz, int64_t N, int64_t n_pad, int64_t K2, uint16_t *y,
                 int64_t ldy, int64_t gs, int amx, int64_t *claim) {
    SHARE_OWN(own, claim);
    int64_t *ranges = share_ranges(claim, own);
    const int held = in_team(); /* a team's step: its tiles stay configured */
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
                                          ldy, gs, amx, held, ranges, nth, id));
    }
    return 0;
}
