/* The small per-layer ops of a decode step, fused, for bf16 activations (AVX-512).
 *
 * At batch 1 each of these is a few hundred to a few thousand flops, and PyTorch spends 5-50 us
 * per op on dispatch, temporaries and dtype conversions (RMSNorm alone decomposes into 10 ops).
 * Each function here is one call; the math and its rounding points follow the PyTorch
 * expressions they replace (see the `*_ref` functions in cpu_native.py): fp32 inside, one
 * round-to-nearest-even to bf16 where the PyTorch expression rounds.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"
#include "cpu_paged.h"
#include "cpu_simd.h"
#include "cpu_team.h"

/* RMSNorm of each row of x (bf16 [rows][dim], row stride ldx) into out (stride ldo):
 * out = bf16((x * rsqrt(mean(x^2) + eps)) * w), computed in fp32.
 * With `res` (stride ldr), x is first added to it: res = bf16(x + res), and res is normalized
 * (the residual stream: one call for `h = x + h; y = norm(h)`). */
static inline void rms_norm_row(const uint16_t *xr, uint16_t *rr, const uint16_t *w,
                                int64_t dim, float eps, uint16_t *o) {
    __m512 ss = _mm512_setzero_ps();
    for (int64_t i = 0; i < dim; i += 16) {
        const __mmask16 m = tail_mask(dim - i);
        __m512 v = load_bf16(xr + i, m);
        if (rr) { /* the rounded sum is what gets normalized (kept in registers: reading it
                   * back from the masked store stalled on store forwarding) */
            const __m512 exact = _mm512_add_ps(v, load_bf16(rr + i, m));
            const __m256i sum = (__m256i)_mm512_cvtneps_pbh(exact);
            _mm256_mask_storeu_epi16(rr + i, m, sum);
            v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(sum), 16));
        }
        ss = _mm512_fmadd_ps(v, v, ss);
    }
    const float r = 1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)dim + eps);
    const uint16_t *src = rr ? rr : xr;
    const __m512 rv = _mm512_set1_ps(r);
    for (int64_t i = 0; i < dim; i += 16) {
        const __mmask16 m = tail_mask(dim - i);
        const __m512 v = _mm512_mul_ps(load_bf16(src + i, m), rv);
        store_bf16(o + i, _mm512_mul_ps(v, load_bf16(w + i, m)), m);
    }
}

/* rows split over the calling team (cpu_team.h), or over a team of their own from 4 rows */
void rms_norm(const uint16_t *x, int64_t ldx, uint16_t *res, int64_t ldr, const uint16_t *w,
              int64_t rows, int64_t dim, float eps, uint16_t *out, int64_t ldo) {
    TEAM_ROWS(rows, rows >= 4, t,
              rms_norm_row(x + t * ldx, res ? res + t * ldr : NULL, w, dim, eps, out + t * ldo));
}

/* out = bf16(bf16(silu(gate)) * up) for gate_up = [gate | up] (bf16 [rows][2 * inter], row
 * stride ld), as `F.silu(gate) * up` rounds. out: bf16 [rows][inter], contiguous. */
void silu_mul(const uint16_t *gate_up, int64_t ld, int64_t rows, int64_t inter, uint16_t *out,
              int64_t ldo) {
    /* rows split over the calling team (cpu_team.h), or over a team of their own from 2 */
    TEAM_ROWS(rows, rows >= 2, t, silu_mul_row(gate_up + t * ld, inter, out + t * ldo));
}

/* Rotary embedding, in place, on the first num_heads heads of each token of x (bf16, token
 * stride ldt, head stride head_dim): the first rot_dim dims of a head rotate by the angle of
 * its position; cos/sin: fp32 [positions][rot_dim / 2] (any scaling already applied).
 * neox: dims i and i + rot_dim/2 form a pair; otherwise dims 2i and 2i + 1 do.
 * Per pair (x1, x2): (x1 cos - x2 sin, x2 cos + x1 sin) in fp32, each rounded once. */
int rope(uint16_t *x, int64_t tokens, int64_t ldt, int64_t num_heads, int64_t head_dim,
         int64_t rot_dim, const float *cos_t, const float *sin_t, int64_t table_rows,
         const int64_t *pos, int neox) {
    const int64_t half = rot_dim / 2;
    for (int64_t t = 0; t < tokens; t++)
        if (pos[t] < 0 || pos[t] >= table_rows) return -1;
    const __m512i hi16 = _mm512_set1_epi32((int)0xFFFF0000u);
    OWN_ROWS(tokens, tokens >= 32, t, {
        const float *c = cos_t + pos[t] * half, *s = sin_t + pos[t] * half;
        for (int64_t h = 0; h < num_heads; h++) {
            uint16_t *p = x + t * ldt + h * head_dim;
            for (int64_t i = 0; i < half; i += 16) {
                const __mmask16 m = tail_mask(half - i);
                const __m512 cv = _mm512_maskz_loadu_ps(m, c + i), sv = _mm512_maskz_loadu_ps(m, s + i);
                __m512 x1, x2;
                __m512i pairs = _mm512_setzero_si512();
                if (neox) {
                    x1 = load_bf16(p + i, m);
                    x2 = load_bf16(p + half + i, m);
                } else { /* 32-bit lane j holds the pair (2(i+j), 2(i+j)+1) */
                    pairs = _mm512_maskz_loadu_epi32(m, p + 2 * i);
                    x1 = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
                    x2 = _mm512_castsi512_ps(_mm512_and_si512(pairs, hi16));
                }
                const __m512 r1 = _mm512_sub_ps(_mm512_mul_ps(x1, cv), _mm512_mul_ps(x2, sv));
                const __m512 r2 = _mm512_add_ps(_mm512_mul_ps(x2, cv), _mm512_mul_ps(x1, sv));
                if (neox) {
                    store_bf16(p + i, r1, m);
                    store_bf16(p + half + i, r2, m);
                } else {
                    const __m512i b1 = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(r1));
                    const __m512i b2 = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(r2));
                    pairs = _mm512_or_si512(b1, _mm512_slli_epi32(b2, 16));
                    _mm512_mask_storeu_epi32(p + 2 * i, m, pairs);
                }
            }
        }
    });
    return 0;
}

/* Copies each token's K and V rows (bf16 [tokens][row], strides ldk, ldv) into pool slot
 * slots[t] (pools: bf16 [n_slots][row]). Returns -1, writing nothing, if a slot is out of range. */
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

/* Decode attention over a paged KV cache: B sequences with one query token each.
 * q: bf16 [B][num_heads][head_dim] (token stride ldq);
 * pools: bf16 [blocks][block_size][num_kv_heads][head_dim];
 * tables: int64 [B][width]; ctx[b]: cached positions of sequence b (this step's included).
 * out: bf16 [B][num_heads][head_dim] (token stride ldo). head_dim is a multiple of 16, <= 256;
 * at most MAX_GROUP query heads share a KV head.
 *
 * A task is one KV head of one sequence, with the query heads that share it; a sequence
 * longer than ATTN_UNIT positions splits into up to ATTN_SPLITS chunks (a number its own
 * length decides, so its result is the same in any batch), whose tasks both cores share, and
 * whose (max, denominator, sum) are merged in chunk order. Within a task, positions go SPAN
 * at a time: scores s = scale (q . k) from bf16 dot products (exact products, fp32 sums) with
 * 16 positions' sums reduced together, an online softmax in fp32, and the weighted sum of V
 * in fp32, each V row widened once for up to 4 query heads. K and V lines AHEAD positions on
 * are prefetched while a span computes: blocks are scattered through the pools, so the
 * hardware prefetcher cannot follow them.
 * Returns -1, computing nothing, if a context length or block number is out of range; -2 out
 * of memory. */
#define MAX_GROUP 16

/* lane i of the result = the sum of the 16 lanes of v[i] */
static inline __m512 sum_lanes16(__m512 v[16]) {
    __m512 b[8], c[4];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: pairs of (v[2i], v[2i+1]) sums */
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) /* per 128-bit lane: sums of v[4i .. 4i+3] over that lane */
        c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
    const __m512 f01 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                                     _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
    const __m512 f23 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88),
                                     _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(f01, f23, 0x88),
                         _mm512_shuffle_f32x4(f01, f23, 0xDD));
}

/* bf16 out[0..head_dim) = acc * inv (`AttnStore`, cpu_paged.h) */
static void attn_store(uint16_t *out, const float *acc, float inv, int64_t head_dim) {
    for (int64_t j = 0; j < head_dim; j += 16)
        store_bf16(out + j, _mm512_mul_ps(_mm512_loadu_ps(acc + j), _mm512_set1_ps(inv)), 0xFFFF);
}

#define SPAN 64

/* sum_lanes16 of 16 positions' dot products q . k (bf16 products, fp32 sums; positions n and
 * beyond give 0): krow[p] the positions' K rows, qb the query as NQ vectors of 32 bf16.
 * Called with constant head_dim and NQ for the common head sizes, so that the 16 sums stay in
 * registers (with run-time ones they went through the stack). */
static inline __attribute__((always_inline)) __m512 scores16(const uint16_t *const *krow,
                                                             int64_t n, const __m512i *qb,
                                                             int64_t head_dim, int64_t NQ) {
    __m512 d[16];
    for (int64_t p = 0; p < 16; p++) {
        d[p] = _mm512_setzero_ps();
        if (p >= n) continue;
        for (int64_t j = 0; j < NQ; j++) {
            const int64_t left = head_dim - 32 * j;
            const __m512i kv = _mm512_maskz_loadu_epi16(left >= 32 ? ~0u : (1u << left) - 1,
                                                        krow[p] + 32 * j);
            d[p] = _mm512_dpbf16_ps(d[p], (__m512bh)kv, (__m512bh)qb[j]);
        }
    }
    return sum_lanes16(d);
}

/* acc = acc corr + sum_p e[p] V[p] for GN query heads (acc: fp32 at acc + gi * stride, e:
 * their rows of SPAN weights) and W vectors of 16 dims from vector j0 of the V rows, over
 * positions 0..n-1. GN and W are constants in each instance (V_BLOCKS), so that the GN x W
 * sums stay in registers over the positions: the loops over them are unrolled outright, for
 * GCC 12 otherwise kept the array on the stack and stored every sum at every position (the
 * unrolled form: 0.95x the time of a decode step at 2,040 positions, 0.96x at 512). */
static inline __attribute__((always_inline)) void v_block(
    float *acc, int64_t stride, const float *corr, float (*e)[SPAN],
    const uint16_t *const *vrow, int64_t n, int64_t j0, const int GN, const int W) {
    __m512 a[4][4];
#pragma GCC unroll 4
    for (int gi = 0; gi < GN; gi++)
#pragma GCC unroll 4
        for (int i = 0; i < W; i++)
            a[gi][i] = _mm512_mul_ps(_mm512_loadu_ps(acc + gi * stride + 16 * i),
                                     _mm512_set1_ps(corr[gi]));
    for (int64_t p = 0; p < n; p++) {
        __m512 v[4];
#pragma GCC unroll 4
        for (int i = 0; i < W; i++) v[i] = load_bf16(vrow[p] + 16 * (j0 + i), 0xFFFF);
#pragma GCC unroll 4
        for (int gi = 0; gi < GN; gi++) {
            const __m512 ep = _mm512_set1_ps(e[gi][p]);
#pragma GCC unroll 4
            for (int i = 0; i < W; i++) a[gi][i] = _mm512_fmadd_ps(ep, v[i], a[gi][i]);
        }
    }
#pragma GCC unroll 4
    for (int gi = 0; gi < GN; gi++)
#pragma GCC unroll 4
        for (int i = 0; i < W; i++) _mm512_storeu_ps(acc + gi * stride + 16 * i, a[gi][i]);
}

typedef void (*VBlock)(float *, int64_t, const float *, float (*)[SPAN], const uint16_t *const *,
                       int64_t, int64_t);
#define V_BLOCK(GN, W)                                                                        \
    static void v_block_##GN##_##W(float *acc, int64_t stride, const float *corr,             \
                                   float (*e)[SPAN], const uint16_t *const *vrow, int64_t n,  \
                                   int64_t j0) {                                              \
        v_block(acc, stride, corr, e, vrow, n, j0, GN, W);                                    \
    }
#define V_BLOCKS_OF(GN) V_BLOCK(GN, 1) V_BLOCK(GN, 2) V_BLOCK(GN, 3) V_BLOCK(GN, 4)
V_BLOCKS_OF(1)
V_BLOCKS_OF(2)
V_BLOCKS_OF(3)
V_BLOCKS_OF(4)
/* [GN - 1][W - 1] */
#define V_ROW(GN) {v_block_##GN##_1, v_block_##GN##_2, v_block_##GN##_3, v_block_##GN##_4}
static const VBlock V_BLOCKS[4][4] = {V_ROW(1), V_ROW(2), V_ROW(3), V_ROW(4)};

/* One task of decode attention (`AttnChunk`, cpu_paged.h). Positions go SPAN at a time
 * (across blocks): the softmax's serial steps (max, exponentials, sums) then cover SPAN
 * positions at once. */
#define AHEAD 32 /* positions (64 slowed 8 streams of 300 positions by 5%) */
static void attn_chunk(const uint16_t *qh, const uint16_t *kpool, const uint16_t *vpool,
                       const int64_t *table, int64_t p0, int64_t p1, int64_t kh, int64_t group,
                       int64_t head_dim, int64_t row, int64_t block_size, float scale,
                       float *out_part, uint16_t *out) {
    float part[MAX_GROUP * (2 + 256)] __attribute__((aligned(64))); /* local: no false sharing */
    const int64_t nq = (head_dim + 31) / 32, nv = head_dim / 16, stride = 2 + head_dim;
    __m512i qb[MAX_GROUP][8];
    for (int64_t g = 0; g < group; g++) {
        for (int64_t j = 0; j < nq; j++) {
            const int64_t left = head_dim - 32 * j;
            qb[g][j] = _mm512_maskz_loadu_epi16(left >= 32 ? ~0u : (1u << left) - 1,
                                                qh + g * head_dim + 32 * j);
        }
        part[g * stride] = -INFINITY;
        part[g * stride + 1] = 0.0f;
        memset(part + g * stride + 2, 0, sizeof(float) * (size_t)head_dim);
    }
    const uint16_t *krow[SPAN], *vrow[SPAN];
    { /* the first AHEAD positions, which the spans' prefetches (AHEAD on) never reach: at
       * 8 sequences of 60-100 positions, 5-7% of the attention from memory */
        KvCursor pf = kv_cursor(table, p0, block_size, row, kh * head_dim);
        for (int64_t pos = p0; pos < p1 && pos < p0 + AHEAD; pos++)
            prefetch_position(kpool, vpool, kv_next(&pf), head_dim);
    }
    for (int64_t start = p0; start < p1; start += SPAN) {
        const int64_t cn = p1 - start < SPAN ? p1 - start : SPAN;
        KvCursor at = kv_cursor(table, start, block_size, row, kh * head_dim);
        for (int64_t i = 0; i < cn; i++) {
            const int64_t off = kv_next(&at);
            krow[i] = kpool + off;
            vrow[i] = vpool + off;
        }
        const int64_t nvec = (cn + 15) / 16;
        float e[MAX_GROUP][SPAN] __attribute__((aligned(64))), corr[MAX_GROUP];
        for (int64_t g = 0; g < group; g++) {
            __m512 s[SPAN / 16];
            for (int64_t c = 0; c < nvec; c++) {
                const int64_t ahead = start + AHEAD + 16 * c; /* 16 positions further on */
                if (g == 0 && ahead < p1) {
                    KvCursor pf = kv_cursor(table, ahead, block_size, row, kh * head_dim);
                    for (int64_t pos = ahead; pos < p1 && pos < ahead + 16; pos++)
                        prefetch_position(kpool, vpool, kv_next(&pf), head_dim);
                }
                const __m512 raw =
                    head_dim == 64 ? scores16(krow + 16 * c, cn - 16 * c, qb[g], 64, 2)
                    : head_dim == 128 ? scores16(krow + 16 * c, cn - 16 * c, qb[g], 128, 4)
                                      : scores16(krow + 16 * c, cn - 16 * c, qb[g], head_dim, nq);
                s[c] = _mm512_mul_ps(raw, _mm512_set1_ps(scale));
            }
            float *pg = part + g * stride;
            __m512 mv = _mm512_set1_ps(pg[0]);
            for (int64_t c = 0; c < nvec; c++)
                mv = _mm512_mask_max_ps(mv, tail_mask(cn - 16 * c), mv, s[c]);
            const float m = _mm512_reduce_max_ps(mv);
            corr[g] = expf(pg[0] - m); /* 0 for the first span (pg[0] = -inf) */
            __m512 dsum = _mm512_setzero_ps();
            for (int64_t c = 0; c < nvec; c++) {
                const __m512 ev = _mm512_maskz_mov_ps(
                    tail_mask(cn - 16 * c), exp512(_mm512_sub_ps(s[c], _mm512_set1_ps(m))));
                _mm512_store_ps(e[g] + 16 * c, ev);
                dsum = _mm512_add_ps(dsum, ev);
            }
            pg[0] = m;
            pg[1] = pg[1] * corr[g] + _mm512_reduce_add_ps(dsum);
        }
        /* acc = acc corr + sum_p e[p] V[p]: 4 query heads x 64 dims at a time in registers, so
         * that each V row is widened once per 64 dims */
        for (int64_t j0 = 0; j0 < nv; j0 += 4) {
            const int64_t w = nv - j0 < 4 ? nv - j0 : 4;
            for (int64_t g0 = 0; g0 < group; g0 += 4) {
                const int64_t gn = group - g0 < 4 ? group - g0 : 4;
                V_BLOCKS[gn - 1][w - 1](part + g0 * stride + 2 + 16 * j0, stride, corr + g0,
                                        e + g0, vrow, cn, j0);
            }
        }
    }
    if (out) { /* the whole sequence: normalized into its output rows */
        for (int64_t g = 0; g < group; g++)
            attn_store(out + g * head_dim, part + g * stride + 2, 1.0f / part[g * stride + 1],
                       head_dim);
        return;
    }
    memcpy(out_part, part, sizeof(float) * (size_t)(group * stride));
}

int decode_attention(const uint16_t *q, int64_t ldq, const uint16_t *kpool,
                     const uint16_t *vpool, int64_t n_blocks, const int64_t *tables,
                     int64_t width, const int64_t *ctx, int64_t B, int64_t num_heads,
                     int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                     uint16_t *out, int64_t ldo, int64_t *claim) {
    return paged_decode_attention(q, ldq, kpool, vpool, n_blocks, tables, width, ctx, B,
                                  num_heads, num_kv_heads, head_dim, block_size, scale, out,
                                  ldo, claim, MAX_GROUP, attn_chunk, NULL, attn_store);
}

/* Indices of the k largest values of each row of x (fp32 [rows][n], stride ldx), largest
 * first, ties to the lower index (k <= 64). One pass: a vector compare against the current
 * k-th value skips all but a few candidates. */
void top_k(const float *x, int64_t ldx, int64_t rows, int64_t n, int64_t k, int64_t *idx) {
#pragma omp parallel for schedule(static) if (rows >= 2) /* rows are independent */
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * ldx;
        float val[64];
        int64_t id[64];
        int64_t have = 0;
        float floor_v = -INFINITY;
        for (int64_t i0 = 0; i0 < n; i0 += 16) {
            const __mmask16 m = tail_mask(n - i0);
            const __m512 v = _mm512_maskz_loadu_ps(m, xr + i0);
            __mmask16 hit = have < k ? m : _mm512_mask_cmp_ps_mask(m, v, _mm512_set1_ps(floor_v), _CMP_GT_OQ);
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
