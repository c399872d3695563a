/* bf16 <-> fp32 vector helpers shared by the native CPU kernels (AVX-512). */
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

#endif
