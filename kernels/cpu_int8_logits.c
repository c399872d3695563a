/* int8_logits: fp32 logits from a grouped int8 weight with fp16 scales (an LM head in Q8_0:
 * two nibble planes, q = 16 h + l; layout in cpu_int4.h), on AVX-512 VNNI's 16-bit integer
 * products (vpdpwssd). The AVX2 build's (cpu_int8_logits_avx2.c) computes the same numbers.
 *
 * Each row of x is rounded, per group of 32 columns, to 16-bit integers v with a scale sx
 * (cpu_int8_rows.h). The weight's bytes are rebuilt into u = 16 h + l = q + 128 (0..255), so
 * that per group, exactly in int32 (|sum| < 32 * 255 * 32767 < 2^31),
 *     A = sum_k u v - 128 sum_k v = sum_k q v
 * and the logit of output row n is, in fp32, over the groups in order,
 *     y += float(A) * (s[n] * sx)
 * The integer sums are exact, and a row of x is rounded alone, so a row gets the same logits
 * alone or in a batch. Against the bf16 products of int4_mm (whose outputs are rounded to
 * bf16) the error is far smaller: x keeps 16 bits per group where bf16 keeps 8, and the logits
 * stay fp32. The decode is 4 operations per 64 weights (the bf16 path's u took 14).
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu_int4.h"
#include "cpu_int8_rows.h"
#include "cpu_kernels.h"
#include "cpu_team.h"

#define GS 32
#define SELECT 0xE4 /* vpternlogd: c ? a : b, bit by bit, for (a, b, c) */
#define LOGIT_PREFETCH_GROUPS 4

/* acc + the products of a and b's 16-bit pairs, in place: with the intrinsic GCC copied every
 * sum between two sets of registers on each column pair */
static inline __attribute__((always_inline)) __m512i dot_words(__m512i acc, __m512i a, __m512i b) {
    __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
    return acc;
}

/* The (k, k+1) words of u for rows 32 half + 16 j .. + 15 of a tile, j = 0, 1 (vpdpwssd's
 * operand: one row per 32-bit lane), from the column pair's bytes h and l of its two planes:
 * rows 0-31 are the low nibbles of both planes' bytes, rows 32-63 the high ones */
static inline __attribute__((always_inline)) void half_words(__m512i h, __m512i l, int half,
                                                            __m512i w[2]) {
    const __m512i hi4 = _mm512_set1_epi8((char)0xF0);
    const __m512i u = half ? _mm512_ternarylogic_epi32(h, _mm512_srli_epi16(l, 4), hi4, SELECT)
                           : _mm512_ternarylogic_epi32(_mm512_slli_epi16(h, 4), l, hi4, SELECT);
    w[0] = _mm512_maskz_permutexvar_epi8(PAIR_MASK, _mm512_load_si512(PAIR_INDEX[0]), u);
    w[1] = _mm512_maskz_permutexvar_epi8(PAIR_MASK, _mm512_load_si512(PAIR_INDEX[1]), u);
}

/* Column pair kp of a 64-row tile: the (k, k+1) words of u for rows 16 j .. 16 j + 15 of the
 * tile, j = 0..3 */
static inline __attribute__((always_inline)) void u_words(const uint8_t *ph, int64_t K,
                                                         __m512i w[4]) {
    const __m512i h = _mm512_loadu_si512(ph), l = _mm512_loadu_si512(ph + K * 32);
    half_words(h, l, 0, w);
    half_words(h, l, 1, w + 2);
}

/* Rows 16 V0 .. 16 (V0 + NV) - 1 of one tile for MR rows of x (NV * MR <= 16 sums, in
 * registers: fixed sizes A_ROWS x A_VECS), added into out[m][64] (fp32) group by group. */
#define TILE_PART(name, A_ROWS, A_VECS)                                                        \
    static inline __attribute__((always_inline)) void name(                                    \
        const uint8_t *tile, const uint16_t *scales, int64_t n_pad, int64_t row0, int64_t K,    \
        const int16_t *v, const float *sx, const int32_t *corr, float *out, const int MR,       \
        const int V0) {                                                                        \
        const int64_t groups = K / GS;                                                         \
        for (int64_t g = 0; g < groups; g++) {                                                 \
            if (V0 == 0 && g + LOGIT_PREFETCH_GROUPS < groups)                                 \
                _mm_prefetch((const char *)(scales + (g + LOGIT_PREFETCH_GROUPS) * n_pad + row0), \
                             STREAM_HINT);                                                     \
            __m512i a[A_ROWS][A_VECS];                                                         \
            for (int m = 0; m < MR; m++)                                                       \
                for (int j = 0; j < A_VECS; j++) a[m][j] = _mm512_setzero_si512();             \
            for (int kp = 0; kp < GS / 2; kp++) {                                              \
                const uint8_t *ph = tile + (g * GS + 2 * kp) * 32;                             \
                if (A_VECS == 4) { /* one pass: both planes' lines two tiles on */             \
                    _mm_prefetch((const char *)ph + 4 * K * 32, STREAM_HINT);                  \
                    _mm_prefetch((const char *)ph + 5 * K * 32, STREAM_HINT);                  \
                } else { /* two: the next tile's, one plane a pass (the second pass, with      \
                          * none, left the memory idle while it read the tile from L1/L2) */   \
                    _mm_prefetch((const char *)ph + (V0 == 0 ? 2 : 3) * K * 32, STREAM_HINT);  \
                }                                                                              \
                __m512i w[4];                                                                  \
                u_words(ph, K, w);                                                             \
                for (int m = 0; m < MR; m++) {                                                 \
                    const __m512i xb = _mm512_set1_epi32(                                      \
                        *(const int32_t *)(v + m * K + g * GS + 2 * kp));                      \
                    for (int j = 0; j < A_VECS; j++)                                           \
                        a[m][j] = dot_words(a[m][j], w[V0 + j], xb);                 \
                }                                                                              \
            }                                                                                  \
            for (int j = 0; j < A_VECS; j++) {                                                 \
                const int64_t r = 16 * (V0 + j);                                               \
                const __m512 s = _mm512_cvtph_ps(                                              \
                    _mm256_loadu_si256((const __m256i *)(scales + g * n_pad + row0 + r)));     \
                for (int m = 0; m < MR; m++) {                                                 \
                    const __m512i A =                                                          \
                        _mm512_sub_epi32(a[m][j], _mm512_set1_epi32(corr[m * groups + g]));    \
                    const __m512 sc = _mm512_mul_ps(s, _mm512_set1_ps(sx[m * groups + g]));    \
                    float *o = out + m * TILE + r;                                             \
                    _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_cvtepi32_ps(A), sc,             \
                                                        _mm512_loadu_ps(o)));                  \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
    }
TILE_PART(tile_part4, 2, 4) /* up to 2 rows of x, the tile's four row blocks */
TILE_PART(tile_part2, 8, 2) /* up to 8 rows of x, two row blocks */

/* Two consecutive tiles (tile_bytes apart) for one row of x -> out[i][64] (fp32): the sums of
 * tile_part4 in the same order, 8 of them at once over two streams of lines (one tile at a
 * time read 5-8% slower from memory) */
static __attribute__((noinline)) void tiles2_row1(const uint8_t *tile, int64_t tile_bytes,
                                                  const uint16_t *scales, int64_t n_pad,
                                                  int64_t row0, int64_t K, const int16_t *v,
                                                  const float *sx, const int32_t *corr,
                                                  float *out) {
    const int64_t groups = K / GS;
    for (int i = 0; i < 2 * TILE; i += 16) _mm512_storeu_ps(out + i, _mm512_setzero_ps());
    for (int64_t g = 0; g < groups; g++) {
        if (g + LOGIT_PREFETCH_GROUPS < groups)
            for (int i = 0; i < 2; i++)
                _mm_prefetch((const char *)(scales + (g + LOGIT_PREFETCH_GROUPS) * n_pad + row0 +
                                            i * TILE),
                             STREAM_HINT);
        __m512i a[2][4];
        for (int i = 0; i < 2; i++)
            for (int j = 0; j < 4; j++) a[i][j] = _mm512_setzero_si512();
        for (int kp = 0; kp < GS / 2; kp++) {
            const __m512i xb = _mm512_set1_epi32(*(const int32_t *)(v + g * GS + 2 * kp));
            for (int i = 0; i < 2; i++) {
                const uint8_t *ph = tile + i * tile_bytes + (g * GS + 2 * kp) * 32;
                _mm_prefetch((const char *)ph + 2 * tile_bytes, STREAM_HINT);
                _mm_prefetch((const char *)ph + K * 32 + 2 * tile_bytes, STREAM_HINT);
                __m512i w[4];
                u_words(ph, K, w);
                for (int j = 0; j < 4; j++) a[i][j] = dot_words(a[i][j], w[j], xb);
            }
        }
        for (int i = 0; i < 2; i++)
            for (int j = 0; j < 4; j++) {
                const int64_t r = i * TILE + 16 * j;
                const __m512 s = _mm512_cvtph_ps(
                    _mm256_loadu_si256((const __m256i *)(scales + g * n_pad + row0 + r)));
                const __m512i A = _mm512_sub_epi32(a[i][j], _mm512_set1_epi32(corr[g]));
                const __m512 sc = _mm512_mul_ps(s, _mm512_set1_ps(sx[g]));
                _mm512_storeu_ps(out + r, _mm512_fmadd_ps(_mm512_cvtepi32_ps(A), sc,
                                                          _mm512_loadu_ps(out + r)));
            }
    }
}

/* Two consecutive tiles (tile_bytes apart) for 4 rows of x, their row blocks V0 and V0 + 1
 * (16 sums: 2 tiles x 4 rows x 2 blocks), added into out[(i * 4 + m) * 64 + row] (fp32) group
 * by group: the sums of tile_part2, in the same order. Four streams of lines from memory
 * where one tile at a time read two (8 rows' head from memory 2-8% faster, in-process A/B).
 * The pass prefetches, two tiles on, the (tile, plane) streams s = 2 i + plane whose bit is
 * set in `streams`, so that a pair's passes share the next pair's lines. */
static __attribute__((noinline)) void tiles2_rows4(const uint8_t *tile, int64_t tile_bytes,
                                                   const uint16_t *scales, int64_t n_pad,
                                                   int64_t row0, int64_t K, const int16_t *v,
                                                   const float *sx, const int32_t *corr,
                                                   float *out, const int V0, const int streams) {
    const int64_t groups = K / GS;
    for (int64_t g = 0; g < groups; g++) {
        if (g + LOGIT_PREFETCH_GROUPS < groups)
            for (int i = 0; i < 2; i++)
                _mm_prefetch((const char *)(scales + (g + LOGIT_PREFETCH_GROUPS) * n_pad + row0 +
                                            i * TILE + 16 * V0),
                             STREAM_HINT);
        __m512i a[2][4][2];
        for (int i = 0; i < 2; i++)
            for (int m = 0; m < 4; m++) a[i][m][0] = a[i][m][1] = _mm512_setzero_si512();
        for (int kp = 0; kp < GS / 2; kp++) {
            __m512i w[2][2];
            for (int i = 0; i < 2; i++) {
                const uint8_t *ph = tile + i * tile_bytes + (g * GS + 2 * kp) * 32;
                for (int plane = 0; plane < 2; plane++)
                    if (streams >> (2 * i + plane) & 1)
                        _mm_prefetch((const char *)ph + plane * K * 32 + 2 * tile_bytes,
                                     STREAM_HINT);
                half_words(_mm512_loadu_si512(ph), _mm512_loadu_si512(ph + K * 32), V0 / 2,
                           w[i]);
            }
            for (int m = 0; m < 4; m++) {
                const __m512i xb =
                    _mm512_set1_epi32(*(const int32_t *)(v + m * K + g * GS + 2 * kp));
                for (int i = 0; i < 2; i++)
                    for (int j = 0; j < 2; j++) a[i][m][j] = dot_words(a[i][m][j], w[i][j], xb);
            }
        }
        for (int i = 0; i < 2; i++)
            for (int j = 0; j < 2; j++) {
                const int64_t r = 16 * (V0 + j);
                const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(
                    (const __m256i *)(scales + g * n_pad + row0 + i * TILE + r)));
                for (int m = 0; m < 4; m++) {
                    const __m512i A =
                        _mm512_sub_epi32(a[i][m][j], _mm512_set1_epi32(corr[m * groups + g]));
                    const __m512 sc = _mm512_mul_ps(s, _mm512_set1_ps(sx[m * groups + g]));
                    float *o = out + (i * 4 + m) * TILE + r;
                    _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_cvtepi32_ps(A), sc,
                                                        _mm512_loadu_ps(o)));
                }
            }
    }
}

/* Each (rows of x, row blocks) pass compiled on its own: two passes inlined into one function
 * made GCC copy the 16 sums between registers on every column pair. */
#define PART_ARGS                                                                              \
    const uint8_t *tile, const uint16_t *scales, int64_t n_pad, int64_t row0, int64_t K,       \
        const int16_t *v, const float *sx, const int32_t *corr, float *out
#define PART(name, part, mr, v0)                                                               \
    static __attribute__((noinline)) void name(PART_ARGS) {                                    \
        part(tile, scales, n_pad, row0, K, v, sx, corr, out, mr, v0);                          \
    }
PART(rows1, tile_part4, 1, 0)
PART(rows2, tile_part4, 2, 0)
PART(rows4_lo, tile_part2, 4, 0)
PART(rows4_hi, tile_part2, 4, 2)
PART(rows8_lo, tile_part2, 8, 0)
PART(rows8_hi, tile_part2, 8, 2)

/* One 64-row tile for mr (1, 2, 4 or 8) rows of x -> out[m][64] (fp32): up to two rows all
 * four row blocks at once (4 mr independent sums), more rows two blocks at a time (the
 * tile's lines again, from L1) */
static void tile_rows(PART_ARGS, int64_t mr) {
    for (int64_t i = 0; i < mr * TILE; i += 16) _mm512_storeu_ps(out + i, _mm512_setzero_ps());
    if (mr == 1) {
        rows1(tile, scales, n_pad, row0, K, v, sx, corr, out);
    } else if (mr == 2) {
        rows2(tile, scales, n_pad, row0, K, v, sx, corr, out);
    } else if (mr == 4) {
        rows4_lo(tile, scales, n_pad, row0, K, v, sx, corr, out);
        rows4_hi(tile, scales, n_pad, row0, K, v, sx, corr, out);
    } else {
        rows8_lo(tile, scales, n_pad, row0, K, v, sx, corr, out);
        rows8_hi(tile, scales, n_pad, row0, K, v, sx, corr, out);
    }
}

/* A tile pair (tile_bytes apart) for 4 rows of x -> out[(i * 4 + m) * 64 + row] (fp32): both
 * halves' passes, p0 and p0 + 1 of a pair's `passes`; pass p prefetches the streams
 * s = p (mod passes) of tiles2_rows4, so that together they cover the four */
static void pair_rows4(PART_ARGS, int64_t tile_bytes, int64_t p0, int64_t passes) {
    for (int64_t k = 0; k < 8 * TILE; k += 16) _mm512_storeu_ps(out + k, _mm512_setzero_ps());
    for (int half = 0; half < 2; half++) {
        int streams = 0;
        for (int st = 0; st < 4; st++)
            if (st % passes == p0 + half) streams |= 1 << st;
        tiles2_rows4(tile, tile_bytes, scales, n_pad, row0, K, v, sx, corr, out, 2 * half,
                     streams);
    }
}

/* Tiles a pass takes for M rows of x: one row two tiles at a time; 4 rows and more tile pairs */
static inline int64_t tiles_a_pass(int64_t M) { return M == 1 || M >= 4 ? 2 : 1; }

/* Tiles t0 .. t_end - 1 for the M rows of x (v, sx, corr: logits_rows' rounding) -> y: one
 * row two tiles at a time; 4 rows and more: tile pairs, 4 rows a pass (then the rest, and a
 * last unpaired tile, one tile at a time: 8, 4, 2 or 1 rows) */
static void tile_range(const uint8_t *packed, const uint16_t *scales, int64_t N, int64_t n_pad,
                       int64_t K, int64_t M, const int16_t *v, const float *sx,
                       const int32_t *corr, float *y, int64_t ldy, int64_t t0, int64_t t_end) {
    const int64_t groups = K / GS, tile_bytes = 2 * K * 32;
    const int64_t step = tiles_a_pass(M);
    const int64_t quads = M / 4, passes = 2 * quads; /* a pair's passes of 4 rows */
    float out[8 * TILE];
    for (int64_t t = t0; t < t_end; t += step) {
        const int64_t nt = t_end - t < step ? t_end - t : step;
        const uint8_t *tile = packed + t * tile_bytes;
        for (int64_t m = 0; m < M;) {
            const int64_t left = M - m;
            const int pair4 = nt == 2 && M >= 4 && left >= 4;
            const int64_t mr = M == 1 ? 1 : pair4 ? 4
                               : left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
            const int64_t cover = pair4 || M == 1 ? nt : 1; /* tiles in out at once */
            for (int64_t i = 0; i < nt; i += cover) {
                const uint8_t *ti = tile + i * tile_bytes;
                const int64_t row0 = (t + i) * TILE;
                if (M == 1 && nt == 2) {
                    tiles2_row1(ti, tile_bytes, scales, n_pad, row0, K, v, sx, corr, out);
                } else if (pair4) {
                    pair_rows4(ti, scales, n_pad, row0, K, v + m * K, sx + m * groups,
                               corr + m * groups, out, tile_bytes, m / 4 * 2, passes);
                } else {
                    tile_rows(ti, scales, n_pad, row0, K, v + m * K, sx + m * groups,
                              corr + m * groups, out, mr);
                }
                for (int64_t c = 0; c < cover; c++) {
                    const int64_t n0 = (t + i + c) * TILE;
                    const int64_t rows = N - n0 < TILE ? N - n0 : TILE;
                    for (int64_t j = 0; j < mr; j++)
                        for (int64_t r = 0; r < rows; r += 16)
                            _mm512_mask_storeu_ps(
                                y + (m + j) * ldy + n0 + r,
                                rows - r >= 16 ? 0xFFFF : (1u << (rows - r)) - 1,
                                _mm512_loadu_ps(out + (c * mr + j) * TILE + r));
                }
            }
            m += mr;
        }
    }
}

int int8_logits(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *packed,
                const uint16_t *scales, int64_t N, int64_t n_pad, float *y, int64_t ldy) {
    RoundedRows rr;
    const int rc = logits_rows(x, M, K, ldx, n_pad, &rr);
    if (rc) return rc;
    const int64_t tiles = n_pad / TILE;
    SHARE_OWN(own, NULL); /* the tiles shared out over the threads (share_next, cpu_team.h) */
    int64_t *ranges = share_ranges(NULL, own);
#pragma omp parallel
    {
        Share share = share_of(ranges, tiles, tiles_a_pass(M), omp_get_num_threads(),
                               omp_get_thread_num());
        int64_t t0, t1;
        while (share_next(&share, &t0, &t1))
            tile_range(packed, scales, N, n_pad, K, M, rr.v, rr.sx, rr.corr, y, ldy, t0, t1);
    }
    free_rows(&rr);
    return 0;
}
