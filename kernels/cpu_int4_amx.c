/* The int4 matmuls on AMX tiles (Sapphire Rapids and later), layout and formula in cpu_int4.h:
 * int4_mm's tile path and int4_gemm for a prompt's rows. The OS's permission to use the tiles
 * is asked in cpu_int4.c (int4_gemm_ready).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_int4.h"
#include "cpu_kernels.h"
#include "cpu_simd.h"
#include "cpu_team.h"

#define AMX_ROWS 16

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) TileConfig;

/* The row count the calling thread's tiles are configured for (int4_amx_config), 0: none. A kernel
 * called by a team's thread (decode_layers') leaves them configured for the next matmul, and
 * the team releases them at the end of its step (int4_tiles_release): configuring and
 * releasing them at every matmul cost about 2 us a call, 6% of a one-row decode step. */
static __thread int64_t tile_rows = 0;

/* tmm0-3: C for the four 16-row blocks of a tile; tmm4: A (x); tmm5-7: B */
void int4_amx_config(int64_t mr) {
    if (tile_rows == mr) return;
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) {
        cfg.colsb[i] = 64;
        cfg.rows[i] = i < 5 ? (uint8_t)mr : 16;
    }
    /* GCC 12 does not count ldtilecfg as reading cfg: without this, in a function of its own
     * it dropped the stores of the loop above and loaded an empty configuration */
    __asm__ volatile("" : : "m"(cfg) : "memory");
    _tile_loadconfig(&cfg);
    tile_rows = mr;
}

void int4_tiles_release(void) {
    if (tile_rows) _tile_release();
    tile_rows = 0;
}

/* ---- int4_mm's path on tiles: the AVX-512 path's formula with tile matmuls ----
 *
 * Per 64-row tile and group of 32 columns (groups of 16 take the integer path), the unpacked
 * (k, k+1) pairs 128 + c of four 16-row blocks are exactly four B tiles of TDPBF16PS (16 pair
 * rows x 16 columns); x's rows for the group are the A tile; C (x rows x 16 fp32) =
 * sum x (128 + c), then per group s C + (z - 136 s) sx. A tile multiply sums a group in its
 * own order (the results differ from the integer paths'), but each output element is summed
 * within one tile op whatever the number of rows, so a row's result does not depend on its
 * batch. A prompt's rows take this path, and with LOCALLLM_AMX=bf16 every decoding row, one
 * row included. */

/* Group g's 64 x 32 codes at p as the four B tiles of TDPBF16PS, bt[r]: 16 pair rows of row
 * block r's 16 weights (128 + c, bf16) */
static inline __attribute__((always_inline)) void unpack_group(const uint8_t *p,
                                                               uint16_t bt[4][16][32]) {
    _mm_prefetch((const char *)p + PREFETCH_BYTES, STREAM_HINT);
    for (int kp = 0; kp < GROUP / 2; kp++) {
        if (kp % 2 == 0)
            _mm_prefetch((const char *)p + 64 * kp + PREFETCH_BYTES + 64, STREAM_HINT);
        __m512i w[4];
        unpack_pairs(_mm512_loadu_si512(p + 64 * kp), w);
        for (int r = 0; r < 4; r++) _mm512_store_si512(bt[r][kp], w[r]);
    }
}

/* C tiles 0-3 += A (tile 4, loaded by the caller) times the four B tiles of bt */
static inline __attribute__((always_inline)) void group_products(uint16_t bt[4][16][32]) {
    _tile_loadd(5, bt[0], 64);
    _tile_loadd(6, bt[1], 64);
    _tile_loadd(7, bt[2], 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_dpbf16ps(1, 4, 6);
    _tile_dpbf16ps(2, 4, 7);
    _tile_loadd(5, bt[3], 64);
    _tile_dpbf16ps(3, 4, 5);
}

static inline __attribute__((always_inline)) void store_sums(float ct[4][AMX_ROWS][16]) {
    _tile_stored(0, ct[0], 64);
    _tile_stored(1, ct[1], 64);
    _tile_stored(2, ct[2], 64);
    _tile_stored(3, ct[3], 64);
}

/* acc[m] (fp32 [64], m < mr) += group g's sums, C row c + m (ct), scaled: s a + (z - 136 s) sx,
 * with xs[m * groups] x's sum over the group (tile rows from row0) */
static inline __attribute__((always_inline)) void add_group(
    const Scales *sz, int64_t g, int64_t row0, int64_t mr, const float *xs, int64_t groups,
    float ct[4][AMX_ROWS][16], int64_t c, float *acc) {
    for (int r = 0; r < 4; r++) {
        __m512 zz; /* z - 136 s */
        const __m512 sc = group_scale(sz, g, row0 + 16 * r, 136.0f, &zz);
        for (int64_t m = 0; m < mr; m++) {
            float *o = acc + m * TILE + 16 * r;
            __m512 a = _mm512_fmadd_ps(sc, _mm512_load_ps(ct[r][c + m]), _mm512_load_ps(o));
            a = _mm512_fmadd_ps(zz, _mm512_set1_ps(xs[m * groups]), a);
            _mm512_store_ps(o, a);
        }
    }
}

/* ---- up to 8 rows of x: their groups in the rows of C ----
 *
 * With one group to a C tile, the four C tiles are stored after every group, and a tile store
 * waits for the tile multiplies before it and holds back the vector code after it (the
 * unpacking of the next group): at one row 98 ns a group and tile on one core, against 77 on
 * AVX-512. Here R groups share the C tiles (groups_shared: 8 for one or two rows, 2 for
 * eight): group g's TDPBF16PS takes an A tile of R M rows whose rows (g % R) M .. + M - 1 hold
 * x's M rows over the group's columns and whose other rows are zero, so that those rows of C
 * get exactly the sums a C tile of the group alone would (the other groups' multiplies add
 * zero products to them), and C is stored once every R groups: one row about 80 ns, and 2 and
 * 4 rows' matmuls 0.8x the time of one group to a C tile. The epilogue then takes the groups
 * in order, so every output has the same bits either way.
 *
 * The A tiles come from a thread's buffer of 64-byte cells for each row count M: x's M rows
 * of group g in cells (R - 1) M + g R M .. + M - 1, zeros in the (R - 1) M cells between, so
 * the A tile from cell (R - 1) M + g R M - (g % R) M has them in rows (g % R) M .. alone. The
 * zeros are written once, when a buffer grows; a call writes its groups' cells. */
#define ROW_GROUPS 8 /* groups a C tile takes at most */
#define GROUP_ROWS 8 /* rows of x that take this path at most (one group to a C beyond) */

/* groups sharing the C tiles for M rows of x: as many as fill AMX_ROWS rows, up to 8 */
static inline int64_t groups_shared(int64_t M) {
    return AMX_ROWS / M < ROW_GROUPS ? AMX_ROWS / M : ROW_GROUPS;
}

static __thread uint16_t *row_cells[GROUP_ROWS]; /* [M - 1]: the buffer above, bf16 [][32] */
static __thread int64_t row_cells_groups[GROUP_ROWS]; /* the groups each has room for */

/* The calling thread's buffer for M rows with x's groups in place, or NULL if out of memory */
static const uint16_t *row_groups(const uint16_t *x, int64_t M, int64_t K, int64_t ldx,
                                  int64_t groups) {
    const int64_t R = groups_shared(M);
    if (row_cells_groups[M - 1] < groups) {
        const size_t bytes = (size_t)((groups + 1) * R * M * 64);
        uint16_t *cells = aligned_alloc(64, bytes);
        if (!cells) return NULL;
        memset(cells, 0, bytes);
        free(row_cells[M - 1]);
        row_cells[M - 1] = cells;
        row_cells_groups[M - 1] = groups;
    }
    uint16_t *cells = row_cells[M - 1];
    for (int64_t g = 0; g < groups; g++) {
        const int64_t kx = g * GROUP - (g * GROUP >= K ? K : 0); /* plane 1 reads x again */
        for (int64_t m = 0; m < M; m++)
            memcpy(cells + ((R - 1) * M + g * R * M + m) * 32, x + m * ldx + kx, 64);
    }
    return cells;
}

/* One 64-row tile (its codes at `tile`, its rows from row0) for M <= AMX_ROWS rows of x, R
 * groups to a C tile: with `cells` (row_groups' buffer for these M rows), R = groups_shared(M);
 * without, R = 1 and the A tiles are x's rows themselves (ldx apart; plane 1 reads x again).
 * xs: the rows' group sums ([M][groups]); y: their outputs, ldy apart. */
static void tile_sums(const uint8_t *tile, int64_t row0, const uint16_t *x, int64_t ldx,
                      int64_t K, const uint16_t *cells, int64_t M, int64_t R, const Scales *sz,
                      int64_t N, int64_t groups, const float *xs, uint16_t *y, int64_t ldy) {
    uint16_t bt[2][4][16][32] __attribute__((aligned(64))); /* two groups' B tiles */
    float ct[4][AMX_ROWS][16] __attribute__((aligned(64)));
    float acc[AMX_ROWS][TILE] __attribute__((aligned(64)));
    int4_amx_config(R * M);
    memset(acc, 0, sizeof(float) * (size_t)(M * TILE));
    for (int64_t g0 = 0; g0 < groups; g0 += R) {
        const int64_t ng = groups - g0 < R ? groups - g0 : R;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t j = 0; j < ng; j++) {
            const int64_t g = g0 + j, kx = g * GROUP - (g * GROUP >= K ? K : 0);
            uint16_t(*b)[16][32] = bt[j % 2];
            unpack_group(tile + g * GROUP * 32, b);
            if (cells)
                _tile_loadd(4, cells + ((R - 1) * M + g * R * M - j * M) * 32, 64);
            else
                _tile_loadd(4, x + kx, ldx * 2);
            group_products(b);
        }
        store_sums(ct);
        for (int64_t j = 0; j < ng; j++)
            add_group(sz, g0 + j, row0, M, xs + g0 + j, groups, ct, j * M, acc[0]);
    }
    const int64_t rows = N - row0 < TILE ? N - row0 : TILE;
    for (int64_t m = 0; m < M; m++)
        for (int64_t r = 0; r < rows; r += 16)
            store_floats_bf16(acc[m] + r, y + m * ldy + row0 + r, rows - r);
}

/* Tiles u0 .. u1 - 1 for the M rows of x (operands of int4_mm_amx): with `cells` (M <=
 * GROUP_ROWS), groups_shared(M) groups to a C tile; else blocks of AMX_ROWS rows, each
 * group's sums stored after it */
static void amx_tiles(const uint16_t *x, int64_t M, int64_t K, int64_t ldx,
                      const uint16_t *cells, const uint8_t *packed, const Scales *sz, int64_t N,
                      int64_t groups, const float *xsum, uint16_t *y, int64_t ldy, int64_t u0,
                      int64_t u1) {
    const int64_t tile_bytes = groups * GROUP * 32;
    for (int64_t t = u0; t < u1; t++) {
        const uint8_t *tile = packed + t * tile_bytes;
        if (cells) {
            tile_sums(tile, t * TILE, x, ldx, K, cells, M, groups_shared(M), sz, N, groups,
                      xsum, y, ldy);
            continue;
        }
        for (int64_t m0 = 0; m0 < M; m0 += AMX_ROWS)
            tile_sums(tile, t * TILE, x + m0 * ldx, ldx, K, NULL,
                      M - m0 < AMX_ROWS ? M - m0 : AMX_ROWS, 1, sz, N, groups,
                      xsum + m0 * groups, y + m0 * ldy, ldy);
    }
}

/* Thread id's tiles among nth (share_next with the team's `ranges`) */
static void amx_share(const uint16_t *x, int64_t M, int64_t K, int64_t ldx,
                      const uint8_t *packed, const Scales *sz, int64_t N, int64_t n_pad,
                      int64_t groups, const float *xsum, uint16_t *y, int64_t ldy,
                      int64_t *ranges, int64_t nth, int64_t id, int held) {
    Share share = share_of(ranges, n_pad / TILE, 1, nth, id);
    int64_t u0, u1;
    /* up to 8 rows: their groups in the rows of C where the buffer can be had (else one
     * group to a C tile: the same bits) */
    const uint16_t *cells = M <= GROUP_ROWS ? row_groups(x, M, K, ldx, groups) : NULL;
    while (share_next(&share, &u0, &u1))
        amx_tiles(x, M, K, ldx, cells, packed, sz, N, groups, xsum, y, ldy, u0, u1);
    if (!held) int4_tiles_release();
}

void int4_mm_amx(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *packed,
                 const Scales *sz, int64_t N, int64_t n_pad, int64_t groups, const float *xsum,
                 uint16_t *y, int64_t ldy, int64_t *claim) {
    SHARE_OWN(own, claim);
    int64_t *ranges = share_ranges(claim, own);
    const int held = in_team(); /* a team's step: its tiles stay configured (tile_rows) */
    TEAM_RUN(nth, id, amx_share(x, M, K, ldx, packed, sz, N, n_pad, groups, xsum, y, ldy,
                                ranges, nth, id, held));
}

/* ---- int4_gemm: x @ W^T for a prompt's rows without a dequantized W^T ----
 *
 * Per 64-row weight tile, its bf16 weights -- the same values int4_dequant_t writes, rounded
 * once -- go to a per-thread buffer in the pair layout TDPBF16PS takes as B (16 columns n by
 * 16 pairs (k, k+1): bt[r][k / 2][n - 16 r][2], 72 KB for K = 576), and then every 16-row
 * block of x runs the whole K against it: four C tiles of 16 x 16 fp32 sums, rounded to bf16
 * once at the end. What this saves against dequantizing W^T and calling PyTorch's matmul is
 * the W^T, the matmul library's reordered copy of it and, with `gated`, the [M, 2 I] gate/up
 * product (7-8 MB at 512 tokens of the default model). A row's sums do not depend on the other
 * rows of the batch. */

/* tile t's weights in the pair layout above */
static void tile_pairs(const uint8_t *packed, const Scales *sz, int64_t K, int64_t gs,
                       int64_t planes, const uint16_t *lut, int64_t t, uint16_t *bt) {
    /* vpermt2w indices: bf16 j of a goes to 2j, of b to 2j + 1 */
    static const uint16_t inter_idx[32] __attribute__((aligned(64))) = {
        0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
        8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    const __m512i idx = _mm512_load_si512(inter_idx);
    const __m512 lutf = codebook_f32(lut);
    const float bias = lut ? 0.0f : 8.0f;
    const uint8_t *tile = packed + t * planes * K * 32;
    for (int64_t g = 0; g < K / gs; g++) {
        __m512 sc[2][4], zz[2][4], w0[4], w1[4];
        tile_group_scales(sz, K, gs, planes, t, g, bias, sc, zz);
        for (int64_t k = g * gs; k < (g + 1) * gs; k += 2) {
            tile_column(tile, K, planes, k, lut, lutf, sc, zz, w0);
            tile_column(tile, K, planes, k + 1, lut, lutf, sc, zz, w1);
            for (int r = 0; r < 4; r++) {
                const __m512i a = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(w0[r]));
                const __m512i b = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(w1[r]));
                _mm512_store_si512(bt + (r * (K / 2) + k / 2) * 32,
                                   _mm512_permutex2var_epi16(a, idx, b));
            }
        }
    }
}

/* ct[r][m][16] = sum_k x[m0 + m, k] w[16 r + j, k] for the mr (<= 16) rows of a block, all of
 * K (a multiple of 32), against a tile's pair buffer. The tiles must be configured for mr. */
static inline void tile_block(const uint16_t *x, int64_t ldx, int64_t K, const uint16_t *bt,
                              float ct[4][AMX_ROWS][16]) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kc = 0; kc < K / 32; kc++) {
        const uint16_t *b = bt + kc * 16 * 32;
        _tile_loadd(4, x + kc * 32, ldx * 2);
        _tile_loadd(5, b, 64);
        _tile_loadd(6, b + (K / 2) * 32, 64);
        _tile_loadd(7, b + 2 * (K / 2) * 32, 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_dpbf16ps(1, 4, 6);
        _tile_dpbf16ps(2, 4, 7);
        _tile_loadd(5, b + 3 * (K / 2) * 32, 64);
        _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, ct[0], 64);
    _tile_stored(1, ct[1], 64);
    _tile_stored(2, ct[2], 64);
    _tile_stored(3, ct[3], 64);
}

/* rounds the 64 sums of row m of a block to bf16 at dst (n valid values) */
static inline void store_block_row(float ct[4][AMX_ROWS][16], int64_t m, uint16_t *dst,
                                   int64_t n) {
    for (int r = 0; r < 4 && 16 * r < n; r++)
        store_floats_bf16(ct[r][m], dst + 16 * r, n - 16 * r);
}

/* y = x @ W^T (bf16 [M][ldy], N columns) for a packed weight, or with `gated` (W stacks gate
 * and up, N = 2 I rows, I a multiple of 64): y = silu(x Wg^T) * (x Wu^T), [M][ldy], I columns,
 * each product rounded to bf16 before the activation as in silu_mul. Call int4_gemm_ready
 * first. Returns 0, -1 if out of memory, -2 for another group size. */
int int4_gemm(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *packed,
              const uint16_t *sz_p, int64_t N, int64_t n_pad, int64_t planes, uint16_t *y,
              int64_t ldy, int64_t gs, const uint16_t *lut, int64_t scales_form,
              int64_t gated) {
    if (gs != 32 && gs != 16) return -2;
    const Scales scales = scales_of(sz_p, n_pad, K, gs, planes, scales_form), *sz = &scales;
    const int64_t inter = N / 2, units = gated ? inter / TILE : n_pad / TILE;
    int failed = 0;
#pragma omp parallel
    {
        const size_t pair_bytes = sizeof(uint16_t) * (size_t)(K * TILE);
        uint16_t *bt = aligned_alloc(64, pair_bytes * (gated ? 2 : 1));
        /* gated: the tile's gate products in gu[m][0..63], up in gu[m][64..127], all rows */
        uint16_t *gu = gated ? malloc(sizeof(uint16_t) * (size_t)(M * 2 * TILE)) : NULL;
        float ct[4][AMX_ROWS][16] __attribute__((aligned(64)));
        if (!bt || (gated && !gu)) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
#pragma omp for schedule(static)
            for (int64_t u = 0; u < units; u++) {
                tile_pairs(packed, sz, K, gs, planes, lut, u, bt);
                if (gated)
                    tile_pairs(packed, sz, K, gs, planes, lut, inter / TILE + u,
                               bt + pair_bytes / sizeof(uint16_t));
                for (int64_t m0 = 0; m0 < M; m0 += AMX_ROWS) {
                    const int64_t mr = M - m0 < AMX_ROWS ? M - m0 : AMX_ROWS;
                    int4_amx_config(mr);
                    const uint16_t *xb = x + m0 * ldx;
                    tile_block(xb, ldx, K, bt, ct);
                    if (!gated) {
                        const int64_t n0 = u * TILE, n = N - n0 < TILE ? N - n0 : TILE;
                        for (int64_t m = 0; m < mr; m++)
                            store_block_row(ct, m, y + (m0 + m) * ldy + n0, n);
                        continue;
                    }
                    uint16_t *gm = gu + m0 * 2 * TILE;
                    for (int64_t m = 0; m < mr; m++) store_block_row(ct, m, gm + m * 2 * TILE, TILE);
                    tile_block(xb, ldx, K, bt + pair_bytes / sizeof(uint16_t), ct);
                    for (int64_t m = 0; m < mr; m++)
                        store_block_row(ct, m, gm + m * 2 * TILE + TILE, TILE);
                }
                /* the activation after the tile's AMX work: switching between tile and vector
                 * code per 16-row block cost 20% more */
                for (int64_t m = 0; gated && m < M; m++)
                    silu_mul_row(gu + m * 2 * TILE, TILE, y + m * ldy + u * TILE);
            }
        }
        int4_tiles_release();
        free(bt);
        free(gu);
    }
    return failed ? -1 : 0;
}
