/* Sampled tokens drawn inside a native call (both builds): the same numbers, in the same order
 * and the same double arithmetic, as localllm/engine/draw.py (`draw_u`, `draw_index`) and the
 * engine's Sampler, so that a request's tokens are the same whether a step draws them here (in
 * decode_layers' steps) or in Python after a call of its own.
 *
 * Draw n of a request with key K: u = mix(K ^ mix(n)) >> 11, times 2^-53 (SplitMix64's mix).
 * Among candidates v[0] >= v[1] >= ... (a row's top_k fp32 logits, top_k's order), in doubles:
 * p[i] = exp((v[i] - v[0]) / T); tokens are kept from the first while the mass before a token is
 * below top_p of the whole, p[i] >= min_p and p[i] > 0; the token is the first whose running
 * sum passes u times the kept sum (the last kept where rounding leaves none). No -ffast-math:
 * exp is the C library's, as Python's math.exp.
 */
#include <math.h>
#include <stdint.h>

#include "cpu_kernels.h"

static uint64_t mix64(uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

double draw_u(uint64_t key, uint64_t n) {
    return (double)(mix64(key ^ mix64(n)) >> 11) * 0x1p-53;
}

int64_t draw_index(const float *v, int64_t k, double temperature, double top_p, double min_p,
                   double u) {
    double p[SAMPLE_MAX_K];
    const double top = v[0];
    double total = 0.0;
    for (int64_t i = 0; i < k; i++) {
        p[i] = exp(((double)v[i] - top) / temperature);
        total += p[i];
    }
    const double limit = top_p * total;
    double kept = 0.0;
    int64_t n = 0;
    for (; n < k; n++) {
        if (n && (kept >= limit || p[n] < min_p || p[n] == 0.0)) break;
        kept += p[n];
    }
    const double r = u * kept;
    double acc = 0.0;
    for (int64_t i = 0; i < n; i++) {
        acc += p[i];
        if (acc > r) return i;
    }
    return n - 1;
}

void sample_rows(const float *logits, int64_t ldl, int64_t rows, int64_t n,
                 const RowSampling *s, int64_t step, int64_t *tokens) {
    for (int64_t b = 0; b < rows; b++) {
        const RowSampling *r = s + b;
        if (r->temperature <= 0.0) continue; /* greedy: tokens[b] stays the argmax */
        const float *row = logits + b * ldl;
        int64_t idx[SAMPLE_MAX_K];
        float v[SAMPLE_MAX_K];
        top_k(row, ldl, 1, n, r->top_k, idx);
        for (int64_t i = 0; i < r->top_k; i++) v[i] = row[idx[i]];
        const double u = draw_u(r->key, (uint64_t)(r->count + step));
        tokens[b] = idx[draw_index(v, r->top_k, r->temperature, r->top_p, r->min_p, u)];
    }
}
