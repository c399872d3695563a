/* The integer path of the AVX2 build's int4 matmul (AVX2 + FMA + F16C): weights without a
 * codebook, on the packed layout and formula of cpu_int4.h. Each group of gs columns of a row
 * of x is rounded to 16-bit integers v on a power-of-two scale xs (round_group: every value
 * within 2^7 of the group's largest keeps all its bits, smaller ones round to a multiple of xs,
 * below 2^-15 of the largest), and per group and output row
 *     A = sum_k v[k] c[n, k]   (vpmaddwd: exact in int32),  a = A xs,  sxr = xs sum_k v[k]
 *     sum_k x (c - 8) s + z x  =  s a + (z - 8 s) sxr
 * then y = fma(s, a, y), y = fma(zz, sxr, y), group by group. On Zen 2 a 16-bit product pair
 * costs what one fp32 FMA does (one vpmaddwd a cycle, two FMAs), and the codes need no
 * conversion to fp32 (one vcvtdq2ps a cycle bound the fp32 path): a one-row matmul takes about
 * 0.6 of the time it did in fp32 FMAs. vpmaddwd multiplies each code's whole byte (lo + 16 hi)
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
#include "cpu_team.h"
#include "cpu_simd_avx2.h"

/* x's rows as the integer path reads them: each group of gs columns of a row rounded to 16-bit
 * integers on a power-of-two scale (round_group) */
typedef struct {
    int16_t *v;      /* [M][K] */
    float *xs, *sxr; /* [M][K / gs]: the group's scale, and xs * (the sum of its v) */
} IntRows;

/* Bytes of IntRows a call keeps on its own stack. A team's call must not fail on one thread
 * alone (cpu_layers.c), so a team's rows always fit: decode_layers runs a team only where
 * M * 2 * K / 16 <= XSUM_ROOM, so M K <= 8 XSUM_ROOM, and M rows take at most 2.5 M K + 31
 * bytes (int_rows_bytes). */
#define INT_ROOM (20 * XSUM_ROOM + 64)

static inline float pow2f(int e) { /* 2^e, -149 <= e <= 127 */
    const uint32_t bits = e >= -126 ? (uint32_t)(e + 127) << 23 : 1u << (e + 149);
    float f;
    __builtin_memcpy(&f, &bits, 4);
    return f;
}

/* One group of gs (16, 32) bf16 values at x -> v (int16 [gs]), *xs and *sxr. With 2^E <= max |x|
 * < 2^(E+1): v = rint(x 2^(14 - E)), |v| <= 32640, and xs = 2^(E - 14). Every value within 2^7
 * of the group's largest keeps all its bits (bf16 has 8 significant bits); smaller ones round to
 * a multiple of xs, less than 2^-15 of the largest. A group of zeros: v = 0, xs = 0; one with an
 * inf or a NaN: v = 0 and xs = NaN, so that its outputs are NaN. */
static inline void round_group(const uint16_t *x, const int gs, int16_t *v, float *xs,
                               float *sxr) {
    __m256 f[4];
    __m256i top = _mm256_setzero_si256(); /* the largest |x| as bits: integers order them */
    for (int i = 0; i < gs / 8; i++) {
        f[i] = load8_bf16(x + 8 * i);
        top = _mm256_max_epi32(top, _mm256_and_si256(_mm256_castps_si256(f[i]),
                                                     _mm256_set1_epi32(0x7FFFFFFF)));
    }
    __m128i t = _mm_max_epi32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1));
    t = _mm_max_epi32(t, _mm_shuffle_epi32(t, 0x4E));
    t = _mm_max_epi32(t, _mm_shuffle_epi32(t, 0xB1));
    const uint32_t bits = (uint32_t)_mm_cvtsi128_si32(t);
    if (bits == 0 || bits >= 0x7F800000u) {
        __builtin_memset(v, 0, (size_t)gs * 2);
        *xs = *sxr = bits ? __builtin_nanf("") : 0.0f;
        return;
    }
    int E = (int)(bits >> 23) - 127;
    if (E < -126) E = -126; /* a subnormal largest value */
    const int e = 14 - E, e1 = e / 2;
    /* two exact scalings: 2^e alone may not be a float */
    const __m256 p1 = _mm256_set1_ps(pow2f(e1)), p2 = _mm256_set1_ps(pow2f(e - e1));
    __m256i sum = _mm256_setzero_si256();
    for (int i = 0; i < gs / 8; i += 2) {
        const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_mul_ps(f[i], p1), p2));
        const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_mul_ps(f[i + 1], p1), p2));
        sum = _mm256_add_epi32(sum, _mm256_add_epi32(a, b));
        const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
        _mm256_storeu_si256((__m256i *)(v + 8 * i), w);
    }
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    *xs = pow2f(E - 14);
    *sxr = *xs * (float)_mm_cvtsi128_si32(s);
}

/* The bytes of round_rows_int's v for M rows of K columns (whole 32-byte lines), and of all it
 * writes */
static inline int64_t int_v_bytes(int64_t M, int64_t K) { return (M * K * 2 + 31) / 32 * 32; }
static inline size_t int_rows_bytes(int64_t M, int64_t K, int64_t gs) {
    return (size_t)(int_v_bytes(M, K) + 2 * M * (K / gs) * (int64_t)sizeof(float));
}

/* The M rows of x (bf16 [M][ldx], K columns) rounded per group of gs into mem
 * (int_rows_bytes), which r then describes */
static void round_rows_int(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, int64_t gs,
                           void *mem, IntRows *r) {
    const int64_t groups = K / gs;
    r->v = mem;
    r->xs = (float *)((char *)mem + int_v_bytes(M, K));
    r->sxr = r->xs + M * groups;
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < groups; g++)
            round_group(x + m * ldx + g * gs, (int)gs, r->v + m * K + g * gs,
                        r->xs + m * groups + g, r->sxr + m * groups + g);
}

/* Where round_rows_int writes `bytes`: room (INT_ROOM bytes on the caller's stack) where they
 * fit, else (outside a team: a prompt's slab, INT_SLAB_BYTES at most, or a batch too large for
 * a team) a buffer of the calling thread's own, grown as needed and kept. Freed after each
 * call, a prompt's rounded rows stayed resident anyway (glibc raises its mmap threshold to the
 * largest block freed). NULL when out of memory. */
static __thread void *int_buf;
static __thread size_t int_buf_bytes;
static void *int_rows_memory(size_t bytes, void *room) {
    if (bytes <= INT_ROOM) return room;
    if (bytes > int_buf_bytes) {
        free(int_buf);
        int_buf = aligned_alloc(32, (bytes + 31) / 32 * 32);
        int_buf_bytes = int_buf ? bytes : 0;
    }
    return int_buf;
}

/* rows of x one pass of int4_mm rounds and multiplies outside a team: a prompt's rows in slabs
 * whose rounded rows take at most INT_SLAB_BYTES (each slab reads the weights again: 512 rows
 * of 1536 columns take 8 slabs; bench_cpu's prefill measured the same within its runs'
 * spread) */
#define INT_SLAB_BYTES (256 * 1024)
static inline int64_t int_slab_rows(int64_t K, int64_t gs) {
    const int64_t rows = INT_SLAB_BYTES / (int64_t)int_rows_bytes(1, K, gs) / 8 * 8;
    return rows > 8 ? rows : 8;
}

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
                a[2 * r * Q + i] = _mm256_add_epi32(a[2 * r * Q + i], _mm256_madd_epi16(wb[i], xv));
                a[(2 * r + 1) * Q + i] =
                    _mm256_add_epi32(a[(2 * r + 1) * Q + i], _mm256_madd_epi16(wh[i], xv));
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
        round_rows_int(x + m0 * ldx, ms, K, ldx, gs, mem, &xr);
        if (m0 && ranges == own) memset(own, 0, sizeof(int64_t) * (size_t)(own_n * SHARE_LINE));
        TEAM_RUN(nth, id, tile_share_int(&xr, ms, K, packed, sz, N, n_pad, K2, y + m0 * ldy,
                                         ldy, gs, ranges, nth, id));
    }
    return 0;
}
