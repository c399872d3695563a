/* The int4 weight-only matmul and dequantization of the AVX2 build (AVX2 + FMA + F16C), on
 * the packed layout and formula of cpu_int4.h, and the AMX entry points as "not here" stubs.
 * There is no bf16 dot product here; a weight takes one of two paths. Codes without a codebook
 * take integer products (cpu_int4_avx2_int.c). Codes through a codebook, here, take fp32
 * products.
 *
 * The fp32 path: each code becomes its fp32 value (the codebook's hi + lo) and x (bf16, widened
 * exactly) multiplies it in fp32 FMAs. With a = sum_k x[k] lut[c[n, k]] and sx = sum of x:
 * y = fma(s, a, y), y = fma(z, sx, y), group by group, a summed from 0 over the group's columns
 * in order. For M > 1, blocks of up to 4 rows of x by 2 vectors of the tile keep their sums in
 * registers (`rows_block`). Every output row n of every row m of x is computed by the same
 * operations in the same order whatever M is, so a row gets bitwise the same result alone or
 * in a batch.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu_int4_avx2.h"
#include "cpu_int4_groups.h"
#include "cpu_kernels.h"
#include "cpu_team.h"
#include "cpu_simd_avx2.h"

/* the fp32 value of the codes in each lane: c itself, or lut[c] (lut0: entries 0-7, lut1:
 * 8-15) */
static inline __m256 code_values(__m256i c, const int USE_LUT, __m256 lut0, __m256 lut1) {
    if (!USE_LUT) return _mm256_cvtepi32_ps(c);
    const __m256 a = _mm256_permutevar8x32_ps(lut0, c), b = _mm256_permutevar8x32_ps(lut1, c);
    return _mm256_blendv_ps(a, b, _mm256_castsi256_ps(_mm256_slli_epi32(c, 28)));
}

/* column k of a 64-row tile (32 bytes at col) -> w[i], rows 8i..8i+7, fp32 */
static inline __attribute__((always_inline)) void column8(const uint8_t *col, __m256 w[8],
                                                          const int USE_LUT, __m256 lut0,
                                                          __m256 lut1) {
    for (int q = 0; q < 4; q++) {
        const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(col + 8 * q)));
        w[q] = code_values(_mm256_and_si256(b, _mm256_set1_epi32(0x0F)), USE_LUT, lut0, lut1);
        w[4 + q] = code_values(_mm256_srli_epi32(b, 4), USE_LUT, lut0, lut1);
    }
}

/* ---- The fp32 path: codes through a codebook ---- */

/* vector v of the tile (rows 8v..8v+7) in column k of a group, through the codebook: the low
 * nibbles of bytes 8v..8v+7 for v < 4, else the high nibbles of bytes 8(v-4).. (cpu_int4.h's
 * layout) */
static inline __attribute__((always_inline)) __m256 column_vector(const uint8_t *col,
                                                                  const int v, __m256 lut0,
                                                                  __m256 lut1) {
    const __m128i bytes = _mm_loadl_epi64((const __m128i *)(col + 8 * (v & 3)));
    const __m256i b = _mm256_cvtepu8_epi32(bytes);
    /* the low nibble by two shifts: no mask constant to hold in a register */
    const __m256i c = v < 4 ? _mm256_srli_epi32(_mm256_slli_epi32(b, 28), 28)
                            : _mm256_srli_epi32(b, 4);
    return code_values(c, 1, lut0, lut1);
}

/* y (fp32 [64], running) += group g of one 64-row tile for one row of x: a in registers,
 * columns decoded on the fly */
static inline __attribute__((always_inline)) void group_row(
    const uint8_t *gcols, const uint16_t *xg, const __m256 sc[8], const __m256 zz[8], float sx,
    float *y, const int GS, __m256 lut0, __m256 lut1) {
    __m256 a[8];
    for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
    for (int k = 0; k < GS; k++) {
        uint32_t bits = (uint32_t)xg[k] << 16;
        float xf;
        __builtin_memcpy(&xf, &bits, 4);
        const __m256 xk = _mm256_set1_ps(xf);
        __m256 w[8];
        column8(gcols + k * 32, w, 1, lut0, lut1);
        for (int i = 0; i < 8; i++) a[i] = _mm256_fmadd_ps(xk, w[i], a[i]);
    }
    const __m256 sxv = _mm256_set1_ps(sx);
    for (int i = 0; i < 8; i++) {
        __m256 v = _mm256_fmadd_ps(sc[i], a[i], _mm256_loadu_ps(y + 8 * i));
        _mm256_storeu_ps(y + 8 * i, _mm256_fmadd_ps(zz[i], sxv, v));
    }
}

/* rows r0..r0+R-1 (R <= 4) of a chunk, the V (<= 3) vectors v[] of the tile, one group of GS
 * columns: codes decoded in registers (a vector pair v, v + 4 shares its bytes), the R x V sums
 * in registers, then each row's y (fp32 [64] at out + r * 64) updated as group_row does. The
 * same operations in the same order as group_row, so the same bits. */
static inline __attribute__((always_inline)) void rows_block(
    const uint8_t *gcols, const float *xb, int r0, const __m256 sc[8], const __m256 zz[8],
    const float *xs, int64_t xs_stride, float *out, const int GS, const int R, const int V,
    const int va, const int vb, const int vc, __m256 lut0, __m256 lut1) {
    const int vs[3] = {va, vb, vc};
    __m256 acc[4][3];
#pragma GCC unroll 4
    for (int r = 0; r < 4; r++)
#pragma GCC unroll 3
        for (int j = 0; j < 3; j++) acc[r][j] = _mm256_setzero_ps();
    const float *xr = xb + r0 * 32;
    for (int k = 0; k < GS; k++) {
        __m256 w[3];
#pragma GCC unroll 3
        for (int j = 0; j < V; j++)
            w[j] = column_vector(gcols + k * 32, vs[j], lut0, lut1);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const __m256 xk = _mm256_broadcast_ss(xr + 32 * r + k);
#pragma GCC unroll 3
            for (int j = 0; j < V; j++) acc[r][j] = _mm256_fmadd_ps(xk, w[j], acc[r][j]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        const __m256 sxv = _mm256_set1_ps(xs[(r0 + r) * xs_stride]);
        float *y = out + (r0 + r) * TILE;
#pragma GCC unroll 3
        for (int j = 0; j < V; j++) {
            const int i = vs[j];
            const __m256 t = _mm256_fmadd_ps(sc[i], acc[r][j], _mm256_loadu_ps(y + 8 * i));
            _mm256_storeu_ps(y + 8 * i, _mm256_fmadd_ps(zz[i], sxv, t));
        }
    }
}

/* rows r0..r0+R-1 of a chunk through rows_block: the tile's 8 vectors in 4 pairs (a
 * codebook's two halves take two registers) */
#define ROWS_BLOCKS(R)                                                                         \
    for (int p = 0; p < 4; p++)                                                                \
    rows_block(gcols, xb, r0, sc, zz, xs, xs_stride, out, GS, R, 2, p, p + 4, 0, lut0, lut1)

/* every row of a chunk of mc rows (2..8): blocks of 4 rows, the last of 1-3 */
static inline __attribute__((always_inline)) void chunk_rows(
    const uint8_t *gcols, const float *xb, int64_t mc, const __m256 sc[8], const __m256 zz[8],
    const float *xs, int64_t xs_stride, float *out, const int GS, __m256 lut0, __m256 lut1) {
    for (int r0 = 0; r0 < mc; r0 += 4) {
        const int64_t left = mc - r0;
        if (left >= 4)
            ROWS_BLOCKS(4);
        else if (left == 3)
            ROWS_BLOCKS(3);
        else if (left == 2)
            ROWS_BLOCKS(2);
        else
            ROWS_BLOCKS(1);
    }
}
#undef ROWS_BLOCKS


/* tile t (64 output rows) for the M rows of x, CHUNK_ROWS at a time, on the fp32 path */
static inline __attribute__((always_inline)) void tile8(
    const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *packed,
    const Scales *sz, int64_t N, int64_t K2, const float *xsum, uint16_t *y, int64_t ldy,
    int64_t t, const int GS, __m256 lut0, __m256 lut1) {
    const int64_t groups = K2 / GS, tile_bytes = K2 * 32;
    float out[CHUNK_ROWS * TILE] __attribute__((aligned(32))); /* [rows][64] running sums */
    float xb[CHUNK_ROWS * 32] __attribute__((aligned(32))); /* [rows][GS] x of a group */
    const uint8_t *tile = packed + t * tile_bytes;
    for (int64_t m0 = 0; m0 < M; m0 += CHUNK_ROWS) {
        const int64_t mc = M - m0 < CHUNK_ROWS ? M - m0 : CHUNK_ROWS;
        for (int64_t i = 0; i < mc * TILE; i += 8) _mm256_store_ps(out + i, _mm256_setzero_ps());
        for (int64_t g = 0; g < groups; g++) {
            __m256 sc[8], zz[8];
            const uint16_t *sp = tile_scales(sz, g, t * TILE);
            for (int i = 0; i < 8; i++)
                sc[i] = group_scales(sz, sp, g, 8 * i, 8 * i + 4, 0.0f, &zz[i]);
            const uint8_t *gcols = tile + g * GS * 32;
            for (int l = 0; l < GS * 32; l += 64)
                _mm_prefetch((const char *)gcols + PREFETCH_BYTES + l, STREAM_HINT);
            const int64_t kx = g * GS - (g * GS >= K ? K : 0); /* plane 1 reads x again */
            const float *xs = xsum + m0 * groups + g;
            if (mc == 1) {
                group_row(gcols, x + m0 * ldx + kx, sc, zz, xs[0], out, GS, lut0, lut1);
                continue;
            }
            for (int64_t m = 0; m < mc; m++) /* the group's x in fp32, exactly */
                for (int k = 0; k < GS; k += 8)
                    _mm256_store_ps(xb + m * 32 + k, load8_bf16(x + (m0 + m) * ldx + kx + k));
            chunk_rows(gcols, xb, mc, sc, zz, xs, groups, out, GS, lut0, lut1);
        }
        const int64_t n0 = t * TILE, rows = N - n0 < TILE ? N - n0 : TILE;
        for (int64_t m = 0; m < mc; m++)
            for (int64_t r = 0; r < rows; r += 8)
                store_bf16_n(y + (m0 + m) * ldy + n0 + r, _mm256_load_ps(out + m * TILE + r),
                             rows - r);
    }
}

/* Thread id's tiles among nth (int4_mm's operands): its share, then what it takes of the
 * others' (share_next in cpu_team.h with the team's `ranges`; NULL: its share). The group size
 * switches inside the loop, so that each inlined copy of tile8 is compiled with it as a
 * constant; one copy of the loop for one row and for many (with a copy in each, decode ran 13%
 * slower: in-process A/B, 12 pairs). */
static __attribute__((noinline)) void tile_share8(
    const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *packed,
    const Scales *sz, int64_t N, int64_t n_pad, int64_t K2, const float *xsum, uint16_t *y,
    int64_t ldy, int64_t gs, __m256 lut0, __m256 lut1, int64_t *ranges, int64_t nth,
    int64_t id) {
    Share share = share_of(ranges, n_pad / TILE, 1, nth, id);
    int64_t t0, t1;
    while (share_next(&share, &t0, &t1)) {
        for (int64_t t = t0; t < t1; t++) {
            if (gs == 32)
                tile8(x, M, K, ldx, packed, sz, N, K2, xsum, y, ldy, t, 32, lut0, lut1);
            else
                tile8(x, M, K, ldx, packed, sz, N, K2, xsum, y, ldy, t, 16, lut0, lut1);
        }
    }
}

/* int4_mm_shared of cpu_kernels.h */
int int4_mm_shared(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *packed,
                   const uint16_t *sz_p, int64_t N, int64_t n_pad, int64_t planes, uint16_t *y,
                   int64_t ldy, int64_t gs, const uint16_t *lut, int64_t scales_form,
                   int64_t *claim) {
    if (gs != 32 && gs != 16) return -2;
    const Scales sz = scales_of(sz_p, n_pad, K, gs, planes, scales_form);
    const int64_t K2 = planes * K, groups = K2 / gs;
    if (!lut) return int4_mm_int(x, M, K, ldx, packed, &sz, N, n_pad, K2, y, ldy, gs, claim);
    /* the fp32 path: x's group sums, the fp32 codebook hi + lo */
    float room[XSUM_ROOM];
    float *xsum = x_group_sums(x, M, K, ldx, gs, groups, room);
    if (!xsum) return -1;
    const __m256 lut0 = _mm256_add_ps(load8_bf16(lut), load8_bf16(lut + 16));
    const __m256 lut1 = _mm256_add_ps(load8_bf16(lut + 8), load8_bf16(lut + 24));
    /* the tiles split over the calling team (cpu_team.h) or over a team of their own */
    SHARE_OWN(own, claim);
    int64_t *ranges = share_ranges(claim, own);
    TEAM_RUN(nth, id, tile_share8(x, M, K, ldx, packed, &sz, N, n_pad, K2, xsum, y, ldy, gs,
                                  lut0, lut1, ranges, nth, id));
    if (xsum != room) free(xsum);
    return 0;
}

int int4_mm(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *packed,
            const uint16_t *sz, int64_t N, int64_t n_pad, int64_t planes, uint16_t *y,
            int64_t ldy, int64_t gs, const uint16_t *lut, int64_t scales_form) {
    return int4_mm_shared(x, M, K, ldx, packed, sz, N, n_pad, planes, y, ldy, gs, lut,
                          scales_form, NULL);
}

/* no AMX in this build: prompts take int4_mm (or int4_dequant_t and PyTorch's matmul) */
int int4_mm_tiles(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *packed,
                  const uint16_t *sz, int64_t N, int64_t n_pad, int64_t planes, uint16_t *y,
                  int64_t ldy, int64_t gs, const uint16_t *lut, int64_t scales_form) {
    return int4_mm(x, M, K, ldx, packed, sz, N, n_pad, planes, y, ldy, gs, lut, scales_form);
}

int int4_gemm_ready(void) { return 0; }

int int4_amx_enable(int on) {
    (void)on;
    return 0;
}

void int4_tiles_release(void) {}

int int4_gemm(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *packed,
              const uint16_t *sz, int64_t N, int64_t n_pad, int64_t planes, uint16_t *y,
              int64_t ldy, int64_t gs, const uint16_t *lut, int64_t scales_form,
              int64_t gated) {
    (void)x, (void)M, (void)K, (void)ldx, (void)packed, (void)sz, (void)N, (void)n_pad;
    (void)planes, (void)y, (void)ldy, (void)gs, (void)lut, (void)scales_form, (void)gated;
    return -2;
}

/* int4_dequant_t of cpu_kernels.h: wt[k][n] = the planes' (c - 8) s + z (codebooks lut[c] s
 * + z) summed in fp32, rounded once */
void int4_dequant_t(const uint8_t *packed, const uint16_t *sz_p, int64_t K, int64_t n_pad,
                    int64_t planes, uint16_t *wt, int64_t gs, const uint16_t *lut,
                    int64_t scales_form) {
    const Scales sz = scales_of(sz_p, n_pad, K, gs, planes, scales_form);
    __m256 lut0 = _mm256_setzero_ps(), lut1 = _mm256_setzero_ps();
    if (lut) {
        lut0 = _mm256_add_ps(load8_bf16(lut), load8_bf16(lut + 16));
        lut1 = _mm256_add_ps(load8_bf16(lut + 8), load8_bf16(lut + 24));
    }
    const float bias = lut ? 0.0f : 8.0f;
    const int64_t K2 = planes * K;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < n_pad / TILE; t++) {
        const uint8_t *tile = packed + t * K2 * 32;
        for (int64_t g = 0; g < K / gs; g++) {
            __m256 sc[2][8], zz[2][8];
            for (int64_t p = 0; p < planes; p++) {
                const int64_t gp = p * K / gs + g;
                const uint16_t *sp = tile_scales(&sz, gp, t * TILE);
                for (int i = 0; i < 8; i++)
                    sc[p][i] = group_scales(&sz, sp, gp, 8 * i, 8 * i + 4, bias, &zz[p][i]);
            }
            for (int64_t k = g * gs; k < (g + 1) * gs; k++) {
                __m256 w[8], acc[8];
                for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
                for (int64_t p = 0; p < planes; p++) {
                    if (lut)
                        column8(tile + (p * K + k) * 32, w, 1, lut0, lut1);
                    else
                        column8(tile + (p * K + k) * 32, w, 0, lut0, lut1);
                    for (int i = 0; i < 8; i++) {
                        const __m256 v = _mm256_fmadd_ps(w[i], sc[p][i], zz[p][i]);
                        acc[i] = _mm256_add_ps(acc[i], v); /* 0 + v = v exactly */
                    }
                }
                for (int i = 0; i < 8; i++) store8_bf16(wt + k * n_pad + t * TILE + 8 * i, acc[i]);
            }
        }
    }
}
