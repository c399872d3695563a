/* x's rows as the integer paths of int4_mm read them (cpu_int4_avx2_int.c: 16-bit pairs;
 * cpu_int4_vnni.c: two byte planes): each group of gs columns of a row rounded to 16-bit
 * integers on a power-of-two scale (round_group, or round_group_split with 16 lanes: the same
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
/* round_group with 16 lanes (the AVX-512 build), writing v's bytes h and l instead of v: the
 * same operations lane for lane, so the same integers, xs and sxr */
static inline void round_group_split(const uint16_t *x, const int gs, int8_t *h, uint8_t *l,
                                     float *xs, float *sxr) {
    __m512 f[2];
    __m512i top = _mm512_setzero_si512();
    for (int i = 0; i < gs / 16; i++) {
        f[i] = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(x + 16 * i))), 16));
        top = _mm512_max_epi32(top, _mm512_and_si512(_mm512_castps_si512(f[i]),
                                                     _mm512_set1_epi32(0x7FFFFFFF)));
    }
    const uint32_t bits = (uint32_t)_mm512_reduce_max_epi32(top);
    if (bits == 0 || bits >= 0x7F800000u) {
        __builtin_memset(h, 0, (size_t)gs);
        __builtin_memset(l, 0, (size_t)gs);
        *xs = *sxr = bits ? __builtin_nanf("") : 0.0f;
        return;
    }
    int E = (int)(bits >> 23) - 127;
    if (E < -126) E = -126;
    const int e = 14 - E, e1 = e / 2;
    const __m512 p1 = _mm512_set1_ps(pow2f(e1)), p2 = _mm512_set1_ps(pow2f(e - e1));
    __m512i sum = _mm512_setzero_si512();
    for (int i = 0; i < gs / 16; i++) {
        const __m512i a = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_mul_ps(f[i], p1), p2));
        sum = _mm512_add_epi32(sum, a);
        _mm_storeu_si128((__m128i *)(h + 16 * i), _mm512_cvtepi32_epi8(_mm512_srai_epi32(a, 8)));
        _mm_storeu_si128((__m128i *)(l + 16 * i),
                         _mm512_cvtepi32_epi8(_mm512_and_si512(a, _mm512_set1_epi32(0xFF))));
    }
    *xs = pow2f(E - 14);
    *sxr = *xs * (float)_mm512_reduce_add_epi32(sum);
}
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
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < groups; g++) {
            const int64_t at = m * K + g * gs;
            const uint16_t *xg = x + m * ldx + g * gs;
            float *xs = r->xs + m * groups + g, *sxr = r->sxr + m * groups + g;
#ifdef __AVX512F__
            if (split) {
                round_group_split(xg, (int)gs, r->h + at, r->l + at, xs, sxr);
                continue;
            }
#endif
            round_group(xg, (int)gs, r->v + at, xs, sxr);
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
