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

/* RMSNorm of each row of x (bf16 [rows][dim], row stride ldx) into out (stride ldo):
 * out = bf16((x * rsqrt(mean(x^2) + eps)) * w), computed in fp32.
 * With `res` (stride ldr), x is first added to it: res = bf16(x + res), and res is normalized
 * (the residual stream: one call for `h = x + h; y = norm(h)`). */
void rms_norm(const uint16_t *x, int64_t ldx, uint16_t *res, int64_t ldr, const uint16_t *w,
              int64_t rows, int64_t dim, float eps, uint16_t *out, int64_t ldo) {
#pragma omp parallel for schedule(static) if (rows >= 32)
    for (int64_t t = 0; t < rows; t++) {
        const uint16_t *xr = x + t * ldx;
        uint16_t *rr = res ? res + t * ldr : NULL;
        __m512 ss = _mm512_setzero_ps();
        for (int64_t i = 0; i < dim; i += 16) {
            const __mmask16 m = tail_mask(dim - i);
            __m512 v = load_bf16(xr + i, m);
            if (rr) {
                store_bf16(rr + i, _mm512_add_ps(v, load_bf16(rr + i, m)), m);
                v = load_bf16(rr + i, m); /* the rounded sum is what gets normalized */
            }
            ss = _mm512_fmadd_ps(v, v, ss);
        }
        const float r = 1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)dim + eps);
        const uint16_t *src = rr ? rr : xr;
        const __m512 rv = _mm512_set1_ps(r);
        for (int64_t i = 0; i < dim; i += 16) {
            const __mmask16 m = tail_mask(dim - i);
            const __m512 v = _mm512_mul_ps(load_bf16(src + i, m), rv);
            store_bf16(out + t * ldo + i, _mm512_mul_ps(v, load_bf16(w + i, m)), m);
        }
    }
}

/* out = bf16(bf16(silu(gate)) * up) for gate_up = [gate | up] (bf16 [rows][2 * inter], row
 * stride ld), as `F.silu(gate) * up` rounds. out: bf16 [rows][inter], contiguous. */
void silu_mul(const uint16_t *gate_up, int64_t ld, int64_t rows, int64_t inter, uint16_t *out,
              int64_t ldo) {
#pragma omp parallel for schedule(static) if (rows >= 32)
    for (int64_t t = 0; t < rows; t++) silu_mul_row(gate_up + t * ld, inter, out + t * ldo);
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
#pragma omp parallel for schedule(static) if (tokens >= 32)
    for (int64_t t = 0; t < tokens; t++) {
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
    }
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
 * out: bf16 [B][num_heads][head_dim] (token stride ldo). Scores, softmax and the weighted sum
 * are fp32 (online softmax, one block of positions at a time); head_dim is a multiple of 16,
 * <= 256.
 * Returns -1, computing nothing, if a context length or block number is out of range. */
#define MAX_GROUP 16
int decode_attention(const uint16_t *q, int64_t ldq, const uint16_t *kpool,
                     const uint16_t *vpool, int64_t n_blocks, const int64_t *tables,
                     int64_t width, const int64_t *ctx, int64_t B, int64_t num_heads,
                     int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                     uint16_t *out, int64_t ldo) {
    const int64_t group = num_heads / num_kv_heads, nv = head_dim / 16;
    const int64_t row = num_kv_heads * head_dim;
    if (group > MAX_GROUP || head_dim % 16 || head_dim > 256) return -1;
    const int64_t work = paged_positions(tables, width, ctx, B, block_size, n_blocks);
    if (work < 0) return -1;
#pragma omp parallel for schedule(dynamic, 1) if (work * num_heads * head_dim >= 65536)
    for (int64_t task = 0; task < B * num_kv_heads; task++) {
        const int64_t b = task / num_kv_heads, kh = task % num_kv_heads;
        __m512 qv[MAX_GROUP][16], acc[MAX_GROUP][16];
        float mx[MAX_GROUP], den[MAX_GROUP];
        for (int64_t g = 0; g < group; g++) {
            const uint16_t *qh = q + b * ldq + (kh * group + g) * head_dim;
            for (int64_t j = 0; j < nv; j++) {
                qv[g][j] = _mm512_mul_ps(load_bf16(qh + 16 * j, 0xFFFF), _mm512_set1_ps(scale));
                acc[g][j] = _mm512_setzero_ps();
            }
            mx[g] = -INFINITY;
            den[g] = 0.0f;
        }
        float sc[MAX_GROUP][64] __attribute__((aligned(64)));
        for (int64_t start = 0; start < ctx[b]; start += block_size) {
            const int64_t blk = tables[b * width + start / block_size];
            const int64_t n = ctx[b] - start < block_size ? ctx[b] - start : block_size;
            if (start + n < ctx[b]) /* blocks are scattered: the hardware cannot prefetch the next */
                prefetch_block(kpool, vpool, tables[b * width + start / block_size + 1],
                               ctx[b] - start - n < block_size ? ctx[b] - start - n : block_size,
                               block_size, row, kh * head_dim, head_dim);
            for (int64_t c0 = 0; c0 < n; c0 += 64) {
                const int64_t cn = n - c0 < 64 ? n - c0 : 64;
                const uint16_t *kb = kpool + (blk * block_size + c0) * row + kh * head_dim;
                const uint16_t *vb = vpool + (blk * block_size + c0) * row + kh * head_dim;
                for (int64_t p = 0; p < cn; p++) {
                    __m512 kv[16];
                    for (int64_t j = 0; j < nv; j++) kv[j] = load_bf16(kb + p * row + 16 * j, 0xFFFF);
                    for (int64_t g = 0; g < group; g++) {
                        __m512 d = _mm512_mul_ps(qv[g][0], kv[0]);
                        for (int64_t j = 1; j < nv; j++) d = _mm512_fmadd_ps(qv[g][j], kv[j], d);
                        sc[g][p] = _mm512_reduce_add_ps(d);
                    }
                }
                for (int64_t g = 0; g < group; g++) {
                    float m = mx[g];
                    for (int64_t p = 0; p < cn; p++) m = sc[g][p] > m ? sc[g][p] : m;
                    const float corr = expf(mx[g] - m);
                    mx[g] = m;
                    den[g] *= corr;
                    for (int64_t j = 0; j < nv; j++)
                        acc[g][j] = _mm512_mul_ps(acc[g][j], _mm512_set1_ps(corr));
                    for (int64_t p = 0; p < cn; p += 16) {
                        const __mmask16 mk = tail_mask(cn - p);
                        const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, sc[g] + p),
                                                              _mm512_set1_ps(m)));
                        _mm512_mask_storeu_ps(sc[g] + p, mk, e);
                        den[g] += _mm512_mask_reduce_add_ps(mk, e);
                    }
                }
                for (int64_t p = 0; p < cn; p++) {
                    __m512 vv[16];
                    for (int64_t j = 0; j < nv; j++) vv[j] = load_bf16(vb + p * row + 16 * j, 0xFFFF);
                    for (int64_t g = 0; g < group; g++) {
                        const __m512 pg = _mm512_set1_ps(sc[g][p]);
                        for (int64_t j = 0; j < nv; j++) acc[g][j] = _mm512_fmadd_ps(pg, vv[j], acc[g][j]);
                    }
                }
            }
        }
        for (int64_t g = 0; g < group; g++) {
            uint16_t *oh = out + b * ldo + (kh * group + g) * head_dim;
            const __m512 inv = _mm512_set1_ps(1.0f / den[g]);
            for (int64_t j = 0; j < nv; j++) store_bf16(oh + 16 * j, _mm512_mul_ps(acc[g][j], inv), 0xFFFF);
        }
    }
    return 0;
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
