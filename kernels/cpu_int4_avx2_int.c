/* The integer path of the AVX2 build's int4 matmul (AVX2 + FMA + F16C): weights without a
 * codebook, on the packed layout and formula of cpu_int4.h. Each group of gs columns of a row
 * of x is rounded to 16-bit integers v on a power-of-two scale xs (round_group: every value
 * within 2^7 of the group's largest keeps all its bits, smaller ones round to a multiple of xs,
 * below 2^-15 of the largest), and per group and output row
 *     A = sum_k v[k] c[n, k]   (dot_pairs: exact in int32),  a = A xs,  sxr = xs sum_k v[k]
 *     sum_k x (c - 8) s + z x  =  s a + (z - 8 s) sxr
 * then y = fma(s, a, y), y = fma(zz, sxr, y), group by group. On Zen 2 a 16-bit product pair
 * costs what one fp32 FMA does (one vpmaddwd a cycle, two FMAs), and the codes need no
 * conversion to fp32 (one vcvtdq2ps a cycle bound the fp32 path): a one-row matmul takes about
 * 0.6 of the time it did in fp32 FMAs; with AVX-VNNI (the avx2_vnni build) one vpdpwssd
 * replaces vpmaddwd and vpaddd. dot_pairs multiplies each code's whole byte (lo + 16 hi)
 * and its high nibble; the low nibble's sum is the difference. The integer sums are exact and
 * the rest runs the same operations in the same order whatever M is, so a row gets bitwise the
 * same result alone or in a batch.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_int4_avx2.h"
#include "cpu_int4_groups.h"
#include "cpu_int4_xint.h"
#include "cpu_team.h"
#include "cpu_simd_avx2.h"

/* The integer sums are in the W order of a tile's rows (cpu_int4_avx2.h). A column pair
 * (k, k+1), 32 bytes each, becomes for vector q < 4 the words (byte of column k, byte of column k+1) of those rows, one row a
 * 32-bit lane (in-lane unpacks): a word's low nibble is a code of vector q, its high one of
 * vector q + 4. */
static inline __m256i pair_words(__m256i ck, __m256i ck1, const int q) {
    const __m256i p = q >> 1 ? _mm256_unpackhi_epi8(ck, ck1) : _mm256_unpacklo_epi8(ck, ck1);
    return q & 1 ? _mm256_unpackhi_epi8(p, _mm256_setzero_si256())
                 : _mm256_unpacklo_epi8(p, _mm256_setzero_si256());
}

/* A[(r * 2 + h) * Q + i] (int32, W order vector q + 4 h, q = q0 + i, i < Q) = the sum over the
 * group's columns k of v[k] c[row, k], exact, for R rows of x at vg (ldv apart): each column
 * pair decoded once for the R rows. Q = 2 (one row: q0 = 0 or 2, a pair's first unpack shared)
 * or 1 (2-4 rows); at most 8 sums, so that they stay in registers with what decodes the codes
 * (in an array of 16, GCC kept them in memory). */
static inline __attribute__((always_inline)) void rows_int(const uint8_t *gcols,
                                                           const int16_t *vg, int64_t ldv,
                                                           const int GS, const int R,
                                                           const int q0, const int Q,
                                                           __m256i A[8]) {
    __m256i a[8];
#pragma GCC unroll 8
    for (int j = 0; j < 2 * R * Q; j++) a[j] = _mm256_setzero_si256();
    /* by 2: unrolled whole, GCC reordered the sums and kept some of them in memory */
#pragma GCC unroll 2
    for (int kp = 0; kp < GS / 2; kp++) {
        const __m256i ck = _mm256_loadu_si256((const __m256i *)(gcols + 64 * kp));
        const __m256i ck1 = _mm256_loadu_si256((const __m256i *)(gcols + 64 * kp + 32));
        __m256i wb[2], wh[2]; /* the whole bytes lo + 16 hi, and hi */
#pragma GCC unroll 2
        for (int i = 0; i < Q; i++) {
            wb[i] = pair_words(ck, ck1, q0 + i);
            wh[i] = _mm256_srli_epi16(wb[i], 4); /* a word's high byte is 0 */
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            int32_t pair;
            __builtin_memcpy(&pair, vg + r * ldv + 2 * kp, 4);
            const __m256i xv = _mm256_set1_epi32(pair);
#pragma GCC unroll 2
            for (int i = 0; i < Q; i++) {
                a[2 * r * Q + i] = dot_pairs(a[2 * r * Q + i], wb[i], xv);
                a[(2 * r + 1) * Q + i] = dot_pairs(a[(2 * r + 1) * Q + i], wh[i], xv);
            }
        }
    }
    /* the low nibbles' sums: the whole bytes' less 16 times the high ones' (exact: a pair of
     * products is below 2^24, a group's 16 pairs below 2^28) */
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 2
        for (int i = 0; i < Q; i++) {
            A[2 * r * Q + i] = _mm256_sub_epi32(a[2 * r * Q + i],
                                                _mm256_slli_epi32(a[(2 * r + 1) * Q + i], 4));
            A[(2 * r + 1) * Q + i] = a[(2 * r + 1) * Q + i];
        }
}

/* y[j] (fp32 [8], W order) of one row of x += its group: a = A xs, y = fma(s, a, y), then
 * y = fma(zz, sxr, y) */
static inline void update_int(__m256i A, const int j, const __m256 sc[8], const __m256 zz[8],
                              float xs, float sxr, float *y) {
    const __m256 a = _mm256_mul_ps(_mm256_cvtepi32_ps(A), _mm256_set1_ps(xs));
    const __m256 t = _mm256_fmadd_ps(sc[j], a, _mm256_load_ps(y + 8 * j));
    _mm256_store_ps(y + 8 * j, _mm256_fmadd_ps(zz[j], _mm256_set1_ps(sxr), t));
}

/* One block of rows_int and its update_int: R rows of x (their v at vg, ldv apart; xs and
 * sxr a row apart by xstride; y at out, TILE apart), vectors q0 .. q0 + Q - 1 and 4 more of the
 * W order */
#define BLOCK_ARGS                                                                             \
    const uint8_t *gcols, const int16_t *vg, int64_t ldv, const __m256 *sc, const __m256 *zz,  \
        const float *xs, const float *sxr, int64_t xstride, float *out
static inline __attribute__((always_inline)) void block_int(BLOCK_ARGS, const int GS,
                                                            const int R, const int q0,
                                                            const int Q) {
    __m256i A[8];
    rows_int(gcols, vg, ldv, GS, R, q0, Q, A);
    for (int r = 0; r < R; r++)
        for (int h = 0; h < 2; h++)
            for (int i = 0; i < Q; i++)
                update_int(A[(2 * r + h) * Q + i], q0 + i + 4 * h, sc, zz, xs[r * xstride],
                           sxr[r * xstride], out + r * TILE);
}

/* block_int as a function of its own for each shape (the batches' blocks), so that GCC
 * allocates the registers of each alone: in one function it kept the sums of the later blocks
 * in memory */
typedef void (*IntBlock)(BLOCK_ARGS);
#define INT_BLOCK(GS, R, q0, Q)                                                                \
    static __attribute__((noinline)) void int_block_##GS##_##R##_##q0##_##Q(BLOCK_ARGS) {      \
        block_int(gcols, vg, ldv, sc, zz, xs, sxr, xstride, out, GS, R, q0, Q);                \
    }
#define INT_BLOCKS(GS)                                                                         \
    INT_BLOCK(GS, 1, 0, 2)                                                                     \
    INT_BLOCK(GS, 1, 2, 2)                                                                     \
    INT_BLOCK(GS, 2, 0, 1) INT_BLOCK(GS, 2, 1, 1) INT_BLOCK(GS, 2, 2, 1) INT_BLOCK(GS, 2, 3, 1) \
    INT_BLOCK(GS, 3, 0, 1) INT_BLOCK(GS, 3, 1, 1) INT_BLOCK(GS, 3, 2, 1) INT_BLOCK(GS, 3, 3, 1) \
    INT_BLOCK(GS, 4, 0, 1) INT_BLOCK(GS, 4, 1, 1) INT_BLOCK(GS, 4, 2, 1) INT_BLOCK(GS, 4, 3, 1) \
    /* [rows - 1]: the blocks that cover all 64 rows of the tile */                            \
    static const IntBlock INT_BLOCKS_##GS[4][4] = {                                            \
        {int_block_##GS##_1_0_2, int_block_##GS##_1_2_2, NULL, NULL},                          \
        {int_block_##GS##_2_0_1, int_block_##GS##_2_1_1, int_block_##GS##_2_2_1,               \
         int_block_##GS##_2_3_1},                                                              \
        {int_block_##GS##_3_0_1, int_block_##GS##_3_1_1, int_block_##GS##_3_2_1,               \
         int_block_##GS##_3_3_1},                                                              \
        {int_block_##GS##_4_0_1, int_block_##GS##_4_1_1, int_block_##GS##_4_2_1,               \
         int_block_##GS##_4_3_1}};
INT_BLOCKS(32)
INT_BLOCKS(16)
#undef INT_BLOCKS
#undef INT_BLOCK

/* tile t (64 output rows) for the M rows of x, CHUNK_ROWS at a time, on the integer path: per
 * group and row of x the sums A are exact integers, then update_int, group by group, whatever
 * M is, so that a row's result is bitwise the same alone or in a batch */
static inline __attribute__((always_inline)) void tile8_int(
    const IntRows *xr, int64_t M, int64_t K, const uint8_t *packed, const Scales *sz,
    int64_t N, int64_t K2, uint16_t *y, int64_t ldy, int64_t t, const int GS) {
    const int64_t groups = K2 / GS, per_plane = K / GS, tile_bytes = K2 * 32;
    float out[CHUNK_ROWS * TILE] __attribute__((aligned(32))); /* [rows][64], W order */
    const uint8_t *tile = packed + t * tile_bytes;
    for (int64_t m0 = 0; m0 < M; m0 += CHUNK_ROWS) {
        const int64_t mc = M - m0 < CHUNK_ROWS ? M - m0 : CHUNK_ROWS;
        for (int64_t i = 0; i < mc * TILE; i += 8) _mm256_store_ps(out + i, _mm256_setzero_ps());
        for (int64_t g = 0; g < groups; g++) {
            /* the scales come in with no prefetch of their own: prefetching them two groups
             * ahead (into L2) made decode of one sequence take 1.05x as long, 8 streams 1.02x
             * (the hardware's prefetch follows the tiled scales) */
            __m256 sc[8], zz[8];
            const uint16_t *sp = tile_scales(sz, g, t * TILE);
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++)
                sc[j] = group_scales(sz, sp, g, w_row(j), w_row(j) + 16, 8.0f, &zz[j]);
            const uint8_t *gcols = tile + g * GS * 32;
            for (int l = 0; l < GS * 32; l += 64)
                _mm_prefetch((const char *)gcols + PREFETCH_BYTES + l, STREAM_HINT);
            const int64_t gx = g % per_plane; /* plane 1 reads x again */
            const int16_t *vg = xr->v + m0 * K + gx * GS;
            const float *xs = xr->xs + m0 * per_plane + gx, *sxr = xr->sxr + m0 * per_plane + gx;
            if (mc == 1) { /* inline: through the blocks' function pointers it took 1.07x as long */
                block_int(gcols, vg, K, sc, zz, xs, sxr, per_plane, out, GS, 1, 0, 2);
                block_int(gcols, vg, K, sc, zz, xs, sxr, per_plane, out, GS, 1, 2, 2);
                continue;
            }
            const IntBlock(*blocks)[4] = GS == 32 ? INT_BLOCKS_32 : INT_BLOCKS_16;
            for (int64_t r0 = 0; r0 < mc; r0 += 4) {
                const int64_t rows = mc - r0 < 4 ? mc - r0 : 4;
                for (int b = 0; b < 4 && blocks[rows - 1][b]; b++)
                    blocks[rows - 1][b](gcols, vg + r0 * K, K, sc, zz, xs + r0 * per_plane,
                                        sxr + r0 * per_plane, per_plane, out + r0 * TILE);
            }
        }
        const int64_t n0 = t * TILE, rows = N - n0 < TILE ? N - n0 : TILE;
        for (int64_t m = 0; m < mc; m++) {
            /* the permutes of w_order_rows (cpu_int4_avx2.h) written out: through it, GCC's
             * registers for the whole tile loop changed and decode of one sequence took
             * 1.045-1.061x as long (Zen 2) */
            const float *o = out + m * TILE;
            for (int h = 0; h < 2; h++) { /* W order -> rows in order: 32 rows a half */
                const __m256 w0 = _mm256_load_ps(o + 32 * h), w1 = _mm256_load_ps(o + 32 * h + 8);
                const __m256 w2 = _mm256_load_ps(o + 32 * h + 16);
                const __m256 w3 = _mm256_load_ps(o + 32 * h + 24);
                const __m256 n[4] = {_mm256_permute2f128_ps(w0, w1, 0x20),
                                     _mm256_permute2f128_ps(w2, w3, 0x20),
                                     _mm256_permute2f128_ps(w0, w1, 0x31),
                                     _mm256_permute2f128_ps(w2, w3, 0x31)};
                for (int i = 0; i < 4; i++) {
                    const int64_t r = 32 * h + 8 * i;
                    if (r < rows)
                        store_bf16_n(y + (m0 + m) * ldy + n0 + r, n[i], rows - r);
                }
            }
        }
    }
}

/* Thread id's tiles among nth (cpu_team.h's shares, as tile_share8 in cpu_int4_avx2.c); the
 * group size switches inside the loop, so that each inlined copy of tile8_int is compiled with
 * it as a constant */
static __attribute__((noinline)) void tile_share_int(
    const IntRows *xr, int64_t M, int64_t K, const uint8_t *packed, const Scales *sz, int64_t N,
    int64_t n_pad, int64_t K2, uint16_t *y, int64_t ldy, int64_t gs, int64_t *ranges,
    int64_t nth, int64_t id) {
    Share share = share_of(ranges, n_pad / TILE, 1, nth, id);
    int64_t t0, t1;
    while (share_next(&share, &t0, &t1)) {
        for (int64_t t = t0; t < t1; t++) {
            if (gs == 32)
                tile8_int(xr, M, K, packed, sz, N, K2, y, ldy, t, 32);
            else
                tile8_int(xr, M, K, packed, sz, N, K2, y, ldy, t, 16);
        }
    }
}

/* int4_mm_int of cpu_int4_avx2.h: x rounded, a slab of rows at a time outside a team (a team's
 * call, a decode step's few rows, in one) */
int int4_mm_int(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *packed,
                const Scales *sz, int64_t N, int64_t n_pad, int64_t K2, uint16_t *y, int64_t ldy,
                int64_t gs, int64_t *claim) {
    /* the tiles split over the calling team (cpu_team.h) or over a team of their own */
    SHARE_OWN(own, claim);
    int64_t *ranges = share_ranges(claim, own);
    unsigned char room[INT_ROOM] __attribute__((aligned(32)));
    const int64_t slab = claim || in_team() ? M : int_slab_rows(K, gs);
    const size_t bytes = int_rows_bytes(M < slab ? M : slab, K, gs);
    void *mem = int_rows_memory(bytes, room);
    if (!mem) return -1;
    for (int64_t m0 = 0; m0 < M; m0 += slab) {
        const int64_t ms = M - m0 < slab ? M - m0 : slab;
        IntRows xr;
        round_rows_int(x + m0 * ldx, ms, K, ldx, gs, mem, 0, &xr);
        if (m0 && ranges == own) memset(own, 0, sizeof(int64_t) * (size_t)(own_n * SHARE_LINE));
        TEAM_RUN(nth, id, tile_share_int(&xr, ms, K, packed, sz, N, n_pad, K2, y + m0 * ldy,
                                         ldy, gs, ranges, nth, id));
    }
    return 0;
}
