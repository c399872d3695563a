/* bf16 <-> fp32 vector helpers and the SiLU gate shared by the native CPU kernels (AVX-512). */
#ifndef LOCALLLM_CPU_SIMD_H
#define LOCALLLM_CPU_SIMD_H

#include <immintrin.h>
#include <stdint.h>

/* the first n (capped at 16) lanes */
static inline __mmask16 tail_mask(int64_t n) {
    return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1);
}

/* 16 bf16 values (masked) -> fp32, exactly */
static inline __m512 load_bf16(const uint16_t *p, __mmask16 m) {
    const __m256i v = _mm256_maskz_loadu_epi16(m, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

/* fp32 -> 16 bf16 values (masked), round to nearest even as PyTorch's conversion */
static inline void store_bf16(uint16_t *p, __m512 v, __mmask16 m) {
    _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
}

/* the first n (<= 16) floats at src -> bf16 at dst */
static inline void store_floats_bf16(const float *src, uint16_t *dst, int64_t n) {
    const __mmask16 m = tail_mask(n);
    store_bf16(dst, _mm512_maskz_loadu_ps(m, src), m);
}

/* e^x for x in [-88, 88] (clamped), relative error about 2e-7 */
static inline __m512 exp512(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-88.0f)), _mm512_set1_ps(88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* out[i] = bf16(bf16(silu(g[i])) * u[i]) for i < inter, with u = g + inter (bf16): silu rounded
 * to bf16 first, as the two-op PyTorch expression does */
static inline void silu_mul_row(const uint16_t *g, int64_t inter, uint16_t *out) {
    const uint16_t *u = g + inter;
    for (int64_t i = 0; i < inter; i += 16) {
        const __mmask16 m = tail_mask(inter - i);
        const __m512 gv = load_bf16(g + i, m);
        const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        __m512 s = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
        s = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(s)), 16));
        store_bf16(out + i, _mm512_mul_ps(s, load_bf16(u + i, m)), m);
    }
}

#endif
