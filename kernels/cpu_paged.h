/* The ISA-neutral part of decode attention over the paged KV pools (cpu_ops.c, cpu_ops_avx2.c):
 * pools are bf16 [blocks][block_size][num_kv_heads][head_dim], a sequence's blocks scattered
 * through them by its block table. */
#ifndef LOCALLLM_CPU_PAGED_H
#define LOCALLLM_CPU_PAGED_H

#include <immintrin.h>
#include <stdint.h>

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

/* Where position pos of a sequence (block table `table`) begins in a pool, plus `at` values
 * (a KV head's offset within the row of `row` values) */
static inline int64_t kv_offset(const int64_t *table, int64_t pos, int64_t block_size,
                                int64_t row, int64_t at) {
    return (table[pos / block_size] * block_size + pos % block_size) * row + at;
}

/* Prefetches the head_dim K and V values at offset `off` of the pools */
static inline void prefetch_position(const uint16_t *kpool, const uint16_t *vpool, int64_t off,
                                     int64_t head_dim) {
    for (int64_t l = 0; l < head_dim * 2; l += 64) {
        _mm_prefetch((const char *)(kpool + off) + l, _MM_HINT_T0);
        _mm_prefetch((const char *)(vpool + off) + l, _MM_HINT_T0);
    }
}

/* Prefetches the K and V lines of positions 0..n-1 of block blk for one KV head (the head's
 * head_dim values at offset `at` of each position's row of `row` values). */
static inline void prefetch_block(const uint16_t *kpool, const uint16_t *vpool, int64_t blk,
                                  int64_t n, int64_t block_size, int64_t row, int64_t at,
                                  int64_t head_dim) {
    for (int64_t p = 0; p < n; p++)
        prefetch_position(kpool, vpool, (blk * block_size + p) * row + at, head_dim);
}

#endif
