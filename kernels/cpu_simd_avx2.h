/* bf16 <-> fp32 vector helpers and e^x of the AVX2 build (AVX2 + FMA + F16C, 8 fp32 lanes):
 * the counterparts of cpu_simd.h, with the same rounding. There is no bf16 instruction here:
 * bf16 -> fp32 is a 16-bit shift (exact), fp32 -> bf16 an integer round to nearest even. */
#ifndef LOCALLLM_CPU_SIMD_AVX2_H
#define LOCALLLM_CPU_SIMD_AVX2_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

/* acc + the products of a and b's 16-bit pairs, summed a pair to a 32-bit lane: one vpdpwssd
 * where the CPU has AVX-VNNI (the avx2_vnni build), else vpmaddwd and vpaddd. The same int32
 * in both: each wraps modulo 2^32, and a pair's sum is exact below that. */
static inline __attribute__((always_inline)) __m256i dot_pairs(__m256i acc, __m256i a,
                                                               __m256i b) {
#ifdef __AVXVNNI__
    return _mm256_dpwssd_avx_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

/* 8 bf16 values -> fp32, exactly */
static inline __m256 load8_bf16(const uint16_t *p) {
    const __m128i v = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

/* the first n (capped at 8) bf16 values -> fp32, the rest 0 */
static inline __m256 load_bf16_n(const uint16_t *p, int64_t n) {
    if (n >= 8) return load8_bf16(p);
    uint16_t t[8] = {0};
    memcpy(t, p, (size_t)n * 2);
    return load8_bf16(t);
}

/* fp32 -> bf16 bits in the low half of each 32-bit lane: round to nearest even, NaN kept
 * quiet (as PyTorch's conversion) */
static inline __m256i bf16_bits(__m256 v) {
    const __m256i b = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7FFF)), lsb), 16);
    const __m256i nan = _mm256_or_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(0x40));
    return _mm256_blendv_epi8(r, nan, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}

/* fp32 -> 8 bf16 values at p */
static inline void store8_bf16(uint16_t *p, __m256 v) {
    const __m256i b = bf16_bits(v);
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(b),
                                            _mm256_extracti128_si256(b, 1));
    _mm_storeu_si128((__m128i *)p, packed);
}

/* the first n (capped at 8) lanes of v -> bf16 at p */
static inline void store_bf16_n(uint16_t *p, __m256 v, int64_t n) {
    if (n >= 8) {
        store8_bf16(p, v);
        return;
    }
    uint16_t t[8];
    store8_bf16(t, v);
    memcpy(p, t, (size_t)n * 2);
}

/* lane mask of the first n (capped at 8) lanes, for maskload / maskstore */
static inline __m256i lanes_n(int64_t n) {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n >= 8 ? 8 : (int)n), idx);
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* hsum8 of 8 vectors at once: lane i of the result is hsum8(v[i]), its adds in hsum8's order
 * (so the same bits): 21 operations where 8 hsum8 take 48 */
static inline __m256 hsum8x8(const __m256 v[8]) {
    __m256 a[4]; /* lane i < 4: v[k]'s lanes i + (i + 4); i >= 4: v[k + 4]'s */
    for (int k = 0; k < 4; k++)
        a[k] = _mm256_add_ps(_mm256_permute2f128_ps(v[k], v[k + 4], 0x20),
                             _mm256_permute2f128_ps(v[k], v[k + 4], 0x31));
    /* (0 + 2, 1 + 3) of two vectors' halves: [a0's, a1's | their upper halves'] */
    const __m256 e01 = _mm256_add_ps(_mm256_shuffle_ps(a[0], a[1], 0x44),
                                     _mm256_shuffle_ps(a[0], a[1], 0xEE));
    const __m256 e23 = _mm256_add_ps(_mm256_shuffle_ps(a[2], a[3], 0x44),
                                     _mm256_shuffle_ps(a[2], a[3], 0xEE));
    return _mm256_add_ps(_mm256_shuffle_ps(e01, e23, 0x88), _mm256_shuffle_ps(e01, e23, 0xDD));
}

static inline float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 2^n for integer-valued n in [-64, 64] */
static inline __m256 pow2_small(__m256 n) {
    const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
}

/* e^x for x in [-88, 88] (clamped): exp512's polynomial and reduction; 2^n applied in two
 * halves so that results below 2^-126 come out as scalef's would */
static inline __m256 exp256(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.0f)), _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256 n1 = _mm256_floor_ps(_mm256_mul_ps(n, _mm256_set1_ps(0.5f)));
    return _mm256_mul_ps(_mm256_mul_ps(p, pow2_small(n1)), pow2_small(_mm256_sub_ps(n, n1)));
}

/* out[i] = bf16(bf16(silu(g[i])) * u[i]) for i < inter, u = g + inter (as silu_mul_row) */
static inline void silu_mul_row8(const uint16_t *g, int64_t inter, uint16_t *out) {
    const uint16_t *u = g + inter;
    for (int64_t i = 0; i < inter; i += 8) {
        const __m256 gv = load_bf16_n(g + i, inter - i);
        const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv));
        const __m256 s = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
        const __m256 sr = _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(s), 16));
        store_bf16_n(out + i, _mm256_mul_ps(sr, load_bf16_n(u + i, inter - i)), inter - i);
    }
}

#endif
