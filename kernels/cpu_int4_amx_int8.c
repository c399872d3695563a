/* The AVX-512 build's integer path (cpu_int4_vnni.c) for 2 to VNNI_ROWS rows of x on AMX-INT8
 * tiles, groups of 32, where int4_mm's amx is on: the same integer sums H and L by tile
 * multiplies as VNNI's, so the same bits. A pair of groups (64 columns) of a 64-row tile is
 * four B tiles, one per row block: B row kq (of 16) holds quad kq's 16 rows x 4 codes (u8), as
 * quad_half makes them. x's rows are A tiles of
 * 2 mc rows x 64 bytes, one for h (TDPBSUD: h signed, codes unsigned) and one for l (TDPBUUD):
 * row i mc + m holds group 2q + i of row m in bytes 32 i .. 32 i + 31 and zeros in the others,
 * so that C row i mc + m gets that group's sums alone. Half a tile a pass (C: H and L of two
 * row blocks), then the epilogue group by group in order. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu_int4.h"
#include "cpu_int4_vnni.h"

#define PAIR_BYTES (2 * GROUP * 32) /* a pair of groups of a 64-row tile: 64 columns */

/* the A cells of x's rows m0 .. m0 + mc - 1 for every pair q of groups: plane p (0: h, 1: l)
 * at cells + (2 q + p) * 2 mc * 64 (the layout above; a last odd group's partner rows zero),
 * each row one 64-byte store (0.20 -> 0.12 us for 8 rows of 576 columns with memset and
 * memcpy a row and the plane's column found by a division each) */
static void amx_cells(const IntRows *xr, int64_t m0, int64_t mc, int64_t K, int64_t groups,
                      int64_t per_plane, uint8_t *cells) {
    for (int64_t g = 0; g < (groups + 1) / 2 * 2; g++) {
        const int64_t q = g / 2, i = g % 2, at = g < groups ? m0 * K + g % per_plane * GROUP : -1;
        for (int p = 0; p < 2; p++) {
            const uint8_t *plane = at < 0 ? NULL : (p ? xr->l : (const uint8_t *)xr->h) + at;
            uint8_t *row = cells + ((2 * q + p) * 2 * mc + i * mc) * 64;
            for (int64_t m = 0; m < mc; m++, row += 64) {
                const __m256i v = plane ? _mm256_loadu_si256((const __m256i *)(plane + m * K))
                                        : _mm256_setzero_si256();
                _mm512_store_si512(row, i ? _mm512_inserti64x4(_mm512_setzero_si512(), v, 1)
                                          : _mm512_zextsi256_si512(v));
            }
        }
    }
}
static inline size_t amx_cells_bytes(int64_t mc, int64_t groups) {
    return (size_t)((groups + 1) / 2 * 2 * 2 * mc * 64);
}

/* Half j of pair q's codes (ng = 1 or 2 groups at p) as two B tiles: bt[0] row block j,
 * bt[1] row block j + 2 (quad_half's two) */
static inline __attribute__((always_inline)) void pair_half(const uint8_t *p, int64_t ng,
                                                            const int j, int fetch,
                                                            uint8_t bt[2][16][64]) {
    for (int64_t kq = 0; kq < 8 * ng; kq++) {
        if (fetch && kq % 2 == 0) { /* the first half streams the weights in */
            _mm_prefetch((const char *)p + 128 * kq + PREFETCH_BYTES, STREAM_HINT);
            _mm_prefetch((const char *)p + 128 * kq + PREFETCH_BYTES + 64, STREAM_HINT);
        }
        __m512i lo, hi;
        quad_half(p + 128 * kq, j, &lo, &hi);
        _mm512_store_si512(bt[0][kq], lo);
        _mm512_store_si512(bt[1][kq], hi);
    }
}

/* Half j (row blocks j and j + 2) of a 64-row tile (codes at `tile`, rows from row0) for MC
 * (2..VNNI_ROWS) rows of x (their cells; xs, sxr from their first row, per_plane apart) into
 * out (fp32 [MC][64]), its sums in registers over all the groups */
static inline __attribute__((always_inline)) void amx_half(
    const uint8_t *tile, const Scales *sz, int64_t row0, const uint8_t *cells, int64_t groups,
    int64_t per_plane, const float *xs, const float *sxr, float *out, const int MC, int j,
    int fetch) {
    /* three pairs' B tiles: the next pair is unpacked before this one's multiplies, since a
     * tile load of just-stored lines waits for the stores */
    uint8_t bt[3][2][16][64] __attribute__((aligned(64)));
    int32_t ct[4][2 * VNNI_ROWS][16] __attribute__((aligned(64)));
    const int64_t pairs = (groups + 1) / 2;
    __m512 y[VNNI_ROWS][2];
    for (int m = 0; m < MC; m++) y[m][0] = y[m][1] = _mm512_setzero_ps();
    pair_half(tile, groups < 2 ? groups : 2, j, fetch, bt[0]);
    for (int64_t q = 0; q < pairs; q++) {
        if (q + 1 < pairs)
            pair_half(tile + (q + 1) * PAIR_BYTES, groups - 2 * (q + 1) < 2 ? 1 : 2, j, fetch,
                      bt[(q + 1) % 3]);
        const uint8_t *ah = cells + 2 * q * 2 * MC * 64, *al = ah + 2 * MC * 64;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        _tile_loadd(5, bt[q % 3][0], 64);
        _tile_loadd(6, bt[q % 3][1], 64);
        _tile_loadd(4, ah, 64);
        _tile_dpbsud(0, 4, 5);
        _tile_dpbsud(1, 4, 6);
        _tile_loadd(4, al, 64);
        _tile_dpbuud(2, 4, 5);
        _tile_dpbuud(3, 4, 6);
        _tile_stored(0, ct[0], 64);
        _tile_stored(1, ct[1], 64);
        _tile_stored(2, ct[2], 64);
        _tile_stored(3, ct[3], 64);
        for (int64_t i = 0; i < 2 && 2 * q + i < groups; i++) {
            const int64_t g = 2 * q + i, gx = g % per_plane;
            __m512 sc[2], zz[2];
            for (int b = 0; b < 2; b++)
                sc[b] = group_scale(sz, g, row0 + 16 * (j + 2 * b), 8.0f, &zz[b]);
            for (int m = 0; m < MC; m++)
                for (int b = 0; b < 2; b++)
                    y[m][b] = update(_mm512_load_si512(ct[b][i * MC + m]),
                                     _mm512_load_si512(ct[2 + b][i * MC + m]), sc[b], zz[b],
                                     xs[m * per_plane + gx], sxr[m * per_plane + gx], y[m][b]);
        }
    }
    for (int m = 0; m < MC; m++)
        for (int b = 0; b < 2; b++) _mm512_store_ps(out + m * TILE + 16 * (j + 2 * b), y[m][b]);
}

/* Halves j0 .. j1 - 1 of a 64-row tile for MC rows of x on AMX-INT8 (operands of amx_half),
 * compiled for each MC */
#define AMX_ARGS                                                                               \
    const uint8_t *tile, const Scales *sz, int64_t row0, const uint8_t *cells, int64_t groups,  \
        int64_t per_plane, const float *xs, const float *sxr, float *out, int j0, int j1
typedef void (*AmxRows)(AMX_ARGS);
#define AMX_INT8_ROWS(MC)                                                                      \
    static __attribute__((noinline)) void amx_rows_##MC(AMX_ARGS) {                           \
        int4_amx_config(2 * MC);                                                               \
        for (int j = j0; j < j1; j++)                                                          \
            amx_half(tile, sz, row0, cells, groups, per_plane, xs, sxr, out, MC, j, j == j0);  \
    }
AMX_INT8_ROWS(2) AMX_INT8_ROWS(3) AMX_INT8_ROWS(4) AMX_INT8_ROWS(5)
AMX_INT8_ROWS(6) AMX_INT8_ROWS(7) AMX_INT8_ROWS(8)
#undef AMX_INT8_ROWS
static const AmxRows AMX_ROWS_OF[VNNI_ROWS + 1] = {
    NULL, NULL, amx_rows_2, amx_rows_3, amx_rows_4, amx_rows_5, amx_rows_6, amx_rows_7,
    amx_rows_8};

/* The calling thread's buffer for AMX-INT8's cells of M rows (amx_cells, a chunk of
 * VNNI_ROWS rows every amx_cells_bytes(VNNI_ROWS, groups)), grown as needed and kept */
static __thread uint8_t *cells_buf;
static __thread size_t cells_buf_bytes;
static uint8_t *cells_memory(size_t bytes) {
    if (bytes > cells_buf_bytes) {
        free(cells_buf);
        cells_buf = aligned_alloc(64, (bytes + 63) / 64 * 64);
        cells_buf_bytes = cells_buf ? bytes : 0;
    }
    return cells_buf;
}

const uint8_t *int4_int8_cells(const IntRows *xr, int64_t M, int64_t K, int64_t groups) {
    const size_t chunk = amx_cells_bytes(VNNI_ROWS, groups);
    uint8_t *cells = cells_memory((size_t)((M + VNNI_ROWS - 1) / VNNI_ROWS) * chunk);
    for (int64_t m0 = 0; cells && m0 < M; m0 += VNNI_ROWS) {
        const int64_t mc = M - m0 < VNNI_ROWS ? M - m0 : VNNI_ROWS;
        if (mc > 1) amx_cells(xr, m0, mc, K, groups, K / GROUP, cells + m0 / VNNI_ROWS * chunk);
    }
    return cells;
}

void int4_int8_rows(const uint8_t *cells, int64_t m0, int64_t mc, const uint8_t *tile,
                    const Scales *sz, int64_t row0, int64_t groups, int64_t per_plane,
                    const float *xs, const float *sxr, float *out, int j0, int j1) {
    AMX_ROWS_OF[mc](tile, sz, row0, cells + m0 / VNNI_ROWS * amx_cells_bytes(VNNI_ROWS, groups),
                    groups, per_plane, xs, sxr, out, j0, j1);
}
