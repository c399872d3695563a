/* int8_logits of the AVX2 build (AVX2 + FMA + F16C): the numbers of cpu_int8_logits.c (which
 * describes them) with AVX2's 16-bit integer products (dot_pairs: vpmaddwd and vpaddd, or
 * AVX-VNNI's vpdpwssd in the avx2_vnni build) instead of AVX-512's vpdpwssd.
 *
 * x's rows are rounded as in cpu_int8_rows.h; per group of 32 columns the integer sum
 * A = sum_k u v - corr is exact in int32, then y += float(A) * (s * sx) in fp32, group by
 * group: the same operations in the same order as the AVX-512 build, so both give the same
 * logits, a row alone or in any batch.
 *
 * A column pair's bytes (two nibble planes, cpu_int4.h) become u = 16 h + l for 64 rows, the
 * two columns' bytes of each row interleaved and widened to 16 bits in place (in-lane
 * unpacks), so that the 8 lanes of W[j] hold rows 4j..4j+3 and 16+4j..16+4j+3 of a half tile
 * (rows 32 half + ...): the scales are read and the fp32 sums kept in that order (the W order
 * of cpu_int4_avx2.h), the rows put in order only when a tile's logits are written out.
 *
 * One or two rows of x decode a column pair's words as they use them (tile_rows1, _2); four
 * and more decode a group's words once into L1 and take every row's sums from there
 * (tile_words). Either way a tile is read group by group, both halves of a group in turn.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu_int4_avx2.h"
#include "cpu_int4_groups.h"
#include "cpu_int8_rows.h"
#include "cpu_simd_avx2.h"
#include "cpu_kernels.h"
#include "cpu_team.h"

#define GS INT8_GROUP
#define LOGIT_PREFETCH_GROUPS 4

/* dot_pairs (cpu_simd_avx2.h) in asm: through the intrinsics GCC kept three of tile_rows2's
 * eight sums on the stack (a store and a load per column pair each) */
static inline __attribute__((always_inline)) __m256i dot_pairs_asm(__m256i acc, __m256i w,
                                                                   __m256i x) {
#ifdef __AVXVNNI__
    __asm__("%{vex%} vpdpwssd %2, %1, %0" : "+x"(acc) : "x"(w), "x"(x));
#else
    __m256i t;
    __asm__("vpmaddwd %2, %3, %1\n\tvpaddd %1, %0, %0" : "+x"(acc), "=&x"(t) : "x"(w), "x"(x));
#endif
    return acc;
}

/* Column pair (k, k+1) at ph (plane H; plane L K * 32 bytes on) of a tile's half `half` ->
 * W[0..3]: the (k, k+1) words of u for the rows above (one row per 32-bit lane) */
static inline __attribute__((always_inline)) void u_words8(const uint8_t *ph, int64_t K,
                                                          const int half, __m256i W[4]) {
    const __m256i lo4 = _mm256_set1_epi8(0x0F);
    const __m256i zero = _mm256_setzero_si256();
    __m256i u[2]; /* column k, column k + 1: bytes = rows 32 half + 0..31 */
    for (int c = 0; c < 2; c++) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)(ph + 32 * c));
        const __m256i l = _mm256_loadu_si256((const __m256i *)(ph + K * 32 + 32 * c));
        /* one mask: a nibble masked before its 16-bit shift never crosses into the next byte */
        u[c] = half ? _mm256_or_si256(_mm256_andnot_si256(lo4, h),
                                      _mm256_and_si256(_mm256_srli_epi16(l, 4), lo4))
                    : _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(h, lo4), 4),
                                      _mm256_and_si256(l, lo4));
    }
    const __m256i p0 = _mm256_unpacklo_epi8(u[0], u[1]); /* rows 0-7 | 16-23, (k, k+1) */
    const __m256i p1 = _mm256_unpackhi_epi8(u[0], u[1]); /* rows 8-15 | 24-31 */
    W[0] = _mm256_unpacklo_epi8(p0, zero);               /* rows 0-3 | 16-19 */
    W[1] = _mm256_unpackhi_epi8(p0, zero);               /* rows 4-7 | 20-23 */
    W[2] = _mm256_unpacklo_epi8(p1, zero);               /* rows 8-11 | 24-27 */
    W[3] = _mm256_unpackhi_epi8(p1, zero);               /* rows 12-15 | 28-31 */
}

/* the 8 rows of W[j]: rows r .. r+3 and r+16 .. r+19, r = 32 half + 4 j, of the tile at row0 */
static inline __m256 scales8(const uint16_t *scales, int64_t n_pad, int64_t g, int64_t row) {
    const uint16_t *p = scales + g * n_pad + row;
    const __m128i a = _mm_loadl_epi64((const __m128i *)p);
    const __m128i b = _mm_loadl_epi64((const __m128i *)(p + 16));
    return _mm256_cvtph_ps(_mm_unpacklo_epi64(a, b));
}

/* The prefetches of group g's scales, in the pass that reads the group from memory:
 * LOGIT_PREFETCH_GROUPS groups on, and the same group's of the next tile (its first groups'
 * are never prefetched otherwise: a group's 64 rows lie 2 n_pad bytes from the next group's;
 * without it, decode of one sequence took 1.05x as long, Zen 2) */
static inline __attribute__((always_inline)) void group_prefetch(const uint16_t *scales,
                                                                 int64_t n_pad, int64_t row0,
                                                                 int64_t K, int64_t g) {
    if (g + LOGIT_PREFETCH_GROUPS < K / GS)
        _mm_prefetch((const char *)(scales + (g + LOGIT_PREFETCH_GROUPS) * n_pad + row0),
                     STREAM_HINT);
    if (row0 + TILE < n_pad) {
        _mm_prefetch((const char *)(scales + g * n_pad + row0 + TILE), STREAM_HINT);
        _mm_prefetch((const char *)(scales + g * n_pad + row0 + TILE + 32), STREAM_HINT);
    }
}

/* The prefetches of the column pair at ph (column k of the tile), in that pass. Both helpers
 * are always inlined: a void function of prefetches alone GCC took for one without effects,
 * and dropped its calls. */
static inline __attribute__((always_inline)) void pair_prefetch(const uint8_t *ph, int64_t K,
                                                                int64_t k) {
    _mm_prefetch((const char *)ph + PREFETCH_BYTES, STREAM_HINT);
    _mm_prefetch((const char *)ph + K * 32 + PREFETCH_BYTES, STREAM_HINT);
    /* the next tile's first lines of its plane L, which the stream's prefetch (PREFETCH_BYTES
     * on in each plane) never reaches */
    if (k * 32 < PREFETCH_BYTES) _mm_prefetch((const char *)ph + 3 * K * 32, STREAM_HINT);
}

/* out[r][j] += group g's vector j (A = a - corr, then fp32: y += float(A) (s sx)) of half
 * `half` for R rows of x (a[r J + i]: vector j0 + i of row r; sx, corr: the first row's, a row
 * `groups` apart; out: the rows' 64 sums each, W order), for the vectors j0 .. j0 + J - 1 */
static inline __attribute__((always_inline)) void group_update(
    const __m256i *a, const uint16_t *scales, int64_t n_pad, int64_t row0, int64_t g,
    int64_t groups, const float *sx, const int32_t *corr, float *out, const int R,
    const int half, const int j0, const int J) {
    for (int i = 0; i < J; i++) {
        const int j = j0 + i;
        const __m256 s = scales8(scales, n_pad, g, row0 + 32 * half + 4 * j);
        for (int r = 0; r < R; r++) {
            const __m256i A = _mm256_sub_epi32(a[r * J + i], _mm256_set1_epi32(corr[r * groups + g]));
            const __m256 sc = _mm256_mul_ps(s, _mm256_set1_ps(sx[r * groups + g]));
            float *o = out + r * TILE + 32 * half + 8 * j;
            _mm256_store_ps(o, _mm256_fmadd_ps(_mm256_cvtepi32_ps(A), sc, _mm256_load_ps(o)));
        }
    }
}

/* Half `half` of group g of one tile for MR (1 or 2) rows of x (out[MR][64], W order:
 * vector j of half h at 32 h + 8 j), its words of u decoded as they are used; half 0 reads the
 * group's lines from memory (and prefetches the stream on), half 1 again from L1 */
static inline __attribute__((always_inline)) void rows_half(
    const uint8_t *tile, const uint16_t *scales, int64_t n_pad, int64_t row0, int64_t K,
    int64_t g, const int16_t *v, const float *sx, const int32_t *corr, float *out,
    const int MR, const int half) {
    __m256i a[2 * 4];
    for (int i = 0; i < 4 * MR; i++) a[i] = _mm256_setzero_si256();
    for (int kp = 0; kp < GS / 2; kp++) {
        const uint8_t *ph = tile + (g * GS + 2 * kp) * 32;
        if (half == 0) pair_prefetch(ph, K, g * GS + 2 * kp);
        __m256i W[4];
        u_words8(ph, K, half, W);
        for (int m = 0; m < MR; m++) {
            const __m256i xb = _mm256_set1_epi32(*(const int32_t *)(v + m * K + g * GS + 2 * kp));
            for (int j = 0; j < 4; j++) a[4 * m + j] = dot_pairs_asm(a[4 * m + j], W[j], xb);
        }
    }
    group_update(a, scales, n_pad, row0, g, K / GS, sx, corr, out, MR, half, 0, 4);
}

/* One tile for MR (1 or 2) rows of x, group by group, each group's two halves in turn: the
 * tile's lines stream from memory without a break (with the whole first half before the
 * second, the memory idled while the second read the tile again from L2) */
#define TILE_ARGS                                                                              \
    const uint8_t *tile, const uint16_t *scales, int64_t n_pad, int64_t row0, int64_t K,       \
        const int16_t *v, const float *sx, const int32_t *corr, float *out
#define TILE_ROWS(MR)                                                                          \
    static __attribute__((noinline)) void tile_rows##MR(TILE_ARGS) {                           \
        for (int64_t g = 0; g < K / GS; g++) {                                                 \
            group_prefetch(scales, n_pad, row0, K, g);                                         \
            rows_half(tile, scales, n_pad, row0, K, g, v, sx, corr, out, MR, 0);               \
            rows_half(tile, scales, n_pad, row0, K, g, v, sx, corr, out, MR, 1);               \
        }                                                                                      \
    }
TILE_ROWS(1)
TILE_ROWS(2)

/* Rows of x per pass over a tile where there are several (int8_logits) */
#define MANY_ROWS 8

/* R rows of x (v, sx, corr of the first; out[R][64]) of group g, vectors j0 and j0 + 1 of
 * half `half`, from the group's words of u decoded (wb [2 halves][GS / 2 column pairs][4]):
 * 2 R sums in registers */
static inline __attribute__((always_inline)) void rows_from_words(
    const __m256i wb[2][GS / 2][4], const uint16_t *scales, int64_t n_pad, int64_t row0,
    int64_t K, int64_t g, const int16_t *v, const float *sx, const int32_t *corr, float *out,
    const int R, const int half, const int j0) {
    __m256i a[4 * 2];
    for (int i = 0; i < 2 * R; i++) a[i] = _mm256_setzero_si256();
    /* intrinsics, unrolled by 2: through dot_pairs_asm GCC copied every sum between registers
     * (1.1x the time at 8 rows) */
#pragma GCC unroll 2
    for (int kp = 0; kp < GS / 2; kp++) {
        const __m256i w0 = wb[half][kp][j0], w1 = wb[half][kp][j0 + 1];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const __m256i xb = _mm256_set1_epi32(*(const int32_t *)(v + r * K + g * GS + 2 * kp));
            a[2 * r] = dot_pairs(a[2 * r], w0, xb);
            a[2 * r + 1] = dot_pairs(a[2 * r + 1], w1, xb);
        }
    }
    group_update(a, scales, n_pad, row0, g, K / GS, sx, corr, out, R, half, j0, 2);
}

#define WORDS_ARGS                                                                             \
    const __m256i wb[2][GS / 2][4], const uint16_t *scales, int64_t n_pad, int64_t row0,       \
        int64_t K, int64_t g, const int16_t *v, const float *sx, const int32_t *corr, float *out
#define ROWS_FROM_WORDS(R)                                                                     \
    static __attribute__((noinline)) void rows_from_words##R(WORDS_ARGS) {                     \
        rows_from_words(wb, scales, n_pad, row0, K, g, v, sx, corr, out, R, 0, 0);             \
        rows_from_words(wb, scales, n_pad, row0, K, g, v, sx, corr, out, R, 0, 2);             \
        rows_from_words(wb, scales, n_pad, row0, K, g, v, sx, corr, out, R, 1, 0);             \
        rows_from_words(wb, scales, n_pad, row0, K, g, v, sx, corr, out, R, 1, 2);             \
    }
ROWS_FROM_WORDS(1)
ROWS_FROM_WORDS(2)
ROWS_FROM_WORDS(3)
ROWS_FROM_WORDS(4)

/* One tile for mr (4 .. MANY_ROWS) rows of x (out[mr][64]), group by group: the group's words
 * of u decoded once for both halves (4 KB, read again from L1), each row's sums from them,
 * 4 rows at a time. The integer sums and the fp32 updates are tile_rows1's, in the same order:
 * a row's logits are the same in any batch. Against rows two at a time (tile_rows2), each pair
 * decoding the words again: 0.91 of the time at 8 rows, 1.15x at 2 (Zen 2). */
static __attribute__((noinline)) void tile_words(TILE_ARGS, int64_t mr) {
    const int64_t groups = K / GS;
    __m256i wb[2][GS / 2][4];
    for (int64_t g = 0; g < groups; g++) {
        group_prefetch(scales, n_pad, row0, K, g);
        for (int kp = 0; kp < GS / 2; kp++) {
            const uint8_t *ph = tile + (g * GS + 2 * kp) * 32;
            pair_prefetch(ph, K, g * GS + 2 * kp);
            u_words8(ph, K, 0, wb[0][kp]);
            u_words8(ph, K, 1, wb[1][kp]);
        }
        for (int64_t r0 = 0; r0 < mr; r0 += 4) {
            const int64_t rn = mr - r0 < 4 ? mr - r0 : 4;
            const int16_t *vr = v + r0 * K;
            const float *sr = sx + r0 * groups;
            const int32_t *cr = corr + r0 * groups;
            float *o = out + r0 * TILE;
            if (rn == 4)
                rows_from_words4(wb, scales, n_pad, row0, K, g, vr, sr, cr, o);
            else if (rn == 3)
                rows_from_words3(wb, scales, n_pad, row0, K, g, vr, sr, cr, o);
            else if (rn == 2)
                rows_from_words2(wb, scales, n_pad, row0, K, g, vr, sr, cr, o);
            else
                rows_from_words1(wb, scales, n_pad, row0, K, g, vr, sr, cr, o);
        }
    }
}

/* One tile's 64 sums of a row (W order) -> y[0 .. rows) (fp32, rows in order) */
static inline void store_row(const float *o, int64_t rows, float *y) {
    __m256 n[8];
    w_order_rows(o, n);
    for (int i = 0; i < 8 && 8 * i < rows; i++) {
        if (8 * i + 8 <= rows)
            _mm256_storeu_ps(y + 8 * i, n[i]);
        else
            _mm256_maskstore_ps(y + 8 * i, lanes_n(rows - 8 * i), n[i]);
    }
}

int int8_logits(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *packed,
                const uint16_t *scales, int64_t N, int64_t n_pad, float *y, int64_t ldy) {
    RoundedRows rr;
    const int rc = logits_rows(x, M, K, ldx, n_pad, &rr);
    if (rc) return rc;
    const int64_t groups = K / GS;
    const int64_t tiles = n_pad / TILE, tile_bytes = 2 * K * 32;
    SHARE_OWN(own, NULL); /* the tiles shared out over the threads (share_next, cpu_team.h) */
    int64_t *ranges = share_ranges(NULL, own);
#pragma omp parallel
    {
        Share share = share_of(ranges, tiles, 1, omp_get_num_threads(), omp_get_thread_num());
        float out[MANY_ROWS * TILE] __attribute__((aligned(32))); /* [m][64], W order */
        int64_t t0, t1;
        while (share_next(&share, &t0, &t1)) {
            for (int64_t t = t0; t < t1; t++) {
                const uint8_t *tile = packed + t * tile_bytes;
                const int64_t n0 = t * TILE, rows = N - n0 < TILE ? N - n0 : TILE;
                for (int64_t m = 0; m < M;) { /* rows of x up to MANY_ROWS at a time */
                    const int64_t left = M - m;
                    const int64_t mr = left >= 4 ? (left < MANY_ROWS ? left : MANY_ROWS)
                                                 : (left >= 2 ? 2 : 1);
                    const int16_t *vm = rr.v + m * K;
                    const float *sm = rr.sx + m * groups;
                    const int32_t *cm = rr.corr + m * groups;
                    for (int i = 0; i < mr * TILE; i += 8)
                        _mm256_store_ps(out + i, _mm256_setzero_ps());
                    if (mr >= 4)
                        tile_words(tile, scales, n_pad, n0, K, vm, sm, cm, out, mr);
                    else if (mr == 2)
                        tile_rows2(tile, scales, n_pad, n0, K, vm, sm, cm, out);
                    else
                        tile_rows1(tile, scales, n_pad, n0, K, vm, sm, cm, out);
                    for (int64_t j = 0; j < mr; j++)
                        store_row(out + j * TILE, rows, y + (m + j) * ldy + n0);
                    m += mr;
                }
            }
        }
    }
    free_rows(&rr);
    return 0;
}
