/* x's rows as the integer paths of int4_mm read them (cpu_int4_avx2_int.c: 16-bit pairs;
 * cpu_int4_vnni.c: two byte planes): each group of gs columns of a row rounded to 16-bit
 * integers on a power-of-two scale (round_group, or round_groups_split with 16 lanes: the same
 * operations lane for lane), where they are kept, and the slabs a prompt is rounded in. Both
 * builds give a row the same integers. */
#ifndef LOCALLLM_CPU_INT4_XINT_H
#define LOCALLLM_CPU_INT4_XINT_H

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu_int4_groups.h"
#include "cpu_simd_avx2.h"

/* x's rounded rows: v = 256 h + l, kept whole (AVX2 build) or as its two bytes (`split`) */
typedef struct {
    int16_t *v;      /* [M][K], or NULL when split */
    int8_t *h;       /* split: [M][K], v >> 8 (-128..127) */
    uint8_t *l;      /* split: [M][K], v & 255 */
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

#ifdef __AVX512F__
/* 16 int32 vectors t[0..15] -> one vector whose lane i is op over the lanes of t[i] (op: max
 * or add, associative and commutative on integers): four levels of shuffles */
#define REDUCE16(t, op, out)                                                                   \
    do {                                                                                       \
        __m512i r1_[8], r2_[4], r3_[2];                                                        \
        for (int i_ = 0; i_ < 8; i_++) /* 128-bit chunks 0, 1: t[i]'s; 2, 3: t[i + 8]'s */     \
            r1_[i_] = op(_mm512_shuffle_i32x4(t[i_], t[i_ + 8], 0x44),                         \
                         _mm512_shuffle_i32x4(t[i_], t[i_ + 8], 0xEE));                        \
        for (int i_ = 0; i_ < 4; i_++) /* chunks: t[i], t[i + 8], t[i + 4], t[i + 12] */        \
            r2_[i_] = op(_mm512_shuffle_i32x4(r1_[i_], r1_[i_ + 4], 0x88),                     \
                         _mm512_shuffle_i32x4(r1_[i_], r1_[i_ + 4], 0xDD));                    \
        for (int i_ = 0; i_ < 2; i_++) /* a chunk's lanes 0-1: t[i + c]'s, 2-3: t[i + 2 + c]'s */ \
            r3_[i_] = op(_mm512_unpacklo_epi64(r2_[i_], r2_[i_ + 2]),                          \
                         _mm512_unpackhi_epi64(r2_[i_], r2_[i_ + 2]));                         \
        const __m512i lo_ = _mm512_unpacklo_epi32(r3_[0], r3_[1]); /* a0 b0 a1 b1 */          \
        const __m512i hi_ = _mm512_unpackhi_epi32(r3_[0], r3_[1]); /* a2 b2 a3 b3 */          \
        const __m512i r4_ = op(_mm512_unpacklo_epi64(lo_, hi_),                                \
                               _mm512_unpackhi_epi64(lo_, hi_)); /* 0-3, 8-11, 4-7, 12-15 */  \
        out = _mm512_shuffle_i32x4(r4_, r4_, 0xD8);                                            \
    } while (0)

/* vpermt2b indices: byte 0 of each of the 32 int32 of two vectors, then byte 1 of each (of one
 * vector: bytes 0 of its 16, then bytes 1) */
#define SPLIT_BYTES(b) 4 * 0 + (b), 4 * 1 + (b), 4 * 2 + (b), 4 * 3 + (b), 4 * 4 + (b), \
    4 * 5 + (b), 4 * 6 + (b), 4 * 7 + (b), 4 * 8 + (b), 4 * 9 + (b), 4 * 10 + (b), 4 * 11 + (b), \
    4 * 12 + (b), 4 * 13 + (b), 4 * 14 + (b), 4 * 15 + (b)
static const uint8_t SPLIT_INDEX[2][64] __attribute__((aligned(64))) = {
    {SPLIT_BYTES(0), SPLIT_BYTES(1), SPLIT_BYTES(0), SPLIT_BYTES(1)},
    {SPLIT_BYTES(0), SPLIT_BYTES(64), SPLIT_BYTES(1), SPLIT_BYTES(65)}};
#undef SPLIT_BYTES

/* gs (16, 32) bf16 values at x -> fp32, gs / 16 vectors */
static inline __attribute__((always_inline)) void load_group16(const uint16_t *x, const int gs,
                                                              __m512 f[2]) {
    for (int i = 0; i < gs / 16; i++)
        f[i] = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(x + 16 * i))), 16));
}

/* round_group for n (1-16) consecutive groups of gs at x, with 16 lanes (the AVX-512 build):
 * the same operations lane for lane, so the same integers, xs and sxr, written as v's bytes h
 * and l (int8 and uint8 [n gs]), xs[n] and sxr[n]. The groups' largest values, exponents and
 * sums are taken 16 groups to a vector (a group at a time, the reductions and scalar steps
 * took most of the time). */
static inline __attribute__((always_inline)) void round_groups_split(
    const uint16_t *x, const int gs, int n, int8_t *h, uint8_t *l, float *xs, float *sxr) {
    const __m512i abs_bits = _mm512_set1_epi32(0x7FFFFFFF);
    __m512i t[16];
    for (int i = 0; i < 16; i++) {
        t[i] = _mm512_setzero_si512();
        if (i >= n) continue;
        __m512 f[2];
        load_group16(x + i * gs, gs, f);
        for (int k = 0; k < gs / 16; k++)
            t[i] = _mm512_max_epi32(t[i], _mm512_and_si512(_mm512_castps_si512(f[k]), abs_bits));
    }
    __m512i bits; /* lane i: the largest |x| of group i as bits (0 past n) */
    REDUCE16(t, _mm512_max_epi32, bits);
    const __mmask16 odd = _mm512_cmpeq_epi32_mask(bits, _mm512_setzero_si512()) |
                          _mm512_cmpge_epi32_mask(bits, _mm512_set1_epi32(0x7F800000));
    const __m512i E = _mm512_max_epi32(
        _mm512_sub_epi32(_mm512_srli_epi32(bits, 23), _mm512_set1_epi32(127)),
        _mm512_set1_epi32(-126));
    const __m512i e = _mm512_sub_epi32(_mm512_set1_epi32(14), E);
    /* e / 2 as C divides: toward zero */
    const __m512i e1 = _mm512_srai_epi32(_mm512_add_epi32(e, _mm512_srli_epi32(e, 31)), 1);
    const __m512i bias = _mm512_set1_epi32(127);
    float p1[16], p2[16];
    _mm512_storeu_si512(p1, _mm512_slli_epi32(_mm512_add_epi32(e1, bias), 23));
    _mm512_storeu_si512(p2, _mm512_slli_epi32(_mm512_add_epi32(_mm512_sub_epi32(e, e1), bias), 23));
    for (int i = 0; i < 16; i++) {
        t[i] = _mm512_setzero_si512();
        if (i >= n) continue;
        if (odd >> i & 1) {
            __builtin_memset(h + i * gs, 0, (size_t)gs);
            __builtin_memset(l + i * gs, 0, (size_t)gs);
            continue;
        }
        __m512 f[2];
        load_group16(x + i * gs, gs, f);
        const __m512 q1 = _mm512_set1_ps(p1[i]), q2 = _mm512_set1_ps(p2[i]);
        __m512i a[2];
        for (int k = 0; k < gs / 16; k++) {
            a[k] = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_mul_ps(f[k], q1), q2));
            t[i] = _mm512_add_epi32(t[i], a[k]);
        }
        /* |v| <= 32640: l and h are bytes 0 and 1 of each int32 */
        if (gs == 32) {
            const __m512i b = _mm512_permutex2var_epi8(a[0], _mm512_load_si512(SPLIT_INDEX[1]), a[1]);
            _mm256_storeu_si256((__m256i *)(l + i * gs), _mm512_castsi512_si256(b));
            _mm256_storeu_si256((__m256i *)(h + i * gs), _mm512_extracti64x4_epi64(b, 1));
        } else {
            const __m512i b = _mm512_permutexvar_epi8(_mm512_load_si512(SPLIT_INDEX[0]), a[0]);
            _mm_storeu_si128((__m128i *)(l + i * gs), _mm512_castsi512_si128(b));
            _mm_storeu_si128((__m128i *)(h + i * gs), _mm512_extracti32x4_epi32(b, 1));
        }
    }
    __m512i sum;
    REDUCE16(t, _mm512_add_epi32, sum);
    /* xs = 2^(E - 14): a normal float's bits, or below 2^-126 the subnormal's */
    const __m512i ex = _mm512_sub_epi32(E, _mm512_set1_epi32(14));
    const __m512i sub = _mm512_sllv_epi32(_mm512_set1_epi32(1),
                                          _mm512_add_epi32(ex, _mm512_set1_epi32(149)));
    __m512 s = _mm512_castsi512_ps(_mm512_mask_blend_epi32(
        _mm512_cmpge_epi32_mask(ex, _mm512_set1_epi32(-126)), sub,
        _mm512_slli_epi32(_mm512_add_epi32(ex, bias), 23)));
    __m512 r = _mm512_mul_ps(s, _mm512_cvtepi32_ps(sum));
    /* a group of zeros: 0; one with an inf or a NaN: NaN */
    const __m512 odd_value = _mm512_castsi512_ps(_mm512_maskz_mov_epi32(
        _mm512_cmpneq_epi32_mask(bits, _mm512_setzero_si512()), _mm512_set1_epi32(0x7FC00000)));
    s = _mm512_mask_blend_ps(odd, s, odd_value);
    r = _mm512_mask_blend_ps(odd, r, odd_value);
    const __mmask16 keep = (__mmask16)((1u << n) - 1);
    _mm512_mask_storeu_ps(xs, keep, s);
    _mm512_mask_storeu_ps(sxr, keep, r);
}
#undef REDUCE16
#endif

/* The bytes of round_rows_int's v (or h and l) for M rows of K columns (whole 32-byte lines),
 * and of all it writes */
static inline int64_t int_v_bytes(int64_t M, int64_t K) { return (M * K * 2 + 31) / 32 * 32; }
static inline size_t int_rows_bytes(int64_t M, int64_t K, int64_t gs) {
    return (size_t)(int_v_bytes(M, K) + 2 * M * (K / gs) * (int64_t)sizeof(float));
}

/* The M rows of x (bf16 [M][ldx], K columns) rounded per group of gs into mem
 * (int_rows_bytes), which r then describes: v whole, or (split, the AVX-512 build) its bytes
 * h and l */
static inline void round_rows_int(const uint16_t *x, int64_t M, int64_t K, int64_t ldx,
                                  int64_t gs, void *mem, int split, IntRows *r) {
    const int64_t groups = K / gs;
    r->v = split ? NULL : mem;
    r->h = split ? mem : NULL;
    r->l = split ? (uint8_t *)mem + M * K : NULL;
    r->xs = (float *)((char *)mem + int_v_bytes(M, K));
    r->sxr = r->xs + M * groups;
    for (int64_t m = 0; m < M; m++) {
#ifdef __AVX512F__
        if (split) {
            for (int64_t g = 0; g < groups; g += 16) {
                const int64_t at = m * K + g * gs, n = groups - g < 16 ? groups - g : 16;
                const uint16_t *xg = x + m * ldx + g * gs;
                float *xs = r->xs + m * groups + g, *sxr = r->sxr + m * groups + g;
                if (gs == 32)
                    round_groups_split(xg, 32, (int)n, r->h + at, r->l + at, xs, sxr);
                else
                    round_groups_split(xg, 16, (int)n, r->h + at, r->l + at, xs, sxr);
            }
            continue;
        }
#endif
        for (int64_t g = 0; g < groups; g++)
            round_group(x + m * ldx + g * gs, (int)gs, r->v + m * K + g * gs,
                        r->xs + m * groups + g, r->sxr + m * groups + g);
    }
}

/* Where round_rows_int writes `bytes`: room (INT_ROOM bytes on the caller's stack) where they
 * fit, else (outside a team: a prompt's slab, INT_SLAB_BYTES at most, or a batch too large for
 * a team) a buffer of the calling thread's own, grown as needed and kept. Freed after each
 * call, a prompt's rounded rows stayed resident anyway (glibc raises its mmap threshold to the
 * largest block freed). NULL when out of memory. */
static __thread void *int_buf;
static __thread size_t int_buf_bytes;
static inline void *int_rows_memory(size_t bytes, void *room) {
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

#endif
