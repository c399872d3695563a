/* The native CPU kernels' exported API: every function Python calls through ctypes
 * (kernels/cpu_native.py, which restates these signatures and structs positionally) and every
 * function one C file calls in another. bf16 and fp16 values travel as uint16_t.
 *
 * NOTE: the argument order and types here, and the structs' field order and types, are the
 * library's ABI: change them only together with cpu_native.py. */
#ifndef LOCALLLM_CPU_KERNELS_H
#define LOCALLLM_CPU_KERNELS_H

#include <stdint.h>

/* ---- int4 weight-only matmuls (cpu_int4*.c; the packed layout is described in cpu_int4.h) */

/* y = x @ W^T, x: bf16 [M][ldx] (K used), y: bf16 [M][ldy] (N written); groups of gs = 32 or
 * 16 columns; lut: NULL or a codebook's 32 bf16 values hi | lo; scales_form: SCALES_PAIRS,
 * SCALES_TILED or SCALES_HALF, the form of sz (cpu_int4_groups.h). Returns 0, -1 if out of memory, -2 for another group size. */
int int4_mm(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *packed,
            const uint16_t *sz, int64_t N, int64_t n_pad, int64_t planes, uint16_t *y,
            int64_t ldy, int64_t gs, const uint16_t *lut, int64_t scales_form);

/* int4_mm called by every thread of a team (decode_layers'), its tiles shared out through
 * `claim`: the call's work ranges (cpu_team.h's share_next), SHARE_LINE int64 for each thread
 * the team can have, zeroed before the call, one set per call */
int int4_mm_shared(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *packed,
                   const uint16_t *sz, int64_t N, int64_t n_pad, int64_t planes, uint16_t *y,
                   int64_t ldy, int64_t gs, const uint16_t *lut, int64_t scales_form,
                   int64_t *claim);

/* int4_mm on AMX tiles for a prompt's rows, whatever int4_amx_enable says (groups of 32
 * without a codebook; other weights take the AVX-512 path). Call int4_gemm_ready first. */
int int4_mm_tiles(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *packed,
                  const uint16_t *sz, int64_t N, int64_t n_pad, int64_t planes, uint16_t *y,
                  int64_t ldy, int64_t gs, const uint16_t *lut, int64_t scales_form);

/* Asks the OS for the AMX tile state once; returns whether tiles may be used at all. */
int int4_gemm_ready(void);

/* Decoding rows (int4_mm's) on AMX tiles, if permitted: on = 1: batches of 2-8 rows on
 * AMX-INT8 (one row on VNNI: the same bits); 2: every row on bf16 tiles; 0: off (VNNI); -1:
 * only ask. Returns the mode in use. */
int int4_amx_enable(int on);

/* Releases the calling thread's AMX tiles, which int4_mm leaves configured when called by a
 * team's thread (decode_layers calls it on each thread at the end of a step). */
void int4_tiles_release(void);

/* y = x @ W^T on AMX tiles for many rows, or with `gated` silu(x Wg^T) * (x Wu^T); operands as
 * for int4_mm. Call int4_gemm_ready first. Returns 0, -1 if out of memory, -2 for another
 * group size. */
int int4_gemm(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *packed,
              const uint16_t *sz, int64_t N, int64_t n_pad, int64_t planes, uint16_t *y,
              int64_t ldy, int64_t gs, const uint16_t *lut, int64_t scales_form,
              int64_t gated);

/* W^T in bf16, wt: [K][n_pad], planes summed in fp32 and rounded once. */
void int4_dequant_t(const uint8_t *packed, const uint16_t *sz, int64_t K, int64_t n_pad,
                    int64_t planes, uint16_t *wt, int64_t gs, const uint16_t *lut,
                    int64_t scales_form);

/* Rows ids[0..T) of a packed weight with fp16 scales in fp32, as the source dequantizes them:
 * out fp32 [T][K] (cpu_int4_rows.c). */
void int4_rows_half(const uint8_t *packed, const uint16_t *sz, int64_t K, int64_t n_pad,
                    int64_t planes, int64_t gs, const int64_t *ids, int64_t T, float *out);

/* The k best of each row of fp32 logits [M][ldl] (N used; top_k's choice) recomputed in place
 * as fp32 dot products of x's row (bf16 [M][ldx]) with int4_rows_half's rows, in a fixed
 * order (cpu_int4_rows.c). M <= 64, k <= 64; K a multiple of 16, at most 16384. */
void int4_refine_half(float *logits, int64_t ldl, int64_t M, int64_t N, const uint16_t *x,
                      int64_t ldx, const uint8_t *packed, const uint16_t *sz, int64_t K,
                      int64_t n_pad, int64_t planes, int64_t gs, int64_t k);

/* fp32 logits y[M][ldy] (N written) = x @ W^T for a grouped int8 weight (groups of 32) in two
 * nibble planes with fp16 scales sz [K / 32][n_pad] (Q8_0), x bf16 [M][ldx] rounded per group to
 * 16-bit integers, integer products summed exactly (cpu_int8_logits.c, AVX-512 VNNI;
 * cpu_int8_logits_avx2.c: the same numbers). Returns 0, -1 if out of memory, -2 for K or n_pad
 * off the layout. */
int int8_logits(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *packed,
                const uint16_t *sz, int64_t N, int64_t n_pad, float *y, int64_t ldy);

/* ---- the small per-layer ops of a decode step (cpu_ops.c) */

void rms_norm(const uint16_t *x, int64_t ldx, uint16_t *res, int64_t ldr, const uint16_t *w,
              int64_t rows, int64_t dim, float eps, uint16_t *out, int64_t ldo);
void silu_mul(const uint16_t *gate_up, int64_t ld, int64_t rows, int64_t inter, uint16_t *out,
              int64_t ldo);
int rope(uint16_t *x, int64_t tokens, int64_t ldt, int64_t num_heads, int64_t head_dim,
         int64_t rot_dim, const float *cos_t, const float *sin_t, int64_t table_rows,
         const int64_t *pos, int neox);
int kv_store(const uint16_t *k, int64_t ldk, const uint16_t *v, int64_t ldv,
             const int64_t *slots, int64_t tokens, int64_t row, uint16_t *kpool,
             uint16_t *vpool, int64_t n_slots);
/* claim: zeroed ranges (SHARE_LINE int64 a thread, cpu_team.h) the calling team's threads
 * share the tasks through (decode_layers); NULL: a team of its own makes its own */
int decode_attention(const uint16_t *q, int64_t ldq, const uint16_t *kpool,
                     const uint16_t *vpool, int64_t n_blocks, const int64_t *tables,
                     int64_t width, const int64_t *ctx, int64_t B, int64_t num_heads,
                     int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                     uint16_t *out, int64_t ldo, int64_t *claim);
void top_k(const float *x, int64_t ldx, int64_t rows, int64_t n, int64_t k, int64_t *idx);

/* ---- sampled tokens (cpu_sample.c: the draws of localllm/engine/draw.py) */

#define SAMPLE_MAX_K 64 /* top_k's most */

/* How one row draws its token: temperature 0 keeps the row's argmax; else among its top_k
 * (1 .. SAMPLE_MAX_K, at most the vocabulary) best logits, with draw number count + step of
 * the request's stream `key`. */
typedef struct {
    double temperature, top_p, min_p;
    int64_t top_k;
    uint64_t key;
    int64_t count;
} RowSampling;

double draw_u(uint64_t key, uint64_t n);
/* the drawn position among k candidate logits v, largest first */
int64_t draw_index(const float *v, int64_t k, double temperature, double top_p, double min_p,
                   double u);
/* each sampling row's token (the rest left as they are) from fp32 logits [rows][ldl], n used */
void sample_rows(const float *logits, int64_t ldl, int64_t rows, int64_t n,
                 const RowSampling *s, int64_t step, int64_t *tokens);

/* ---- a whole decode step (cpu_layers.c) */

typedef struct {
    const uint8_t *packed; /* the int4 kernels' layout (cpu_int4.h) */
    const uint16_t *sz;
    int64_t out_features, out_padded, planes, group_size;
    const uint16_t *lut; /* NULL, or a codebook weight's 32 bf16 values hi | lo */
    int64_t scales_form; /* the form of sz: SCALES_PAIRS, _TILED or _HALF (cpu_int4_groups.h) */
} PackedWeight;

typedef struct {
    const uint16_t *input_norm, *post_norm; /* bf16 [hidden] */
    PackedWeight qkv, o, gate_up, down;
    uint16_t *k_pool, *v_pool; /* bf16 [n_blocks][block_size][num_kv_heads][head_dim] */
} DecoderLayer;

typedef struct {
    int64_t hidden, num_heads, num_kv_heads, head_dim, rot_dim, neox, intermediate, block_size,
        n_blocks;
    float eps, scale;
} DecoderDims;

/* An LM head decode_layers runs after the final norm: a Q8_0 weight (two planes, fp16 scales,
 * groups of 32) whose logits come from int8_logits, the refine_k best recomputed exactly
 * (int4_refine_half), each row's best picked (top_k); outputs logits fp32 [M][out_features],
 * best int64 [M] and best_logit fp32 [M]. With sampling (NULL: every row greedy), a row that
 * samples has its drawn token in best instead (sample_rows; best_logit stays its largest). */
typedef struct {
    PackedWeight w;
    int64_t refine_k;
    float *logits;
    int64_t *best;
    float *best_logit;
    const RowSampling *sampling; /* [M] or NULL */
} StepHead;

/* The embedding decode_layers looks its input rows up in: a weight with fp16 scales
 * (int4_rows_half), its rows ids[0..M) rounded to bf16 as PyTorch rounds. */
typedef struct {
    PackedWeight w;
    const int64_t *ids;
} StepEmbed;

int decode_layers(const DecoderLayer *layers, int64_t n_layers, const DecoderDims *d,
                  const uint16_t *final_norm, uint16_t *x, int64_t M, const int64_t *pos,
                  const int64_t *slots, const int64_t *tables, int64_t width, const int64_t *ctx,
                  const float *cos_t, const float *sin_t, int64_t table_rows,
                  const StepEmbed *embed, const StepHead *head, int64_t steps);

#endif
