/* Paged decode attention for the AVX2 build (AVX2 + FMA + F16C): `decode_attention` of
 * cpu_kernels.h, with the same operands and contract as the AVX-512 build's (cpu_ops.c), on 8
 * fp32 lanes. cpu_paged.h splits the work into tasks; this file has the two kinds of task
 * (per KV head, attn_chunk; over whole K and V rows, attn_rows), the online softmax of a span
 * and the weighted sums of V. Sums run in another order than the AVX-512 build's, so the two
 * agree to fp32 rounding, each with decode_attention_ref of kernels/cpu_ops.py.
 */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_kernels.h"
#include "cpu_paged.h"
#include "cpu_simd_avx2.h"

#define MAX_GROUP 16
#define MAX_VECS 32 /* head_dim <= 256 */
/* acc = acc corr + sum_p e[p] V[p] for GN query heads (acc: fp32 rows astride apart, from
 * vector j0; e: their rows of 64 weights, sc) and W vectors of 8 dims from vector j0 of the V
 * rows (vrow[p]), over positions 0..n-1. GN and W are constants in each instance (V_BLOCKS8),
 * so that the GN x W sums stay in the 16 registers over the positions (as one array they went
 * through the stack, a store-to-load chain per position). */
static inline __attribute__((always_inline)) void v_block8(
    float *acc, int64_t astride, const float *corr, float (*e)[64],
    const uint16_t *const *vrow, int64_t n, int64_t j0, const int GN, const int W) {
    __m256 a[4][3];
    for (int gi = 0; gi < GN; gi++)
        for (int i = 0; i < W; i++)
            a[gi][i] = _mm256_mul_ps(_mm256_load_ps(acc + gi * astride + 8 * i),
                                     _mm256_set1_ps(corr[gi]));
    for (int64_t p = 0; p < n; p++) {
        __m256 v[3];
        for (int i = 0; i < W; i++) v[i] = load8_bf16(vrow[p] + 8 * (j0 + i));
        for (int gi = 0; gi < GN; gi++) {
            const __m256 ep = _mm256_set1_ps(e[gi][p]);
            for (int i = 0; i < W; i++) a[gi][i] = _mm256_fmadd_ps(ep, v[i], a[gi][i]);
        }
    }
    for (int gi = 0; gi < GN; gi++)
        for (int i = 0; i < W; i++) _mm256_store_ps(acc + gi * astride + 8 * i, a[gi][i]);
}

typedef void (*VBlock8)(float *, int64_t, const float *, float (*)[64], const uint16_t *const *,
                        int64_t, int64_t);
#define V_BLOCK8(GN, W)                                                                       \
    static void v_block8_##GN##_##W(float *acc, int64_t astride, const float *corr,           \
                                    float (*e)[64], const uint16_t *const *vrow, int64_t n,   \
                                    int64_t j0) {                                             \
        v_block8(acc, astride, corr, e, vrow, n, j0, GN, W);                                  \
    }
#define V_BLOCKS8_OF(GN) V_BLOCK8(GN, 1) V_BLOCK8(GN, 2) V_BLOCK8(GN, 3)
V_BLOCKS8_OF(1)
V_BLOCKS8_OF(2)
V_BLOCKS8_OF(3)
V_BLOCKS8_OF(4)
/* [GN - 1][W - 1] */
#define V_ROW8(GN) {v_block8_##GN##_1, v_block8_##GN##_2, v_block8_##GN##_3}
static const VBlock8 V_BLOCKS8[4][3] = {V_ROW8(1), V_ROW8(2), V_ROW8(3), V_ROW8(4)};

/* How far ahead a task reads K and V: with each position whose K it widens, it prefetches the
 * one ATTN_AHEAD positions on (a cursor through the block table: no division a position).
 * Against 8 positions' prefetches in a burst every 8 positions, each found by a division, one
 * sequence of 2,048 positions took 0.94 of the time (Zen 2, with hsum8x8 and the vector max);
 * 32 and 64 positions ahead were no faster than 16. */
#ifndef ATTN_AHEAD
#define ATTN_AHEAD 16
#endif

/* The prefetch of the position at the cursor pf (pf_pos), if before p1; returns the next
 * position to prefetch */
static inline int64_t prefetch_next(const uint16_t *kpool, const uint16_t *vpool, KvCursor *pf,
                                    int64_t pf_pos, int64_t p1, int64_t head_dim) {
    if (pf_pos >= p1) return pf_pos;
    prefetch_position(kpool, vpool, kv_next(pf), head_dim);
    return pf_pos + 1;
}

/* out[q] = the sum of d[q]'s lanes, q < np (<= 8): all 8 at once where np is 8 (32-byte
 * aligned out), in hsum8's order either way */
static inline void store_scores(const __m256 d[8], int64_t np, float *out) {
    if (np == 8)
        _mm256_store_ps(out, hsum8x8(d));
    else
        for (int64_t q = 0; q < np; q++) out[q] = hsum8(d[q]);
}

/* One span's step of an online softmax over its cn scores s (in place: s[p] becomes
 * exp(s[p] - m)), where *mx is the running max and *den the running sum of weights: m, the max
 * of *mx and the span's scores, over whole vectors and then the rest (a NaN score is passed
 * over, as the scalar compare does); *corr = exp(*mx - m), the factor of the sums so far
 * (applied to V's in v_block8); *den = *den * corr + the span's weights (summed lane by lane,
 * then across lanes); *mx = m. */
static inline void span_softmax(float *s, int64_t cn, float *mx, float *den, float *corr) {
    __m256 mv = _mm256_set1_ps(*mx);
    int64_t p = 0;
    for (; p + 8 <= cn; p += 8) mv = _mm256_max_ps(_mm256_load_ps(s + p), mv);
    float m = hmax8(mv);
    for (; p < cn; p++) m = s[p] > m ? s[p] : m;
    *corr = expf(*mx - m);
    *mx = m;
    const __m256 mm = _mm256_set1_ps(m);
    __m256 dv = _mm256_setzero_ps();
    for (p = 0; p + 8 <= cn; p += 8) {
        const __m256 e = exp256(_mm256_sub_ps(_mm256_load_ps(s + p), mm));
        _mm256_store_ps(s + p, e);
        dv = _mm256_add_ps(dv, e);
    }
    if (p < cn) { /* a last part vector: its lanes past cn count 0 */
        const __m256i mk = lanes_n(cn - p);
        const __m256 e = _mm256_and_ps(exp256(_mm256_sub_ps(_mm256_maskload_ps(s + p, mk), mm)),
                                       _mm256_castsi256_ps(mk));
        _mm256_maskstore_ps(s + p, mk, e);
        dv = _mm256_add_ps(dv, e);
    }
    *den = *den * *corr + hsum8(dv);
}

/* One task of decode attention (`AttnChunk`, cpu_paged.h): per block of positions, each
 * position's scores (fp32 dot products), an online softmax, the weighted sum of V. */
static void attn_chunk(const uint16_t *qh, const uint16_t *kpool, const uint16_t *vpool,
                       const int64_t *table, int64_t p0, int64_t p1, int64_t kh, int64_t group,
                       int64_t head_dim, int64_t row, int64_t block_size, float scale,
                       float *out_part, uint16_t *out) {
    const int64_t nv = head_dim / 8;
    __m256 qv[MAX_GROUP][MAX_VECS];
    float acc[MAX_GROUP][8 * MAX_VECS] __attribute__((aligned(32)));
    float mx[MAX_GROUP], den[MAX_GROUP], corr[MAX_GROUP];
    for (int64_t g = 0; g < group; g++) {
        for (int64_t j = 0; j < nv; j++)
            qv[g][j] = _mm256_mul_ps(load8_bf16(qh + g * head_dim + 8 * j), _mm256_set1_ps(scale));
        memset(acc[g], 0, sizeof(float) * (size_t)head_dim);
        mx[g] = -INFINITY;
        den[g] = 0.0f;
    }
    float sc[MAX_GROUP][64] __attribute__((aligned(32)));
    float kf[8][8 * MAX_VECS] __attribute__((aligned(32))); /* 8 positions' K in fp32 */
    /* the next position to prefetch: the first ATTN_AHEAD now, then one per position */
    KvCursor pf = kv_cursor(table, p0, block_size, row, kh * head_dim);
    int64_t pf_pos = p0;
    for (; pf_pos < p1 && pf_pos < p0 + ATTN_AHEAD; pf_pos++)
        prefetch_position(kpool, vpool, kv_next(&pf), head_dim);
    for (int64_t start = p0; start < p1; start += block_size) {
        const int64_t blk = table[start / block_size];
        const int64_t n = p1 - start < block_size ? p1 - start : block_size;
        for (int64_t c0 = 0; c0 < n; c0 += 64) {
            const int64_t cn = n - c0 < 64 ? n - c0 : 64;
            const uint16_t *kb = kpool + (blk * block_size + c0) * row + kh * head_dim;
            const uint16_t *vb = vpool + (blk * block_size + c0) * row + kh * head_dim;
            const uint16_t *vrow[64];
            for (int64_t p = 0; p < cn; p++) vrow[p] = vb + p * row;
            /* 8 positions at a time: each position's sum over j in order per query head (as a
             * single chain was), then the 8 positions' sums added across lanes at once */
            for (int64_t p8 = 0; p8 < cn && nv == 8; p8 += 8) {
                /* head_dim 64: a position's K row widened into 8 registers, every query head's
                 * sum taken from them (where kf's stores and loads cost a fifth more time) */
                const int64_t np = cn - p8 < 8 ? cn - p8 : 8;
                __m256 dd[MAX_GROUP][8];
                for (int64_t q = 0; q < np; q++) {
                    pf_pos = prefetch_next(kpool, vpool, &pf, pf_pos, p1, head_dim);
                    __m256 k[8];
                    for (int j = 0; j < 8; j++) k[j] = load8_bf16(kb + (p8 + q) * row + 8 * j);
                    for (int64_t g = 0; g < group; g++) {
                        __m256 d = _mm256_mul_ps(qv[g][0], k[0]);
                        for (int j = 1; j < 8; j++) d = _mm256_fmadd_ps(qv[g][j], k[j], d);
                        dd[g][q] = d;
                    }
                }
                for (int64_t g = 0; g < group; g++) store_scores(dd[g], np, sc[g] + p8);
            }
            /* other head sizes: 8 positions' K rows widened once into kf */
            for (int64_t p8 = 0; p8 < cn && nv != 8; p8 += 8) {
                const int64_t np = cn - p8 < 8 ? cn - p8 : 8;
                for (int64_t q = 0; q < np; q++) {
                    pf_pos = prefetch_next(kpool, vpool, &pf, pf_pos, p1, head_dim);
                    for (int64_t j = 0; j < nv; j++)
                        _mm256_store_ps(kf[q] + 8 * j, load8_bf16(kb + (p8 + q) * row + 8 * j));
                }
                for (int64_t g = 0; g < group; g++) {
                    __m256 d[8];
                    for (int q = 0; q < 8; q++)
                        d[q] = _mm256_mul_ps(qv[g][0], _mm256_load_ps(kf[q]));
                    for (int64_t j = 1; j < nv; j++)
                        for (int q = 0; q < 8; q++)
                            d[q] = _mm256_fmadd_ps(qv[g][j], _mm256_load_ps(kf[q] + 8 * j), d[q]);
                    store_scores(d, np, sc[g] + p8);
                }
            }
            for (int64_t g = 0; g < group; g++)
                span_softmax(sc[g], cn, &mx[g], &den[g], &corr[g]);
            for (int64_t g0 = 0; g0 < group; g0 += 4) {
                const int64_t gn = group - g0 < 4 ? group - g0 : 4;
                for (int64_t j0 = 0; j0 < nv; j0 += 3) {
                    const int64_t w = nv - j0 < 3 ? nv - j0 : 3;
                    V_BLOCKS8[gn - 1][w - 1](acc[g0] + 8 * j0, 8 * MAX_VECS, corr + g0,
                                             sc + g0, vrow, cn, j0);
                }
            }
        }
    }
    for (int64_t g = 0; g < group; g++) {
        if (out) {
            const __m256 inv = _mm256_set1_ps(1.0f / den[g]);
            for (int64_t j = 0; j < nv; j++)
                store8_bf16(out + g * head_dim + 8 * j,
                            _mm256_mul_ps(_mm256_load_ps(acc[g] + 8 * j), inv));
            continue;
        }
        float *pg = out_part + g * (2 + head_dim);
        pg[0] = mx[g];
        pg[1] = den[g];
        memcpy(pg + 2, acc[g], sizeof(float) * (size_t)head_dim);
    }
}

/* One task of decode attention over whole rows (`AttnRows`, cpu_paged.h): positions go SPAN
 * at a time, across blocks. Each position's K row is read once and in order for every query
 * head, and its V row prefetched into L2 then; an online softmax per head over the span; then
 * the weighted sums of V, from the rows those prefetches brought in. The K rows come in with
 * no prefetch of their own: the hardware's follows a run of whole rows (16 and 32 positions
 * ahead were no faster in decode at 2,000 positions, Zen 2), and V into L1 instead of L2 was
 * 1.6% slower. Decode of one sequence against the per-KV-head tasks (attn_chunk): 0.91 of the
 * time at 600 positions, 0.83 at 2,000; 1.00 at 8-136 positions, 0.99 for 8 sequences. */
#define SPAN 64
static void attn_rows(const uint16_t *q, const uint16_t *kpool, const uint16_t *vpool,
                      const int64_t *table, int64_t p0, int64_t p1, int64_t num_kv_heads,
                      int64_t group, int64_t head_dim, int64_t block_size, float scale,
                      float *out_part, uint16_t *out) {
    const int64_t nv = head_dim / 8, heads = num_kv_heads * group, row = num_kv_heads * head_dim;
    float qf[ROWS_VALUES] __attribute__((aligned(32)));  /* q scale, fp32 [heads][head_dim] */
    float acc[ROWS_VALUES] __attribute__((aligned(32))); /* [heads][head_dim] */
    float mx[ROWS_HEADS], den[ROWS_HEADS], corr[ROWS_HEADS];
    float sc[ROWS_HEADS][SPAN] __attribute__((aligned(32)));
    __m256 dd[ROWS_HEADS][8]; /* 8 positions' sums per head, before their lanes are added */
    __m256 kv[MAX_VECS];      /* one KV head's K values of a position (head sizes other than 64) */
    for (int64_t i = 0; i < heads * head_dim; i += 8) {
        _mm256_store_ps(qf + i, _mm256_mul_ps(load8_bf16(q + i), _mm256_set1_ps(scale)));
        _mm256_store_ps(acc + i, _mm256_setzero_ps());
    }
    for (int64_t h = 0; h < heads; h++) {
        mx[h] = -INFINITY;
        den[h] = 0.0f;
    }
    const uint16_t *krow[SPAN], *vrow[SPAN];
    KvCursor at = kv_cursor(table, p0, block_size, row, 0);
    for (int64_t start = p0; start < p1; start += SPAN) {
        const int64_t cn = p1 - start < SPAN ? p1 - start : SPAN;
        for (int64_t i = 0; i < cn; i++) {
            const int64_t off = kv_next(&at);
            krow[i] = kpool + off;
            vrow[i] = vpool + off;
        }
        for (int64_t p8 = 0; p8 < cn; p8 += 8) {
            const int64_t np = cn - p8 < 8 ? cn - p8 : 8;
            for (int64_t i = 0; i < np; i++) {
                const char *vr = (const char *)vrow[p8 + i];
                for (int64_t l = 0; l < row * 2; l += 64) _mm_prefetch(vr + l, _MM_HINT_T1);
                for (int64_t kh = 0; kh < num_kv_heads; kh++) {
                    const uint16_t *kk = krow[p8 + i] + kh * head_dim;
                    /* each sum in two chains (even and odd vectors), added at the end: one
                     * chain of FMAs leaves the units waiting on its latency */
                    if (nv == 8) { /* head_dim 64: the K values in 8 registers */
                        __m256 k[8];
                        for (int j = 0; j < 8; j++) k[j] = load8_bf16(kk + 8 * j);
                        for (int64_t h = kh * group; h < (kh + 1) * group; h++) {
                            const float *qh = qf + h * 64;
                            __m256 d0 = _mm256_mul_ps(_mm256_load_ps(qh), k[0]);
                            __m256 d1 = _mm256_mul_ps(_mm256_load_ps(qh + 8), k[1]);
                            for (int j = 2; j < 8; j += 2) {
                                d0 = _mm256_fmadd_ps(_mm256_load_ps(qh + 8 * j), k[j], d0);
                                d1 = _mm256_fmadd_ps(_mm256_load_ps(qh + 8 * j + 8), k[j + 1], d1);
                            }
                            dd[h][i] = _mm256_add_ps(d0, d1);
                        }
                        continue;
                    }
                    for (int64_t j = 0; j < nv; j++) kv[j] = load8_bf16(kk + 8 * j);
                    for (int64_t h = kh * group; h < (kh + 1) * group; h++) {
                        const float *qh = qf + h * head_dim;
                        __m256 d0 = _mm256_mul_ps(_mm256_load_ps(qh), kv[0]);
                        __m256 d1 = _mm256_mul_ps(_mm256_load_ps(qh + 8), kv[1]);
                        for (int64_t j = 2; j < nv; j += 2) { /* nv is even: head_dim % 16 == 0 */
                            d0 = _mm256_fmadd_ps(_mm256_load_ps(qh + 8 * j), kv[j], d0);
                            d1 = _mm256_fmadd_ps(_mm256_load_ps(qh + 8 * j + 8), kv[j + 1], d1);
                        }
                        dd[h][i] = _mm256_add_ps(d0, d1);
                    }
                }
            }
            for (int64_t h = 0; h < heads; h++) store_scores(dd[h], np, sc[h] + p8);
        }
        for (int64_t h = 0; h < heads; h++) span_softmax(sc[h], cn, &mx[h], &den[h], &corr[h]);
        for (int64_t kh = 0; kh < num_kv_heads; kh++)
            for (int64_t g0 = 0; g0 < group; g0 += 4) {
                const int64_t gn = group - g0 < 4 ? group - g0 : 4, h0 = kh * group + g0;
                for (int64_t j0 = 0; j0 < nv; j0 += 3) {
                    const int64_t w = nv - j0 < 3 ? nv - j0 : 3;
                    V_BLOCKS8[gn - 1][w - 1](acc + h0 * head_dim + 8 * j0, head_dim, corr + h0,
                                             sc + h0, vrow, cn, kh * nv + j0);
                }
            }
    }
    for (int64_t h = 0; h < heads; h++) {
        const float *ah = acc + h * head_dim;
        if (out) {
            const __m256 inv = _mm256_set1_ps(1.0f / den[h]);
            for (int64_t j = 0; j < nv; j++)
                store8_bf16(out + h * head_dim + 8 * j,
                            _mm256_mul_ps(_mm256_load_ps(ah + 8 * j), inv));
            continue;
        }
        float *ph = out_part + h * (2 + head_dim);
        ph[0] = mx[h];
        ph[1] = den[h];
        memcpy(ph + 2, ah, sizeof(float) * (size_t)head_dim);
    }
}

static void attn_store(uint16_t *out, const float *acc, float inv, int64_t head_dim) {
    for (int64_t j = 0; j < head_dim; j += 8)
        store8_bf16(out + j, _mm256_mul_ps(_mm256_loadu_ps(acc + j), _mm256_set1_ps(inv)));
}

/* decode_attention of cpu_kernels.h: this build's tasks in cpu_paged.h's split of the work */
int decode_attention(const uint16_t *q, int64_t ldq, const uint16_t *kpool,
                     const uint16_t *vpool, int64_t n_blocks, const int64_t *tables,
                     int64_t width, const int64_t *ctx, int64_t B, int64_t num_heads,
                     int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                     uint16_t *out, int64_t ldo, int64_t *claim) {
    return paged_decode_attention(q, ldq, kpool, vpool, n_blocks, tables, width, ctx, B,
                                  num_heads, num_kv_heads, head_dim, block_size, scale, out,
                                  ldo, claim, MAX_GROUP, attn_chunk, attn_rows, attn_store);
}
