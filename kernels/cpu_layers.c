/* A whole decode step of a Llama-family decoder stack in one call (bf16, packed int4 weights).
 *
 * At batch 1 a layer is ten small calls; from Python each costs microseconds of dispatch,
 * which added up to a third of a decode step. `decode_layers` runs every layer of a step for
 * M sequences with one query token each, calling the same functions as the per-op path
 * (int4_mm, rms_norm, rope, kv_store, decode_attention, silu_mul), in the same order and
 * with the same rounding, so a token's result does not depend on which path computed it.
 *
 * Per layer, with x the layer input and r the residual stream ([M][hidden] bf16):
 *   h = norm1(x + r) (first layer: h = norm1(x), r = x)   qkv = h Wqkv^T   rope(q, k)
 *   store k, v at the step's slots                         a = attention(q, cached K/V)
 *   h = norm2(a Wo^T + r)                                  x = silu(h Wg^T) * (h Wu^T) Wd^T
 * (first x: the embedding's rows of the step's tokens, with a StepEmbed), and after the last
 * layer: out = norm(x + r); with a head (StepHead), its logits from out, the best of them
 * refined and each row's argmax, as the per-op path computes them (int4_rows_half, int8_logits,
 * int4_refine_half, top_k), where that path took four calls and their Python between; where
 * rows sample (StepHead.sampling), their tokens drawn as the engine's Sampler draws them.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_int4_groups.h"
#include "cpu_kernels.h"
#include "cpu_team.h"

/* The work ranges of a step's matmuls (int4_mm_shared; cpu_team.h's share_next), a line for
 * each thread the team can have: two sets, each matmul taking the one the matmul before it did
 * not. After a matmul, its team's barrier passed, thread 0 zeroes its set for the matmul after
 * next, which no thread begins before thread 0 has reached the next matmul's barrier. A third
 * set is attention's (decode_attention's claim), zeroed by thread 0 after each call's barrier
 * for the next layer's. */
typedef struct {
    int64_t *sets, stride;
} Claims;

/* y = x W^T, the step's matmul number i */
static int matmul(const PackedWeight *w, const uint16_t *x, int64_t m, int64_t k, uint16_t *y,
                  const Claims *c, int64_t i) {
    int64_t *set = c->sets + i % 2 * c->stride;
    /* int4_mm fails only when out of memory (group sizes are checked in Python) */
    const int rc = int4_mm_shared(x, m, k, k, w->packed, w->sz, w->out_features, w->out_padded,
                                  w->planes, y, w->out_features, w->group_size, w->lut,
                                  w->scales_form, set)
                       ? -2
                       : 0;
    if (omp_get_thread_num() == 0) memset(set, 0, sizeof(int64_t) * (size_t)c->stride);
    return rc;
}

/* fp32 -> bf16 to nearest, ties to even; NaN to the quiet NaN (PyTorch's rounding) */
static uint16_t bf16_of(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1)) >> 16);
}

/* x (bf16 [M][H]) = the embedding's rows ids; -3 if an id is not a row */
static int embed_rows(const StepEmbed *e, int64_t M, int64_t H, uint16_t *x) {
    float row[16384]; /* H <= 16384 (checked in Python) */
    for (int64_t b = 0; b < M; b++)
        if (e->ids[b] < 0 || e->ids[b] >= e->w.out_features) return -3;
    for (int64_t b = 0; b < M; b++) {
        int4_rows_half(e->w.packed, e->w.sz, H, e->w.out_padded, e->w.planes, e->w.group_size,
                       e->ids + b, 1, row);
        for (int64_t k = 0; k < H; k++) x[b * H + k] = bf16_of(row[k]);
    }
    return 0;
}

/* RoPE on q and k of the step's M rows (qkv: bf16 [M][qkv_w]) and their K and V stored, on
 * thread id of nth: with as many rows as threads, a share of the rows; with fewer, one row's
 * q heads on thread 0 and its k heads and the store on thread 1 (every head rotates alone and
 * every row is copied alone, so the values do not depend on the split). Returns rope's or
 * kv_store's error, on the threads that found it (a bad position stores nothing of its rows). */
static int rope_store(uint16_t *qkv, int64_t M, const DecoderDims *d, const DecoderLayer *L,
                      const float *cos_t, const float *sin_t, int64_t table_rows,
                      const int64_t *pos, const int64_t *slots, int64_t nth, int64_t id) {
    const int64_t hd = d->head_dim, q_w = d->num_heads * hd, kv_w = d->num_kv_heads * hd;
    const int64_t qkv_w = q_w + 2 * kv_w, n_slots = d->n_blocks * d->block_size;
    int64_t r0 = 0, r1 = M, h0 = 0, h1 = d->num_heads + d->num_kv_heads;
    if (M >= nth) {
        r0 = M * id / nth;
        r1 = M * (id + 1) / nth;
    } else if (id == 0) {
        h1 = d->num_heads;
    } else if (id == 1) {
        h0 = d->num_heads;
    } else {
        return 0;
    }
    if (r0 == r1) return 0;
    int e = rope(qkv + r0 * qkv_w + h0 * hd, r1 - r0, qkv_w, h1 - h0, hd, d->rot_dim, cos_t,
                 sin_t, table_rows, pos + r0, (int)d->neox);
    if (!e && h1 > d->num_heads) /* this thread rotated the k heads: it stores the rows */
        e = kv_store(qkv + r0 * qkv_w + q_w, qkv_w, qkv + r0 * qkv_w + q_w + kv_w, qkv_w,
                     slots + r0, r1 - r0, kv_w, L->k_pool, L->v_pool, n_slots);
    return e;
}

/* One step of decode_layers (its operands), the head's best ids and logits written to best and
 * best_logit ([M] each); a sampling row's best is its draw number count + step */
static int decode_step(const DecoderLayer *layers, int64_t n_layers, const DecoderDims *d,
                       const uint16_t *final_norm, uint16_t *x, int64_t M, const int64_t *pos,
                       const int64_t *slots, const int64_t *tables, int64_t width,
                       const int64_t *ctx, const float *cos_t, const float *sin_t,
                       int64_t table_rows, const StepEmbed *embed, const StepHead *head,
                       int64_t *best, float *best_logit, int64_t step) {
    const int64_t H = d->hidden, head_dim = d->head_dim;
    const int64_t num_heads = d->num_heads, num_kv_heads = d->num_kv_heads;
    const int64_t q_w = num_heads * head_dim, kv_w = num_kv_heads * head_dim;
    const int64_t qkv_w = q_w + 2 * kv_w, inter = d->intermediate;
    const size_t per_row = (size_t)(3 * H + qkv_w + q_w + 3 * inter);
    if (n_layers < 1) return -1;
    if (embed && embed_rows(embed, M, H, x)) return -3;
    uint16_t *buf = malloc(sizeof(uint16_t) * per_row * (size_t)M);
    const int64_t stride = omp_get_max_threads() * SHARE_LINE;
    const Claims claims = {aligned_alloc(64, sizeof(int64_t) * (size_t)(3 * stride)), stride};
    if (!buf || !claims.sets) {
        free(buf);
        free(claims.sets);
        return -2;
    }
    memset(claims.sets, 0, sizeof(int64_t) * (size_t)(3 * stride));
    int64_t *att_set = claims.sets + 2 * stride;
    uint16_t *res = buf, *h = res + M * H, *y = h + M * H, *qkv = y + M * H;
    uint16_t *att = qkv + M * qkv_w, *gu = att + M * q_w, *act = gu + M * 2 * inter;
    int rc = 0; /* shared: set by the threads that found an error, read by all after a barrier */
    memcpy(res, x, sizeof(uint16_t) * (size_t)(M * H));
    /* All layers in one parallel region, every thread running the loop (cpu_team.h): the
     * kernels split their work over the team and end with its barrier, as do RoPE and the K/V
     * store (rope_store), the AMX tile kernel included. Not where a matmul's group sums of x
     * would not fit its stack room (a kernel must not fail on one thread alone). Every exit
     * below is taken by all threads at once: matmul and attention return the same value on
     * each, and rope_store's errors are read after a barrier. */
    const int64_t k_max = H > q_w ? (H > inter ? H : inter) : (q_w > inter ? q_w : inter);
    const int team = omp_get_max_threads() > 1 && M * (2 * k_max / 16) <= XSUM_ROOM;
#pragma omp parallel if (team)
    {
        for (int64_t l = 0; l < n_layers; l++) {
            const DecoderLayer *L = &layers[l];
            int r;
            if (l == 0)
                rms_norm(res, H, NULL, 0, L->input_norm, M, H, d->eps, h, H);
            else
                rms_norm(y, H, res, H, L->input_norm, M, H, d->eps, h, H);
            if ((r = matmul(&L->qkv, h, M, H, qkv, &claims, 4 * l))) {
                if (omp_get_thread_num() == 0) rc = r;
                break;
            }
            {
                const int e = rope_store(qkv, M, d, L, cos_t, sin_t, table_rows, pos, slots,
                                         omp_get_num_threads(), omp_get_thread_num());
                if (e) {
#pragma omp atomic write
                    rc = e;
                }
#pragma omp barrier
            }
            if (rc) break;
            r = decode_attention(qkv, qkv_w, L->k_pool, L->v_pool, d->n_blocks, tables, width,
                                 ctx, M, num_heads, num_kv_heads, head_dim, d->block_size,
                                 d->scale, att, q_w, att_set);
            if (omp_get_thread_num() == 0) /* past its barrier: for the next layer's */
                memset(att_set, 0, sizeof(int64_t) * (size_t)stride);
            if (r || (r = matmul(&L->o, att, M, q_w, y, &claims, 4 * l + 1))) {
                if (omp_get_thread_num() == 0) rc = r;
                break;
            }
            rms_norm(y, H, res, H, L->post_norm, M, H, d->eps, h, H);
            if ((r = matmul(&L->gate_up, h, M, H, gu, &claims, 4 * l + 2))) {
                if (omp_get_thread_num() == 0) rc = r;
                break;
            }
            silu_mul(gu, 2 * inter, M, inter, act, inter);
            if ((r = matmul(&L->down, act, M, inter, y, &claims, 4 * l + 3))) {
                if (omp_get_thread_num() == 0) rc = r;
                break;
            }
        }
        int4_tiles_release(); /* the matmuls' AMX tiles, where they took them */
    }
    if (!rc) rms_norm(y, H, res, H, final_norm, M, H, d->eps, x, H);
    free(buf);
    free(claims.sets);
    if (!rc && head) {
        const PackedWeight *w = &head->w;
        const int64_t n = w->out_features;
        if (int8_logits(x, M, H, H, w->packed, w->sz, n, w->out_padded, head->logits, n))
            return -2; /* the layout was checked in Python: only memory fails */
        int4_refine_half(head->logits, n, M, n, x, H, w->packed, w->sz, H, w->out_padded,
                         w->planes, w->group_size, head->refine_k);
        top_k(head->logits, n, M, n, 1, best);
        for (int64_t b = 0; b < M; b++) best_logit[b] = head->logits[b * n + best[b]];
        if (head->sampling) sample_rows(head->logits, n, M, n, head->sampling, step, best);
    }
    return rc;
}

/* x: bf16 [M][hidden], the step's embeddings (with `embed`, looked up here first); overwritten
 * with the final normalized hidden states. Returns 0; -1 on a bad position, slot, block or
 * context length (reported by the step that found it; earlier layers' K/V are then already
 * stored); -2 out of memory; -3 a token id beyond the embedding (nothing computed). head:
 * NULL, or the LM head to run after the layers.
 *
 * steps > 1 (with both embed and head): that many decode steps, each row's next token the
 * best of the step before (or where the row samples, its draw: step j takes draw count + j),
 * at the next position (its slot from its block table, its context one longer); head's best
 * and best_logit are then [steps][M], its logits the last step's. Each step is the one-step
 * call on those operands, so the tokens are the ones the same number of separate calls (and
 * the engine's Sampler after each) would pick. An error stops at the step that found it (the
 * steps before it have their results). */
int decode_layers(const DecoderLayer *layers, int64_t n_layers, const DecoderDims *d,
                  const uint16_t *final_norm, uint16_t *x, int64_t M, const int64_t *pos,
                  const int64_t *slots, const int64_t *tables, int64_t width, const int64_t *ctx,
                  const float *cos_t, const float *sin_t, int64_t table_rows,
                  const StepEmbed *embed, const StepHead *head, int64_t steps) {
    if (steps == 1)
        return decode_step(layers, n_layers, d, final_norm, x, M, pos, slots, tables, width,
                           ctx, cos_t, sin_t, table_rows, embed, head, head ? head->best : NULL,
                           head ? head->best_logit : NULL, 0);
    if (steps < 1 || !embed || !head || d->block_size < 1) return -1;
    int64_t *ops = malloc(sizeof(int64_t) * (size_t)(4 * M)); /* ids | pos | slots | ctx */
    if (!ops) return -2;
    int64_t *ids = ops, *p = ops + M, *sl = ops + 2 * M, *c = ops + 3 * M;
    memcpy(ids, embed->ids, sizeof(int64_t) * (size_t)M);
    memcpy(p, pos, sizeof(int64_t) * (size_t)M);
    memcpy(sl, slots, sizeof(int64_t) * (size_t)M);
    memcpy(c, ctx, sizeof(int64_t) * (size_t)M);
    StepEmbed e = *embed;
    e.ids = ids;
    int rc = 0;
    for (int64_t j = 0; j < steps && !rc; j++) {
        int64_t *best = head->best + j * M;
        if (j > 0) {
            for (int64_t b = 0; b < M && !rc; b++) {
                ids[b] = best[b - M];
                p[b]++;
                c[b]++;
                const int64_t blk = p[b] / d->block_size;
                if (blk >= width) {
                    rc = -1;
                    break;
                }
                const int64_t at = tables[b * width + blk];
                if (at < 0 || at >= d->n_blocks) {
                    rc = -1;
                    break;
                }
                sl[b] = at * d->block_size + p[b] % d->block_size;
            }
            if (rc) break;
        }
        rc = decode_step(layers, n_layers, d, final_norm, x, M, p, sl, tables, width, c, cos_t,
                         sin_t, table_rows, &e, head, best, head->best_logit + j * M, j);
    }
    free(ops);
    return rc;
}
