/* int4_rows_half: whole rows of a packed weight with fp16 scales (Q8_0, Q4_0, Q5_0: `half` in
 * cpu_int4_groups.h), dequantized in fp32 exactly as the source format does (scale * q, one
 * rounding), for an LM head's refined logits and embedding lookups; int4_refine_half's dot
 * products of x with such rows. In both builds, 16 columns at a time (AVX-512: one vector;
 * AVX2: two), each lane's arithmetic the same, so both give the same bits; layout in
 * cpu_int4.h. */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "cpu_kernels.h"
#include "cpu_team.h"

/* an fp16 value in fp32 (exact, subnormals included) */
static float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    uint32_t bits;
    if (exp == 0x1F)
        bits = sign | 0x7F800000u | (man << 13);
    else if (exp)
        bits = sign | ((exp + 112) << 23) | (man << 13);
    else if (!man)
        bits = sign;
    else { /* subnormal: man * 2^-24 */
        float f = (float)man * 0x1p-24f;
        memcpy(&bits, &f, 4);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Where row n's codes are (a row's byte of a column: one of 32 in that column's 32 bytes of
 * its tile; the high nibbles are rows 32-63): the aligned 4 bytes holding it, for gathers
 * that stay inside the column, and the shift that brings its nibble down. */
typedef struct {
    const uint8_t *hi, *lo; /* column 0's 4 bytes in plane 0 and (two planes) plane 1 */
    int shift;
} RowCodes;

static inline RowCodes row_codes(const uint8_t *packed, int64_t K, int64_t planes, int64_t n) {
    const uint8_t *hi = packed + (n / 64) * planes * K * 32 + (n % 32 & ~3);
    const RowCodes r = {hi, hi + K * 32, (int)(8 * (n % 4) + (n % 64 >= 32 ? 4 : 0))};
    return r;
}

/* columns ahead whose lines int4_refine_half prefetches: a candidate row's bytes lie one per
 * 32 through its tile, two columns a line, which the hardware prefetcher follows too late
 * (8 rows' 32 candidates: 60 -> 45 us warm, 250 -> 180 us with the caches flushed) */
#ifndef REFINE_AHEAD
#define REFINE_AHEAD 64
#endif

#ifdef __AVX512F__
typedef __m512 Vec16; /* 16 fp32 lanes: columns k0 .. k0 + 15 */

/* (float) q * s for columns k0 .. k0 + 15 of the row: q = c - 8 (one plane) or
 * 16 (c - 8) + l (two), c and l its nibbles */
static inline Vec16 row_values16(const RowCodes *r, int64_t planes, int64_t k0, float s) {
    const __m512i at = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
        _mm512_set1_epi32(32));
    const __m128i sh = _mm_cvtsi32_si128(r->shift);
    const __m512i m15 = _mm512_set1_epi32(15);
    __m512i q = _mm512_sub_epi32(
        _mm512_and_si512(_mm512_srl_epi32(_mm512_i32gather_epi32(at, r->hi + k0 * 32, 1), sh),
                         m15),
        _mm512_set1_epi32(8));
    if (planes == 2)
        q = _mm512_add_epi32(
            _mm512_slli_epi32(q, 4),
            _mm512_and_si512(
                _mm512_srl_epi32(_mm512_i32gather_epi32(at, r->lo + k0 * 32, 1), sh), m15));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(s));
}

static inline void store16(float *o, Vec16 v) { _mm512_storeu_ps(o, v); }

/* x[0..16) (bf16) in fp32 */
static inline Vec16 bf16_16(const uint16_t *x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)x)), 16));
}

static inline Vec16 zero16(void) { return _mm512_setzero_ps(); }
static inline Vec16 add16(Vec16 a, Vec16 b) { return _mm512_add_ps(a, b); }
static inline Vec16 mul16(Vec16 a, Vec16 b) { return _mm512_mul_ps(a, b); }
#else
typedef struct {
    __m256 lo, hi; /* columns k0 .. k0 + 7, k0 + 8 .. k0 + 15 */
} Vec16;

static inline __m256i codes8(const uint8_t *p, __m128i sh) {
    const __m256i at = _mm256_set_epi32(224, 192, 160, 128, 96, 64, 32, 0);
    return _mm256_and_si256(_mm256_srl_epi32(_mm256_i32gather_epi32((const int *)p, at, 1), sh),
                            _mm256_set1_epi32(15));
}

static inline __m256 values8(const RowCodes *r, int64_t planes, int64_t k0, __m256 s,
                             __m128i sh) {
    __m256i q = _mm256_sub_epi32(codes8(r->hi + k0 * 32, sh), _mm256_set1_epi32(8));
    if (planes == 2)
        q = _mm256_add_epi32(_mm256_slli_epi32(q, 4), codes8(r->lo + k0 * 32, sh));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(q), s);
}

static inline Vec16 row_values16(const RowCodes *r, int64_t planes, int64_t k0, float s) {
    const __m128i sh = _mm_cvtsi32_si128(r->shift);
    const __m256 sv = _mm256_set1_ps(s);
    const Vec16 v = {values8(r, planes, k0, sv, sh), values8(r, planes, k0 + 8, sv, sh)};
    return v;
}

static inline void store16(float *o, Vec16 v) {
    _mm256_storeu_ps(o, v.lo);
    _mm256_storeu_ps(o + 8, v.hi);
}

static inline __m256 bf16_8(const uint16_t *x) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)x)), 16));
}

static inline Vec16 bf16_16(const uint16_t *x) {
    const Vec16 v = {bf16_8(x), bf16_8(x + 8)};
    return v;
}

static inline Vec16 zero16(void) {
    const Vec16 v = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    return v;
}

static inline Vec16 add16(Vec16 a, Vec16 b) {
    const Vec16 v = {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)};
    return v;
}

static inline Vec16 mul16(Vec16 a, Vec16 b) {
    const Vec16 v = {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)};
    return v;
}
#endif

/* out[i][k] (fp32 [T][K]) = the weight of row ids[i] at column k: one plane, (c - 8) s; two
 * planes (q = 16 h + l), ((h - 8) 16 + l) s; s = sz[k / gs][row] (fp16 [K / gs][n_pad]). The
 * caller checks 0 <= ids[i] < rows and K a multiple of gs (16 or 32). */
void int4_rows_half(const uint8_t *packed, const uint16_t *sz, int64_t K, int64_t n_pad,
                    int64_t planes, int64_t gs, const int64_t *ids, int64_t T, float *out) {
    OWN_ROWS(T, T >= 32, i, {
        const RowCodes r = row_codes(packed, K, planes, ids[i]);
        for (int64_t k0 = 0; k0 < K; k0 += 16)
            store16(out + i * K + k0,
                    row_values16(&r, planes, k0, half_to_float(sz[k0 / gs * n_pad + ids[i]])));
    });
}

/* For each row m of x (bf16 [M][ldx]): the k largest of logits[m] (fp32 [M][ldl], N used;
 * top_k's choice, ties to the lower index) recomputed in place as the fp32 dot product of x's
 * row with the weight rows of int4_rows_half: products rounded to fp32, summed in 16
 * interleaved partial sums (column c into sum c % 16), those added in order. Rows split across
 * the threads; one row's k candidates too. The caller checks K (a multiple of 16, <= 16384). */
void int4_refine_half(float *logits, int64_t ldl, int64_t M, int64_t N, const uint16_t *x,
                      int64_t ldx, const uint8_t *packed, const uint16_t *sz, int64_t K,
                      int64_t n_pad, int64_t planes, int64_t gs, int64_t k) {
    int64_t ids[64 * 64]; /* [M <= 64][k <= 64] */
    top_k(logits, ldl, M, N, k, ids);
#pragma omp parallel for schedule(static) if (M * k >= 16)
    for (int64_t t = 0; t < M * k; t++) {
        const int64_t m = t / k, n = ids[t];
        const RowCodes r = row_codes(packed, K, planes, n);
        Vec16 part = zero16();
        for (int64_t k0 = 0; k0 < K; k0 += 16) {
            if (k0 + REFINE_AHEAD < K) /* the lines of the columns REFINE_AHEAD on */
                for (int64_t l = (k0 + REFINE_AHEAD) * 32; l < (k0 + REFINE_AHEAD + 16) * 32;
                     l += 64) {
                    _mm_prefetch((const char *)r.hi + l, _MM_HINT_T0);
                    if (planes == 2) _mm_prefetch((const char *)r.lo + l, _MM_HINT_T0);
                }
            part = add16(part, mul16(row_values16(&r, planes, k0,
                                                  half_to_float(sz[k0 / gs * n_pad + n])),
                                     bf16_16(x + m * ldx + k0)));
        }
        float p[16];
        store16(p, part);
        float dot = 0.0f;
        for (int j = 0; j < 16; j++) dot += p[j];
        logits[m * ldl + n] = dot;
    }
}
