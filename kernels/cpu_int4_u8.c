/* The few-rows path of int4_mm on AVX-512 BF16 for a grouped int8 weight with the file's fp16
 * scales (Q8_0: two nibble planes, q = 16 h + l; layout and formula in cpu_int4.h).
 *
 * Both planes of a column pair are read together and rebuilt into u = 16 h + l = q + 128
 * (0..255), which bf16 holds exactly (8 significant bits), so that one vdpbf16ps covers a
 * weight where the planes apart took two. Per group of gs columns, with a = sum_k x u and sx
 * the group's sum of x:
 *     sum_k x q s  =  s a - 128 s sx
 * u reaches bf16 through fp32 (vcvtdq2ps; the top 16 bits of an integer below 256 in fp32 are
 * its exact bf16). Every (row of x, output row) pair is summed in one order whatever the
 * number of rows, so a row of x gets the same result alone or in a batch.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#include "cpu_int4.h"
#include "cpu_team.h"
#include "cpu_simd.h"

#define PREFETCH_GROUPS 4

/* vpermb indices: 32-bit lane i takes byte o + i of the source in its low byte (the other
 * three bytes are zeroed by LOW_BYTES) */
#define AT(o, i) (o) + (i), 0, 0, 0
#define LANES(o) AT(o, 0), AT(o, 1), AT(o, 2), AT(o, 3), AT(o, 4), AT(o, 5), AT(o, 6), \
    AT(o, 7), AT(o, 8), AT(o, 9), AT(o, 10), AT(o, 11), AT(o, 12), AT(o, 13), AT(o, 14), \
    AT(o, 15)
static const uint8_t U_INDEX[4][64] __attribute__((aligned(64))) = {
    {LANES(0)}, {LANES(16)}, {LANES(32)}, {LANES(48)}};
#define LOW_BYTES 0x1111111111111111ULL
#define SELECT 0xE4 /* vpternlogd: c ? a : b, bit by bit, for (a, b, c) */

/* Columns k and k+1 of a 64-row tile, 64 bytes in each plane (h, l: column k's 32 bytes, then
 * column k+1's) -> the (k, k+1) bf16 pairs of u for rows 32 half + 16 j: w[j], j = 0, 1 */
static inline __attribute__((always_inline)) void u_pairs(__m512i h, __m512i l, const int HALF,
                                                         __m512i w[2]) {
    const __m512i hi4 = _mm512_set1_epi8((char)0xF0);
    /* rows 0-31 are the low nibbles of both planes' bytes, rows 32-63 the high ones */
    const __m512i u = HALF ? _mm512_ternarylogic_epi32(h, _mm512_srli_epi16(l, 4), hi4, SELECT)
                           : _mm512_ternarylogic_epi32(_mm512_slli_epi16(h, 4), l, hi4, SELECT);
    for (int j = 0; j < 2; j++) {
        const __m512i ck = _mm512_maskz_permutexvar_epi8(
            LOW_BYTES, _mm512_load_si512(U_INDEX[j]), u); /* column k */
        const __m512i ck1 = _mm512_maskz_permutexvar_epi8(
            LOW_BYTES, _mm512_load_si512(U_INDEX[2 + j]), u); /* column k + 1 */
        const __m512i fk = _mm512_castps_si512(_mm512_cvtepi32_ps(ck));
        const __m512i fk1 = _mm512_castps_si512(_mm512_cvtepi32_ps(ck1));
        w[j] = _mm512_ternarylogic_epi32(fk1, _mm512_srli_epi32(fk, 16),
                                         _mm512_set1_epi32((int)0xFFFF0000u), SELECT);
    }
}

/* Half HALF (rows 32 HALF .. 32 HALF + 31) of group g of one tile for MR rows of x, added into
 * out[m][64] (fp32): a over the group's column pairs in order, then out += s a - 128 s sx. */
static inline __attribute__((always_inline)) void half_u(
    const uint8_t *tile, const Scales *sz, int64_t row0, const uint16_t *x, int64_t ldx,
    int64_t K, int64_t g, int64_t groups, const float *xsum, float *out, const int MR,
    const int GS, const int HALF) {
    __m512 a[8][2];
    for (int m = 0; m < MR; m++) a[m][0] = a[m][1] = _mm512_setzero_ps();
    for (int kp = 0; kp < GS / 2; kp++) {
        const uint8_t *ph = tile + (g * GS + 2 * kp) * 32, *pl = ph + K * 32;
        if (HALF == 0) { /* the same lines of the next tile */
            _mm_prefetch((const char *)ph + 2 * K * 32, STREAM_HINT);
            _mm_prefetch((const char *)pl + 2 * K * 32, STREAM_HINT);
        }
        __m512i w[2];
        u_pairs(_mm512_loadu_si512(ph), _mm512_loadu_si512(pl), HALF, w);
        for (int m = 0; m < MR; m++) {
            int32_t pair;
            __builtin_memcpy(&pair, x + m * ldx + g * GS + 2 * kp, 4);
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
            for (int r = 0; r < 2; r++) a[m][r] = _mm512_dpbf16_ps(a[m][r], (__m512bh)w[r], xb);
        }
    }
    for (int r = 0; r < 2; r++) {
        const int64_t row = row0 + 32 * HALF + 16 * r;
        const __m512 s = _mm512_cvtph_ps(
            _mm256_loadu_si256((const __m256i *)(sz->p + g * sz->n_pad + row)));
        const __m512 zz = _mm512_mul_ps(s, _mm512_set1_ps(-128.0f));
        for (int m = 0; m < MR; m++) {
            float *o = out + m * TILE + 32 * HALF + 16 * r;
            __m512 y = _mm512_fmadd_ps(s, a[m][r], _mm512_loadu_ps(o));
            y = _mm512_fmadd_ps(zz, _mm512_set1_ps(xsum[m * groups + g]), y);
            _mm512_storeu_ps(o, y);
        }
    }
}

/* Group g of NT (1 or 2) consecutive tiles for one row of x, both halves at once (4 NT
 * independent sums, each line loaded once), added into out[i][64] (fp32): the same sums, in
 * the same order, as half_u. */
static inline __attribute__((always_inline)) void group_u1(
    const uint8_t *tile, int64_t tile_bytes, const Scales *sz, int64_t row0, const uint16_t *x,
    int64_t K, int64_t g, int64_t groups, const float *xsum, float *out, const int NT,
    const int GS) {
    __m512 a[2][4];
    for (int i = 0; i < NT; i++)
        for (int r = 0; r < 4; r++) a[i][r] = _mm512_setzero_ps();
    for (int kp = 0; kp < GS / 2; kp++) {
        int32_t pair;
        __builtin_memcpy(&pair, x + g * GS + 2 * kp, 4);
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
        for (int i = 0; i < NT; i++) {
            const uint8_t *ph = tile + i * tile_bytes + (g * GS + 2 * kp) * 32, *pl = ph + K * 32;
            _mm_prefetch((const char *)ph + NT * tile_bytes, STREAM_HINT);
            _mm_prefetch((const char *)pl + NT * tile_bytes, STREAM_HINT);
            const __m512i h = _mm512_loadu_si512(ph), l = _mm512_loadu_si512(pl);
            __m512i w[4];
            u_pairs(h, l, 0, w);
            u_pairs(h, l, 1, w + 2);
            for (int r = 0; r < 4; r++) a[i][r] = _mm512_dpbf16_ps(a[i][r], (__m512bh)w[r], xb);
        }
    }
    for (int i = 0; i < NT; i++)
        for (int r = 0; r < 4; r++) {
            const int64_t row = row0 + i * TILE + 16 * r;
            const __m512 s = _mm512_cvtph_ps(
                _mm256_loadu_si256((const __m256i *)(sz->p + g * sz->n_pad + row)));
            const __m512 zz = _mm512_mul_ps(s, _mm512_set1_ps(-128.0f));
            float *o = out + i * TILE + 16 * r;
            __m512 y = _mm512_fmadd_ps(s, a[i][r], _mm512_loadu_ps(o));
            y = _mm512_fmadd_ps(zz, _mm512_set1_ps(xsum[g]), y);
            _mm512_storeu_ps(o, y);
        }
}

/* NT (1 or 2) consecutive tiles for one row of x -> out[i][64] (fp32) */
static inline __attribute__((always_inline)) void tiles_u1(
    const uint8_t *tile, int64_t tile_bytes, const Scales *sz, int64_t row0, const uint16_t *x,
    int64_t K, int64_t groups, const float *xsum, float *out, const int NT, const int GS) {
    for (int i = 0; i < NT * TILE; i += 16) _mm512_storeu_ps(out + i, _mm512_setzero_ps());
    for (int64_t g = 0; g < K / GS; g++) {
        if ((g + PREFETCH_GROUPS) * GS < K)
            for (int i = 0; i < NT; i++) {
                const char *ps =
                    (const char *)(sz->p + (g + PREFETCH_GROUPS) * sz->n_pad + row0 + i * TILE);
                _mm_prefetch(ps, STREAM_HINT);
                _mm_prefetch(ps + 64, STREAM_HINT);
            }
        group_u1(tile, tile_bytes, sz, row0, x, K, g, groups, xsum, out, NT, GS);
    }
}

/* One 64-row tile for MR (1, 2, 4 or 8) rows of x -> out[m][64] (fp32) */
static inline __attribute__((always_inline)) void tile_u(
    const uint8_t *tile, const Scales *sz, int64_t row0, const uint16_t *x, int64_t ldx,
    int64_t K, int64_t groups, const float *xsum, float *out, const int MR, const int GS) {
    for (int i = 0; i < MR * TILE; i += 16) _mm512_storeu_ps(out + i, _mm512_setzero_ps());
    for (int64_t g = 0; g < K / GS; g++) {
        if ((g + PREFETCH_GROUPS) * GS < K) {
            const char *ps = (const char *)(sz->p + (g + PREFETCH_GROUPS) * sz->n_pad + row0);
            _mm_prefetch(ps, STREAM_HINT);
            _mm_prefetch(ps + 64, STREAM_HINT);
        }
        half_u(tile, sz, row0, x, ldx, K, g, groups, xsum, out, MR, GS, 0);
        half_u(tile, sz, row0, x, ldx, K, g, groups, xsum, out, MR, GS, 1);
    }
}

/* Tiles t0 .. t1 - 1 for the M rows of x, groups of GS columns (operands of int4_mm_u8) */
static inline __attribute__((always_inline)) void tile_range_u(
    const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *packed,
    const Scales *sz, int64_t N, const float *xsum, uint16_t *y, int64_t ldy, const int GS,
    int64_t t0, int64_t t_end) {
    const int64_t groups = 2 * K / GS, tile_bytes = 2 * K * 32;
    float out[8 * TILE];
    for (int64_t t = t0; t < t_end && M == 1; t += 2) {
        /* one row: tiles two at a time (8 independent sums hide the products' latency) */
        const int64_t nt = t_end - t < 2 ? t_end - t : 2;
        if (nt == 2)
            tiles_u1(packed + t * tile_bytes, tile_bytes, sz, t * TILE, x, K, groups, xsum,
                     out, 2, GS);
        else
            tiles_u1(packed + t * tile_bytes, tile_bytes, sz, t * TILE, x, K, groups, xsum,
                     out, 1, GS);
        for (int64_t i = 0; i < nt; i++) {
            const int64_t n0 = (t + i) * TILE, rows = N - n0 < TILE ? N - n0 : TILE;
            for (int64_t r = 0; r < rows; r += 16)
                store_floats_bf16(out + i * TILE + r, y + n0 + r, rows - r);
        }
    }
    for (int64_t t = t0; t < t_end && M > 1; t++) {
        const uint8_t *tile = packed + t * tile_bytes;
        const int64_t n0 = t * TILE, rows = N - n0 < TILE ? N - n0 : TILE;
        for (int64_t m = 0; m < M;) {
            const int64_t mr = M - m >= 8 ? 8 : M - m >= 4 ? 4 : M - m >= 2 ? 2 : 1;
            const uint16_t *xm = x + m * ldx;
            const float *xs = xsum + m * groups;
            if (mr == 8)
                tile_u(tile, sz, n0, xm, ldx, K, groups, xs, out, 8, GS);
            else if (mr == 4)
                tile_u(tile, sz, n0, xm, ldx, K, groups, xs, out, 4, GS);
            else if (mr == 2)
                tile_u(tile, sz, n0, xm, ldx, K, groups, xs, out, 2, GS);
            else
                tile_u(tile, sz, n0, xm, ldx, K, groups, xs, out, 1, GS);
            for (int64_t j = 0; j < mr; j++)
                for (int64_t r = 0; r < rows; r += 16)
                    store_floats_bf16(out + j * TILE + r, y + (m + j) * ldy + n0 + r, rows - r);
            m += mr;
        }
    }
}

/* Thread id's tiles among nth (operands of int4_mm_u8): its share, then what it takes of the
 * others' (share_next with the team's `ranges`; NULL: its share); one row of x two tiles at a
 * time, more rows tile by tile */
static inline __attribute__((always_inline)) void tile_share_u(
    const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *packed,
    const Scales *sz, int64_t N, int64_t n_pad, const float *xsum, uint16_t *y, int64_t ldy,
    const int GS, int64_t *ranges, int64_t nth, int64_t id) {
    Share share = share_of(ranges, n_pad / TILE, M == 1 ? 2 : 1, nth, id);
    int64_t t0, t1;
    while (share_next(&share, &t0, &t1))
        tile_range_u(x, M, K, ldx, packed, sz, N, xsum, y, ldy, GS, t0, t1);
}

/* All tiles, shared by the calling team (cpu_team.h) or by a team of their own */
static inline __attribute__((always_inline)) void tile_loop_u(
    const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *packed,
    const Scales *sz, int64_t N, int64_t n_pad, const float *xsum, uint16_t *y, int64_t ldy,
    const int GS, int64_t *claim) {
    SHARE_OWN(own, claim);
    int64_t *ranges = share_ranges(claim, own);
    TEAM_RUN(nth, id, tile_share_u(x, M, K, ldx, packed, sz, N, n_pad, xsum, y, ldy, GS, ranges,
                                   nth, id));
}

void int4_mm_u8(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *packed,
                const Scales *sz, int64_t N, int64_t n_pad, const float *xsum, uint16_t *y,
                int64_t ldy, int64_t gs, int64_t *claim) {
    if (gs == 32)
        tile_loop_u(x, M, K, ldx, packed, sz, N, n_pad, xsum, y, ldy, 32, claim);
    else
        tile_loop_u(x, M, K, ldx, packed, sz, N, n_pad, xsum, y, ldy, 16, claim);
}
