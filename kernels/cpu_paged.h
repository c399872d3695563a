/* The ISA-neutral part of decode attention over the paged KV pools (cpu_ops.c, cpu_ops_avx2.c):
 * pools are bf16 [blocks][block_size][num_kv_heads][head_dim], a sequence's blocks scattered
 * through them by its block table. */
#ifndef LOCALLLM_CPU_PAGED_H
#define LOCALLLM_CPU_PAGED_H

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_team.h"

/* With per-KV-head tasks, a sequence longer than ATTN_UNIT positions is attended in chunks,
 * one per ATTN_UNIT positions begun, up to ATTN_SPLITS, of equal whole blocks (how many and
 * how long, only its own length decides, so its result is the same in any batch), so that one
 * long sequence keeps every core busy; the chunks' partial results are merged in order
 * (attn_merge). Where the chunks were whole units of 512 positions, a sequence of 600 had one
 * chunk of 512 and one of 88, and of its 6 tasks (3 KV heads) one thread ran two long ones:
 * decode at 600 positions took 1.07x as long, at 1,400 1.02x (Zen 2). */
#define ATTN_SPLITS 8
#define ATTN_UNIT 512

/* A build whose tasks take whole K and V rows (`AttnRows`) splits every sequence of
 * ROWS_MIN positions and more into chunks: 2 per ROWS_UNIT positions begun, up to ATTN_SPLITS,
 * of equal runs of whole 8-position groups. A task then reads each of its positions' rows once
 * and in order, where per-KV-head tasks read a third of every row (3 KV heads) and the two
 * cores each read some rows again: on Zen 2, two threads read the rows of 2,048 positions at
 * 19-22 GB/s in order, 13-15 GB/s as per-KV-head slices. */
#define ROWS_MIN 32
#define ROWS_UNIT 1024

/* Decode attention runs on the threads from this many multiply-adds of q . k (positions x
 * query heads x head_dim): ctx 29 and on at one sequence of 9 x 64 heads */
#define ATTN_PAR_MIN 16384
/* The most sequences whose plan a team's threads make on their own stacks, plus one */
#define ATTN_ROOM 257
/* Query heads per task: each KV head's are split into as many pieces as give the threads at
 * least two tasks each, where a step's sequences and chunks give fewer (one sequence with 3 KV
 * heads on 2 threads ran 2:1, or on one thread below 114 positions). Each query head's sums
 * are its own, so a sequence's result is the same however its heads are split. */
static inline int64_t attn_heads_per_task(int64_t tasks, int64_t group, int64_t threads) {
    int64_t pieces = (2 * threads + tasks - 1) / tasks;
    pieces = pieces > group ? group : pieces;
    return (group + pieces - 1) / pieces;
}

/* the chunks of a context of n >= 1 positions: count, and positions per chunk (*len, whole
 * blocks, or with `rows` whole 8-position groups; the last chunk takes the rest) */
static inline int64_t attn_chunks(int64_t n, int64_t block_size, int rows, int64_t *len) {
    if (rows) {
        const int64_t units = 2 * ((n + ROWS_UNIT - 1) / ROWS_UNIT);
        const int64_t count = n < ROWS_MIN ? 1 : units < ATTN_SPLITS ? units : ATTN_SPLITS;
        *len = (n + 8 * count - 1) / (8 * count) * 8;
        return (n + *len - 1) / *len;
    }
    const int64_t unit = block_size > ATTN_UNIT ? block_size : ATTN_UNIT;
    const int64_t units = (n + unit - 1) / unit;
    const int64_t count = units < ATTN_SPLITS ? units : ATTN_SPLITS;
    const int64_t blocks = (n + block_size - 1) / block_size;
    *len = (blocks + count - 1) / count * block_size;
    return (n + *len - 1) / *len;
}

/* first (int64 [B + 1]): sequence b's chunks are first[b] .. first[b + 1] - 1. Returns the
 * number of chunks (B where no sequence has more than one). */
static inline int64_t attn_first(const int64_t *ctx, int64_t B, int64_t block_size, int rows,
                                 int64_t *first) {
    first[0] = 0;
    for (int64_t b = 0; b < B; b++) {
        int64_t len;
        first[b + 1] = first[b] + attn_chunks(ctx[b], block_size, rows, &len);
    }
    return first[B];
}

/* The chunks of B sequences: first (malloc'd, attn_first's); parts: malloc'd where a sequence
 * has more than one chunk (else NULL), fp32 [chunks][num_heads][2 + head_dim], each head's
 * (max, denominator, unnormalized sum of V) over its chunk. Returns the number of chunks; -2
 * out of memory. */
static inline int64_t attn_plan(const int64_t *ctx, int64_t B, int64_t block_size, int rows,
                                int64_t num_heads, int64_t head_dim, int64_t **first,
                                float **parts) {
    *first = malloc(sizeof(int64_t) * (size_t)(B + 1));
    *parts = NULL;
    if (!*first) return -2;
    const int64_t chunks = attn_first(ctx, B, block_size, rows, *first);
    if (chunks > B) {
        *parts = malloc(sizeof(float) * (size_t)(chunks * num_heads * (2 + head_dim)));
        if (!*parts) {
            free(*first);
            return -2;
        }
    }
    return chunks;
}

/* Chunk `chunk` of the plan: its sequence (returned) and positions [*p0, *p1) */
static inline int64_t attn_task(const int64_t *first, const int64_t *ctx, int64_t block_size,
                                int rows, int64_t chunk, int64_t *p0, int64_t *p1) {
    int64_t b = 0, len;
    while (first[b + 1] <= chunk) b++;
    attn_chunks(ctx[b], block_size, rows, &len);
    *p0 = (chunk - first[b]) * len;
    *p1 = *p0 + len < ctx[b] ? *p0 + len : ctx[b];
    return b;
}

/* Head h of sequence b merged over its chunks, in order: acc (fp32 [head_dim]) = sum_c
 * e^(m_c - M) acc_c; returns 1 / sum_c e^(m_c - M) den_c (M: the largest m_c). */
static inline float attn_merge(const float *parts, const int64_t *first, int64_t b, int64_t h,
                               int64_t num_heads, int64_t head_dim, float *acc) {
    const int64_t stride = 2 + head_dim;
    float M = -INFINITY, den = 0.0f;
    for (int64_t c = first[b]; c < first[b + 1]; c++) {
        const float mc = parts[(c * num_heads + h) * stride];
        M = mc > M ? mc : M;
    }
    memset(acc, 0, sizeof(float) * (size_t)head_dim);
    for (int64_t c = first[b]; c < first[b + 1]; c++) {
        const float *pc = parts + (c * num_heads + h) * stride;
        const float w = expf(pc[0] - M);
        den += w * pc[1];
        for (int64_t j = 0; j < head_dim; j++) acc[j] += w * pc[2 + j];
    }
    return 1.0f / den;
}

/* The positions of B sequences in all (sum of ctx), or -1 if a context length is below 1 or
 * beyond its table (tables: int64 [B][width]) or a block it uses is not in the pools. */
static inline int64_t paged_positions(const int64_t *tables, int64_t width, const int64_t *ctx,
                                      int64_t B, int64_t block_size, int64_t n_blocks) {
    int64_t work = 0;
    for (int64_t b = 0; b < B; b++) {
        if (ctx[b] < 1 || ctx[b] > width * block_size) return -1;
        for (int64_t j = 0; j < (ctx[b] + block_size - 1) / block_size; j++)
            if (tables[b * width + j] < 0 || tables[b * width + j] >= n_blocks) return -1;
        work += ctx[b];
    }
    return work;
}

/* Where consecutive positions of a sequence (block table `table`) begin in a pool, plus `at`
 * values (a KV head's offset within the row of `row` values): one division where the cursor
 * starts (kv_cursor), then a step per position (kv_next), where a division per position took
 * a few percent of decode attention. */
typedef struct {
    const int64_t *table;
    int64_t blk, in, block_size, row, at; /* blk: index into table; in: position in the block */
} KvCursor;

static inline KvCursor kv_cursor(const int64_t *table, int64_t pos, int64_t block_size,
                                 int64_t row, int64_t at) {
    const KvCursor c = {table, pos / block_size, pos % block_size, block_size, row, at};
    return c;
}

/* the cursor's position's offset; the cursor moves on to the next position */
static inline int64_t kv_next(KvCursor *c) {
    const int64_t off = (c->table[c->blk] * c->block_size + c->in) * c->row + c->at;
    if (++c->in == c->block_size) {
        c->in = 0;
        c->blk++;
    }
    return off;
}

/* Prefetches the head_dim K and V values at offset `off` of the pools into L2 (T1): a task
 * asks for 16-64 positions' lines at once, more than L1 can have in flight; into L1 (T0) most
 * of them were lost, and 8 sequences of 1,000 positions took 1.9x as long (Zen 4). */
static inline void prefetch_position(const uint16_t *kpool, const uint16_t *vpool, int64_t off,
                                     int64_t head_dim) {
    for (int64_t l = 0; l < head_dim * 2; l += 64) {
        _mm_prefetch((const char *)(kpool + off) + l, _MM_HINT_T1);
        _mm_prefetch((const char *)(vpool + off) + l, _MM_HINT_T1);
    }
}

/* One task of decode attention (each build's own, over its vector registers): positions
 * [p0, p1) of a sequence (block table `table`) for KV head kh and its `group` query heads qh
 * (bf16 [group][head_dim]), into out_part (fp32 [group][2 + head_dim]: max, denominator,
 * unnormalized sum of V), or, with `out` (the sequence is one chunk), normalized into out
 * (bf16 [group][head_dim]). */
typedef void (*AttnChunk)(const uint16_t *qh, const uint16_t *kpool, const uint16_t *vpool,
                          const int64_t *table, int64_t p0, int64_t p1, int64_t kh,
                          int64_t group, int64_t head_dim, int64_t row, int64_t block_size,
                          float scale, float *out_part, uint16_t *out);
/* One task over whole rows: positions [p0, p1) of a sequence for all its num_kv_heads x group
 * query heads (q: bf16 [num_heads][head_dim]), into out_part (fp32 [num_heads][2 + head_dim])
 * or, with `out` (the sequence is one chunk), normalized into out (bf16 [num_heads][head_dim]).
 * A build offers it for num_heads <= ROWS_HEADS and num_heads * head_dim <= ROWS_VALUES (its
 * stack arrays). */
typedef void (*AttnRows)(const uint16_t *q, const uint16_t *kpool, const uint16_t *vpool,
                         const int64_t *table, int64_t p0, int64_t p1, int64_t num_kv_heads,
                         int64_t group, int64_t head_dim, int64_t block_size, float scale,
                         float *out_part, uint16_t *out);
#define ROWS_HEADS 32
#define ROWS_VALUES 4096
/* bf16 out[0..head_dim) = acc * inv (each build's own rounding to bf16) */
typedef void (*AttnStore)(uint16_t *out, const float *acc, float inv, int64_t head_dim);

/* One decode_attention call's operands and plan, as its tasks read them */
typedef struct {
    const uint16_t *q;
    int64_t ldq;
    const uint16_t *kpool, *vpool;
    const int64_t *tables;
    int64_t width;
    const int64_t *ctx;
    int64_t num_heads, num_kv_heads, head_dim, block_size;
    float scale;
    uint16_t *out;
    int64_t ldo;
    AttnChunk chunk_fn;
    AttnRows rows_fn; /* NULL: tasks per KV head (chunk_fn) */
    AttnStore store;
    const int64_t *first; /* attn_plan's */
    float *parts;
    int64_t sub; /* query heads per task */
} AttnStep;

/* Task `task`: a chunk of a sequence for a KV head's sub query heads from g0, or with rows_fn
 * for all its heads */
static inline void attn_run(const AttnStep *s, int64_t task) {
    const int64_t group = s->num_heads / s->num_kv_heads, pieces = (group + s->sub - 1) / s->sub;
    const int64_t row = s->num_kv_heads * s->head_dim, stride = 2 + s->head_dim;
    if (s->rows_fn) {
        int64_t p0, p1;
        const int64_t b = attn_task(s->first, s->ctx, s->block_size, 1, task, &p0, &p1);
        const int whole = s->first[b + 1] - s->first[b] == 1;
        s->rows_fn(s->q + b * s->ldq, s->kpool, s->vpool, s->tables + b * s->width, p0, p1,
                   s->num_kv_heads, group, s->head_dim, s->block_size, s->scale,
                   whole ? NULL : s->parts + task * s->num_heads * stride,
                   whole ? s->out + b * s->ldo : NULL);
        return;
    }
    const int64_t chunk = task / (s->num_kv_heads * pieces);
    const int64_t kh = task / pieces % s->num_kv_heads, g0 = task % pieces * s->sub;
    const int64_t gn = group - g0 < s->sub ? group - g0 : s->sub;
    int64_t p0, p1;
    const int64_t b = attn_task(s->first, s->ctx, s->block_size, 0, chunk, &p0, &p1);
    const int whole = s->first[b + 1] - s->first[b] == 1;
    const int64_t h0 = kh * group + g0; /* the task's first query head */
    s->chunk_fn(s->q + b * s->ldq + h0 * s->head_dim, s->kpool, s->vpool,
                s->tables + b * s->width, p0, p1, kh, gn, s->head_dim, row, s->block_size,
                s->scale, whole ? NULL : s->parts + (chunk * s->num_heads + h0) * stride,
                whole ? s->out + b * s->ldo + h0 * s->head_dim : NULL);
}

/* Head i % num_heads of sequence i / num_heads merged over its chunks, in order, where it has
 * several */
static inline void attn_finish_one(const AttnStep *s, int64_t i) {
    const int64_t b = i / s->num_heads, h = i % s->num_heads;
    if (s->first[b + 1] - s->first[b] < 2) return;
    float acc[256] __attribute__((aligned(64)));
    const float inv = attn_merge(s->parts, s->first, b, h, s->num_heads, s->head_dim, acc);
    s->store(s->out + b * s->ldo + h * s->head_dim, acc, inv, s->head_dim);
}

/* The sequences of several chunks merged, in order; the plan freed */
static inline void attn_finish(const AttnStep *s, int64_t B) {
    for (int64_t i = 0; i < B * s->num_heads; i++) attn_finish_one(s, i);
    free((void *)s->first);
    free(s->parts);
}

/* Tasks [0, tasks) of st on thread id of nth: a share of consecutive tasks of its own first,
 * then what it takes from the others' (cpu_team.h's share_next; fixed shares where ranges is
 * NULL). Consecutive tasks are a chunk's KV heads in turn, whose K and V rows lie together:
 * taken one at a time by whichever thread was free (dynamic scheduling), 8 sequences of 1,500
 * positions took 1.2x as long (Zen 2). */
static inline void attn_share(const AttnStep *st, int64_t tasks, int64_t *ranges, int64_t nth,
                              int64_t id) {
    Share share = share_of(ranges, tasks, 1, nth, id);
    int64_t t0, t1;
    while (share_next(&share, &t0, &t1))
        for (int64_t task = t0; task < t1; task++) attn_run(st, task);
}

/* decode_attention (operands in cpu_kernels.h) with one build's tasks and store: with rows_fn
 * (and at most ROWS_HEADS query heads of ROWS_VALUES values in all) one task per chunk of a
 * sequence for all its heads, else one task per KV head (or piece of its query heads,
 * attn_heads_per_task) and chunk; the tasks shared by the threads (the calling team's,
 * cpu_team.h, or a team of their own; attn_share) through claim (zeroed ranges a line per
 * thread, cpu_team.h's share_next, that the calling team's threads share; NULL: a team of its
 * own makes them, and a calling team's threads keep fixed shares); then the sequences of
 * several chunks merged, in a team split over its threads. max_group: the most query heads per
 * KV head chunk_fn takes. */
static inline int paged_decode_attention(
    const uint16_t *q, int64_t ldq, const uint16_t *kpool, const uint16_t *vpool,
    int64_t n_blocks, const int64_t *tables, int64_t width, const int64_t *ctx, int64_t B,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
    uint16_t *out, int64_t ldo, int64_t *claim, int64_t max_group, AttnChunk chunk_fn,
    AttnRows rows_fn, AttnStore store) {
    const int64_t group = num_heads / num_kv_heads;
    if (group > max_group || head_dim % 16 || head_dim > 256) return -1;
    if (num_heads > ROWS_HEADS || num_heads * head_dim > ROWS_VALUES) rows_fn = NULL;
    const int rows = rows_fn != NULL;
    const int64_t work = paged_positions(tables, width, ctx, B, block_size, n_blocks);
    if (work < 0) return -1;
    int64_t *first = NULL, chunks;
    float *parts = NULL;
    const int team = in_team();
    /* a team's threads each make the plan of a step without split sequences on their stack
     * (the same values: no thread waits for another's), else one thread makes it for all */
    int64_t room[ATTN_ROOM];
    const int whole = team && B < ATTN_ROOM && attn_first(ctx, B, block_size, rows, room) == B;
    if (whole) {
        first = room;
        chunks = B;
    } else if (team) {
#pragma omp single copyprivate(first, parts, chunks)
        chunks = attn_plan(ctx, B, block_size, rows, num_heads, head_dim, &first, &parts);
    } else {
        chunks = attn_plan(ctx, B, block_size, rows, num_heads, head_dim, &first, &parts);
    }
    if (chunks < 0) return -2;
    const int64_t sub = rows ? group
                             : attn_heads_per_task(chunks * num_kv_heads, group,
                                                   team ? omp_get_num_threads()
                                                        : omp_get_max_threads());
    const int64_t tasks = rows ? chunks : chunks * num_kv_heads * ((group + sub - 1) / sub);
    const AttnStep st = {q, ldq, kpool, vpool, tables, width, ctx, num_heads, num_kv_heads,
                         head_dim, block_size, scale, out, ldo, chunk_fn, rows_fn, store, first,
                         parts, sub};
    if (team) { /* the calling team's threads share the tasks (cpu_team.h) */
        attn_share(&st, tasks, claim, omp_get_num_threads(), omp_get_thread_num());
#pragma omp barrier
        if (!whole) { /* the merges split over the team; its end the kernel's barrier */
#pragma omp for schedule(static)
            for (int64_t i = 0; i < B * num_heads; i++) attn_finish_one(&st, i);
#pragma omp single nowait
            {
                free(first);
                free(parts);
            }
        }
        return 0;
    }
    SHARE_OWN(own, claim);
    int64_t *ranges = share_ranges(claim, own);
#pragma omp parallel if (work * num_heads * head_dim >= ATTN_PAR_MIN)
    attn_share(&st, tasks, ranges, omp_get_num_threads(), omp_get_thread_num());
    attn_finish(&st, B);
    return 0;
}

#endif
