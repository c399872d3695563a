/* The small per-layer ops of a decode step for the AVX2 build (AVX2 + FMA + F16C): the same
 * functions, operands and rounding points as cpu_ops.c (see it for each one's contract), on
 * 8 fp32 lanes. Sums run in another order than the AVX-512 build's, so the two builds agree
 * to fp32 rounding, each with the *_ref functions of kernels/cpu_ops.py.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"
#include "cpu_simd_avx2.h"
#include "cpu_team.h"

static inline void rms_norm_row(const uint16_t *xr, uint16_t *rr, const uint16_t *w,
                                int64_t dim, float eps, uint16_t *o) {
    __m256 ss = _mm256_setzero_ps();
    for (int64_t i = 0; i < dim; i += 8) {
        __m256 v = load_bf16_n(xr + i, dim - i);
        if (rr) {
            store_bf16_n(rr + i, _mm256_add_ps(v, load_bf16_n(rr + i, dim - i)), dim - i);
            v = load_bf16_n(rr + i, dim - i); /* the rounded sum is what gets normalized */
        }
        ss = _mm256_fmadd_ps(v, v, ss);
    }
    const float r = 1.0f / sqrtf(hsum8(ss) / (float)dim + eps);
    const uint16_t *src = rr ? rr : xr;
    const __m256 rv = _mm256_set1_ps(r);
    for (int64_t i = 0; i < dim; i += 8) {
        const __m256 v = _mm256_mul_ps(load_bf16_n(src + i, dim - i), rv);
        store_bf16_n(o + i, _mm256_mul_ps(v, load_bf16_n(w + i, dim - i)), dim - i);
    }
}

/* rows split over the calling team (cpu_team.h), or over a team of their own from 4 rows */
void rms_norm(const uint16_t *x, int64_t ldx, uint16_t *res, int64_t ldr, const uint16_t *w,
              int64_t rows, int64_t dim, float eps, uint16_t *out, int64_t ldo) {
    TEAM_ROWS(rows, rows >= 4, t,
              rms_norm_row(x + t * ldx, res ? res + t * ldr : NULL, w, dim, eps, out + t * ldo));
}

void silu_mul(const uint16_t *gate_up, int64_t ld, int64_t rows, int64_t inter, uint16_t *out,
              int64_t ldo) {
    /* rows split over the calling team (cpu_team.h), or over a team of their own from 2 */
    TEAM_ROWS(rows, rows >= 2, t, silu_mul_row8(gate_up + t * ld, inter, out + t * ldo));
}

int rope(uint16_t *x, int64_t tokens, int64_t ldt, int64_t num_heads, int64_t head_dim,
         int64_t rot_dim, const float *cos_t, const float *sin_t, int64_t table_rows,
         const int64_t *pos, int neox) {
    const int64_t half = rot_dim / 2;
    for (int64_t t = 0; t < tokens; t++)
        if (pos[t] < 0 || pos[t] >= table_rows) return -1;
    const __m256i hi16 = _mm256_set1_epi32((int)0xFFFF0000u);
    OWN_ROWS(tokens, tokens >= 32, t, {
        const float *c = cos_t + pos[t] * half, *s = sin_t + pos[t] * half;
        for (int64_t h = 0; h < num_heads; h++) {
            uint16_t *p = x + t * ldt + h * head_dim;
            for (int64_t i = 0; i < half; i += 8) {
                const int64_t n = half - i;
                const __m256i m = lanes_n(n);
                const __m256 cv = _mm256_maskload_ps(c + i, m), sv = _mm256_maskload_ps(s + i, m);
                __m256 x1, x2;
                __m256i pairs = _mm256_setzero_si256();
                if (neox) {
                    x1 = load_bf16_n(p + i, n);
                    x2 = load_bf16_n(p + half + i, n);
                } else { /* 32-bit lane j holds the pair (2(i+j), 2(i+j)+1) */
                    pairs = _mm256_maskload_epi32((const int *)(p + 2 * i), m);
                    x1 = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
                    x2 = _mm256_castsi256_ps(_mm256_and_si256(pairs, hi16));
                }
                const __m256 r1 = _mm256_sub_ps(_mm256_mul_ps(x1, cv), _mm256_mul_ps(x2, sv));
                const __m256 r2 = _mm256_add_ps(_mm256_mul_ps(x2, cv), _mm256_mul_ps(x1, sv));
                if (neox) {
                    store_bf16_n(p + i, r1, n);
                    store_bf16_n(p + half + i, r2, n);
                } else {
                    pairs = _mm256_or_si256(bf16_bits(r1), _mm256_slli_epi32(bf16_bits(r2), 16));
                    _mm256_maskstore_epi32((int *)(p + 2 * i), m, pairs);
                }
            }
        }
    });
    return 0;
}

int kv_store(const uint16_t *k, int64_t ldk, const uint16_t *v, int64_t ldv,
             const int64_t *slots, int64_t tokens, int64_t row, uint16_t *kpool,
             uint16_t *vpool, int64_t n_slots) {
    for (int64_t t = 0; t < tokens; t++)
        if (slots[t] < 0 || slots[t] >= n_slots) return -1;
    for (int64_t t = 0; t < tokens; t++) {
        memcpy(kpool + slots[t] * row, k + t * ldk, (size_t)row * 2);
        memcpy(vpool + slots[t] * row, v + t * ldv, (size_t)row * 2);
    }
    return 0;
}

void top_k(const float *x, int64_t ldx, int64_t rows, int64_t n, int64_t k, int64_t *idx) {
#pragma omp parallel for schedule(static) if (rows >= 2) /* rows are independent */
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * ldx;
        float val[64];
        int64_t id[64];
        int64_t have = 0;
        float floor_v = -INFINITY;
        for (int64_t i0 = 0; i0 < n; i0 += 8) {
            const int64_t cnt = n - i0 < 8 ? n - i0 : 8;
            const unsigned all = (1u << cnt) - 1;
            unsigned hit = all;
            if (have == k) {
                const __m256 v = _mm256_maskload_ps(xr + i0, lanes_n(cnt));
                hit = (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(floor_v),
                                                                 _CMP_GT_OQ)) & all;
            }
            while (hit) {
                const int j = __builtin_ctz(hit);
                hit &= hit - 1;
                const float xv = xr[i0 + j];
                if (have == k && !(xv > val[k - 1])) continue;
                int64_t p = have < k ? have++ : k - 1; /* insertion sort, descending */
                while (p > 0 && val[p - 1] < xv) {
                    val[p] = val[p - 1];
                    id[p] = id[p - 1];
                    p--;
                }
                val[p] = xv;
                id[p] = i0 + j;
                if (have == k) floor_v = val[k - 1];
            }
        }
        for (int64_t j = 0; j < k; j++) idx[r * k + j] = j < have ? id[j] : -1;
    }
}
