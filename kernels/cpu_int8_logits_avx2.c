/* int8_logits of the AVX2 build (AVX2 + FMA + F16C): the numbers of cpu_int8_logits.c (which
 * describes them) with vpmaddwd's 16-bit integer products instead of vpdpwssd.
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
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu_int4_avx2.h"
#include "cpu_int4_groups.h"
#include "cpu_int8_rows.h"
#include "cpu_kernels.h"
#include "cpu_team.h"

#define GS INT8_GROUP
#define LOGIT_PREFETCH_GROUPS 4

/* acc + the products of w and x's 16-bit pairs: through the intrinsics GCC kept three of
 * rows2's eight sums on the stack (a store and a load per column pair each) */
static inline __attribute__((always_inline)) __m256i madd_add(__m256i acc, __m256i w, __m256i x) {
    __m256i t;
    __asm__("vpmaddwd %2, %3, %1\n\tvpaddd %1, %0, %0" : "+x"(acc), "=&x"(t) : "x"(w), "x"(x));
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

/* Half `half` of group g of one tile for MR (1 or 2) rows of x, added into out[m][64] (fp32,
 * W order: vector j of half h at 32 h + 8 j); half 0 reads the group's lines from memory (and
 * prefetches the stream on), half 1 reads them again from L1 */
static inline __attribute__((always_inline)) void group_half(
    const uint8_t *tile, const uint16_t *scales, int64_t n_pad, int64_t row0, int64_t K,
    int64_t g, const int16_t *v, const float *sx, const int32_t *corr, float *out, const int MR,
    const int half) {
    const int64_t groups = K / GS;
    if (half == 0) {
        if (g + LOGIT_PREFETCH_GROUPS < groups)
            _mm_prefetch((const char *)(scales + (g + LOGIT_PREFETCH_GROUPS) * n_pad + row0),
                         STREAM_HINT);
        /* the same group's scales of the next tile (its first groups' are never prefetched
         * otherwise: a group's 64 rows lie 2 n_pad bytes from the next group's); without it,
         * decode of one sequence took 1.05x as long (Zen 2) */
        if (row0 + TILE < n_pad) {
            _mm_prefetch((const char *)(scales + g * n_pad + row0 + TILE), STREAM_HINT);
            _mm_prefetch((const char *)(scales + g * n_pad + row0 + TILE + 32), STREAM_HINT);
        }
    }
    __m256i a[2][4];
    for (int m = 0; m < MR; m++)
        for (int j = 0; j < 4; j++) a[m][j] = _mm256_setzero_si256();
    for (int kp = 0; kp < GS / 2; kp++) {
        const uint8_t *ph = tile + (g * GS + 2 * kp) * 32;
        if (half == 0) {
            _mm_prefetch((const char *)ph + PREFETCH_BYTES, STREAM_HINT);
            _mm_prefetch((const char *)ph + K * 32 + PREFETCH_BYTES, STREAM_HINT);
            if ((g * GS + 2 * kp) * 32 < PREFETCH_BYTES) {
                /* the next tile's first lines of its plane L, which the stream's prefetch
                 * (PREFETCH_BYTES on in each plane) never reaches */
                _mm_prefetch((const char *)ph + 3 * K * 32, STREAM_HINT);
            }
        }
        __m256i W[4];
        u_words8(ph, K, half, W);
        for (int m = 0; m < MR; m++) {
            const __m256i xb = _mm256_set1_epi32(*(const int32_t *)(v + m * K + g * GS + 2 * kp));
            for (int j = 0; j < 4; j++)
                a[m][j] = madd_add(a[m][j], W[j], xb);
        }
    }
    for (int j = 0; j < 4; j++) {
        const int64_t r = 32 * half + 4 * j;
        const __m256 s = scales8(scales, n_pad, g, row0 + r);
        for (int m = 0; m < MR; m++) {
            const __m256i A = _mm256_sub_epi32(a[m][j], _mm256_set1_epi32(corr[m * groups + g]));
            const __m256 sc = _mm256_mul_ps(s, _mm256_set1_ps(sx[m * groups + g]));
            float *o = out + m * TILE + 32 * half + 8 * j; /* W order */
            _mm256_store_ps(o, _mm256_fmadd_ps(_mm256_cvtepi32_ps(A), sc, _mm256_load_ps(o)));
        }
    }
}

/* One tile for MR rows of x, group by group, each group's two halves in turn: the tile's
 * lines stream from memory without a break (with the whole first half before the second,
 * the memory idled while the second read the tile again from L2) */
static inline __attribute__((always_inline)) void tile_rows(
    const uint8_t *tile, const uint16_t *scales, int64_t n_pad, int64_t row0, int64_t K,
    const int16_t *v, const float *sx, const int32_t *corr, float *out, const int MR) {
    for (int64_t g = 0; g < K / GS; g++) {
        group_half(tile, scales, n_pad, row0, K, g, v, sx, corr, out, MR, 0);
        group_half(tile, scales, n_pad, row0, K, g, v, sx, corr, out, MR, 1);
    }
}

#define TILE_ARGS                                                                              \
    const uint8_t *tile, const uint16_t *scales, int64_t n_pad, int64_t row0, int64_t K,       \
        const int16_t *v, const float *sx, const int32_t *corr, float *out
static __attribute__((noinline)) void tile_rows1(TILE_ARGS) {
    tile_rows(tile, scales, n_pad, row0, K, v, sx, corr, out, 1);
}
static __attribute__((noinline)) void tile_rows2(TILE_ARGS) {
    tile_rows(tile, scales, n_pad, row0, K, v, sx, corr, out, 2);
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
        float out[2 * TILE] __attribute__((aligned(32))); /* [m][64], W order */
        int64_t t0, t1;
        while (share_next(&share, &t0, &t1)) {
            for (int64_t t = t0; t < t1; t++) {
                const uint8_t *tile = packed + t * tile_bytes;
                const int64_t n0 = t * TILE, rows = N - n0 < TILE ? N - n0 : TILE;
                for (int64_t m = 0; m < M; m += 2) { /* rows of x two at a time */
                    const int64_t mr = M - m >= 2 ? 2 : 1;
                    const int16_t *vm = rr.v + m * K;
                    const float *sm = rr.sx + m * groups;
                    const int32_t *cm = rr.corr + m * groups;
                    for (int i = 0; i < 2 * TILE; i += 8)
                        _mm256_store_ps(out + i, _mm256_setzero_ps());
                    if (mr == 2)
                        tile_rows2(tile, scales, n_pad, n0, K, vm, sm, cm, out);
                    else
                        tile_rows1(tile, scales, n_pad, n0, K, vm, sm, cm, out);
                    for (int64_t j = 0; j < mr; j++)
                        for (int i = 0; i < TILE; i++) { /* W order -> rows */
                            const int64_t r = w_slot_row(i);
                            if (r < rows) y[(m + j) * ldy + n0 + r] = out[j * TILE + i];
                        }
                }
            }
        }
    }
    free_rows(&rr);
    return 0;
}
