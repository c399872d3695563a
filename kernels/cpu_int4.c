/* Int4 weight-only matmuls on PyTorch's packed int4 CPU layout: a few rows (decode) on
 * AVX-512 BF16, many rows (prompts, `int4_gemm` at the end of this file) on AMX tiles.
 *
 * y[m, n] = sum_k x[m, k mod K] * ((c[n, k] - 8) * s[k / gs, n] + z[k / gs, n]),  k < planes * K
 * with groups of gs = 32 columns (Q4_0, Q4_1, Q4_K, Q8_0, Q5_*) or 16 (Q2_K, Q3_K, Q6_K);
 * codebook weights (IQ4_NL, IQ4_XS, NF4) use lut[c] in place of c - 8: `lut` holds 32 bf16
 * values, the codebook's bf16 roundings hi[16] and what they leave, lo[16] = bf16(v - hi) (zero
 * for the integer IQ4 codebooks), so that hi + lo carries NF4's values to about 2^-17.
 *
 * Layout (the one `torch.ops.aten._weight_int4pack_mm_for_cpu` reads; see
 * localllm/layers/cpu_packed.py): `packed` is [n_pad / 64][K2][32] bytes, K2 = planes * K;
 * byte j of column k in tile t holds row 64t + j in its low nibble and row 64t + 32 + j in its
 * high nibble. `sz` is bf16 [K2 / gs][n_pad][2]: (scale, zero) of each group and row; or, for a
 * symmetric weight with fp16 scales (Q4_0, Q5_0, Q8_0, IQ4_NL), `half_scales` and sz is those
 * fp16 scales alone, [K / gs][n_pad], with the zeros implied (see `Scales`).
 * With two planes (grouped int8 split as q = 16 h + l), plane p reads x[k - p K].
 *
 * How it computes (AVX-512 BF16): one 64-byte load holds columns k and k+1 of a 64-row tile.
 * Each nibble c becomes the bf16 number 128 + c (bits 0x4300 | c: exact), laid out as (k, k+1)
 * pairs per row, so that `vdpbf16ps` adds x[k] (128 + c[n,k]) + x[k+1] (128 + c[n,k+1]) into
 * one fp32 lane per row. Per group of gs columns, with a = that sum and sx = sum of x:
 *     sum_k x (c - 8) s + z x  =  s a + (z - 136 s) sx
 * Products of bf16 numbers are exact in fp32; sums are fp32. Rows are split across OpenMP
 * threads by tiles; this library links the libgomp that PyTorch already loaded (same soname),
 * so it shares PyTorch's thread team and thread count.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_simd.h"

#define TILE 64
#define GROUP 32
#define PREFETCH_GROUPS 4
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 4096 /* weight bytes read ahead of use: the tile stream comes from DRAM */
#endif

/* bytes 4i and 4i+2 of every 32-bit lane come from the nibbles; 4i+1 and 4i+3 are zero */
#define PAIR_MASK 0x5555555555555555ULL

/* vpermb indices: 32-bit lane i of the result takes bytes (f + i, 32 + f + i) of the source,
 * f = 0 (rows 0-15 of a nibble plane) or 16 (rows 16-31) */
#define PAIR(f, i) (f) + (i), 0, 32 + (f) + (i), 0
#define PAIRS(f) PAIR(f, 0), PAIR(f, 1), PAIR(f, 2), PAIR(f, 3), PAIR(f, 4), PAIR(f, 5), \
    PAIR(f, 6), PAIR(f, 7), PAIR(f, 8), PAIR(f, 9), PAIR(f, 10), PAIR(f, 11), PAIR(f, 12), \
    PAIR(f, 13), PAIR(f, 14), PAIR(f, 15)
static const uint8_t PAIR_INDEX[2][64] __attribute__((aligned(64))) = {{PAIRS(0)}, {PAIRS(16)}};

/* Columns k, k+1 of a 64-row tile (64 bytes) -> four vectors of (k, k+1) bf16 pairs, 128 + c,
 * for rows 0-15, 16-31, 32-47, 48-63. */
static inline __attribute__((always_inline)) void unpack_pairs(__m512i b, __m512i w[4]) {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const __m512i bias = _mm512_set1_epi32(0x43004300); /* bf16 128 = 0x4300 */
    const __m512i idx_a = _mm512_load_si512(PAIR_INDEX[0]);
    const __m512i idx_b = _mm512_load_si512(PAIR_INDEX[1]);
    const __m512i lo = _mm512_and_si512(b, low4);
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), low4);
    /* merge masking: the high byte of each bf16 comes from `bias` (0x43), the low one is c */
    w[0] = _mm512_mask_permutexvar_epi8(bias, PAIR_MASK, idx_a, lo);
    w[1] = _mm512_mask_permutexvar_epi8(bias, PAIR_MASK, idx_b, lo);
    w[2] = _mm512_mask_permutexvar_epi8(bias, PAIR_MASK, idx_a, hi);
    w[3] = _mm512_mask_permutexvar_epi8(bias, PAIR_MASK, idx_b, hi);
}

/* The same four vectors for a codebook weight: each code c becomes lut[c], a bf16 value, and
 * with TERMS = 2 also wlo[r] = lut_lo[c] (the codebook's remainder); the epilogue adds no
 * bias. */
static inline __attribute__((always_inline)) void unpack_pairs_lut(
    __m512i b, __m512i w[4], __m512i wlo[4], __m512i lut, __m512i lut_lo, const int TERMS) {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const __m512i idx_a = _mm512_load_si512(PAIR_INDEX[0]);
    const __m512i idx_b = _mm512_load_si512(PAIR_INDEX[1]);
    const __m512i lo = _mm512_and_si512(b, low4);
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), low4);
    /* 16-bit lanes holding the codes, then a 16-entry table lookup (vpermw) */
    const __m512i c[4] = {_mm512_maskz_permutexvar_epi8(PAIR_MASK, idx_a, lo),
                          _mm512_maskz_permutexvar_epi8(PAIR_MASK, idx_b, lo),
                          _mm512_maskz_permutexvar_epi8(PAIR_MASK, idx_a, hi),
                          _mm512_maskz_permutexvar_epi8(PAIR_MASK, idx_b, hi)};
    for (int r = 0; r < 4; r++) {
        w[r] = _mm512_permutexvar_epi16(c[r], lut);
        if (TERMS == 2) wlo[r] = _mm512_permutexvar_epi16(c[r], lut_lo);
    }
}

/* USE_LUT: 0 plain codes, 1 a codebook exact in bf16, 2 a codebook in two bf16 terms */
static inline __attribute__((always_inline)) void unpack(__m512i b, __m512i w[4], __m512i wlo[4],
                                                         const int USE_LUT, __m512i lut,
                                                         __m512i lut_lo) {
    if (USE_LUT)
        unpack_pairs_lut(b, w, wlo, lut, lut_lo, USE_LUT);
    else
        unpack_pairs(b, w);
}

/* the fp32 codebook hi + lo of a `lut` (see the top of this file) */
static inline __m512 codebook_f32(const uint16_t *lut) {
    return lut ? _mm512_add_ps(load_bf16(lut, 0xFFFF), load_bf16(lut + 16, 0xFFFF))
               : _mm512_setzero_ps();
}

/* A weight's per-group scales and zeros, in one of two forms:
 *   pairs: bf16 [K2 / gs][n_pad][2], (scale, zero) per group and row;
 *   half:  fp16 [K / gs][n_pad], the scale s alone of a symmetric weight, exact as stored in the
 *          file; one plane: (c - 8) s; two planes (q = 16 h + l, the same s for both):
 *          plane H (c - 8) 16 s, plane L (c - 8) s + 8 s. */
typedef struct {
    const uint16_t *p;
    int64_t n_pad, plane_groups; /* plane_groups = K / gs */
    int half, planes;
} Scales;

static inline Scales scales_of(const uint16_t *sz, int64_t n_pad, int64_t K, int64_t gs,
                               int64_t planes, int64_t half) {
    const Scales s = {sz, n_pad, K / gs, half != 0, (int)planes};
    return s;
}

/* where group g's values for row `row` begin (prefetching) */
static inline const char *scales_at(const Scales *s, int64_t g, int64_t row) {
    if (s->half) return (const char *)(s->p + (g % s->plane_groups) * s->n_pad + row);
    return (const char *)(s->p + (g * s->n_pad + row) * 2);
}

/* Scale of rows row..row+15 in group g (g < K2 / gs), fp32; *zero_adj gets zero - bias * scale.
 * Pairs: 32-bit lane j holds the scale in its low half, the zero in its high half. */
static inline __m512 group_scale(const Scales *s, int64_t g, int64_t row, float bias,
                                 __m512 *zero_adj) {
    __m512 sc, zr;
    if (s->half) {
        const __m512 h = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)scales_at(s, g, row)));
        const int two = s->planes == 2, plane_h = two && g < s->plane_groups;
        sc = plane_h ? _mm512_mul_ps(h, _mm512_set1_ps(16.0f)) : h;
        zr = two && !plane_h ? _mm512_mul_ps(h, _mm512_set1_ps(8.0f)) : _mm512_setzero_ps();
    } else {
        const __m512i v = _mm512_loadu_si512(s->p + (g * s->n_pad + row) * 2);
        sc = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
        zr = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000u)));
    }
    *zero_adj = _mm512_fnmadd_ps(sc, _mm512_set1_ps(bias), zr);
    return sc;
}

/* NT consecutive 64-row tiles for MR rows of x (NT * MR <= 2: 16 accumulators and 16 sums
 * fit the 32 vector registers). out[(i * MR + m) * 64 + row] gets tile i's rows for x row m,
 * in fp32. Every (tile, row) pair is summed in the same order whatever NT and MR are, so a row
 * of x gets the same result alone or in a batch. */
static inline __attribute__((always_inline)) void tiles_rows(
    const uint8_t *tile, int64_t tile_bytes, const Scales *sz, int64_t row0,
    const uint16_t *x, int64_t ldx, int64_t K, int64_t groups, const float *xsum, float *out,
    const int NT, const int MR, const int GS, const int USE_LUT, __m512i lut, __m512i lut_lo) {
    __m512 y[2][2][4]; /* [NT][MR][4]: fixed sizes, so that they live in registers */
    for (int i = 0; i < NT; i++)
        for (int m = 0; m < MR; m++)
            for (int r = 0; r < 4; r++) y[i][m][r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        if (g + PREFETCH_GROUPS < groups) {
            for (int i = 0; i < NT; i++) {
                const char *ps = scales_at(sz, g + PREFETCH_GROUPS, row0 + i * TILE);
                for (int l = 0; l < 4; l++) _mm_prefetch(ps + 64 * l, _MM_HINT_T0);
            }
        }
        __m512 a[2][2][4];
        for (int i = 0; i < NT; i++)
            for (int m = 0; m < MR; m++)
                for (int r = 0; r < 4; r++) a[i][m][r] = _mm512_setzero_ps();
        const int64_t kx = g * GS - (g * GS >= K ? K : 0); /* plane 1 reads x again */
        for (int kp = 0; kp < GS / 2; kp++) {
            int32_t pair[2];
            for (int m = 0; m < MR; m++) __builtin_memcpy(&pair[m], x + m * ldx + kx + 2 * kp, 4);
            for (int i = 0; i < NT; i++) {
                const uint8_t *p = tile + i * tile_bytes + (g * GS + 2 * kp) * 32;
                _mm_prefetch((const char *)p + PREFETCH_BYTES, _MM_HINT_T0);
                __m512i w[4], wlo[4];
                unpack(_mm512_loadu_si512(p), w, wlo, USE_LUT, lut, lut_lo);
                for (int m = 0; m < MR; m++) {
                    const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair[m]);
                    for (int r = 0; r < 4; r++) {
                        a[i][m][r] = _mm512_dpbf16_ps(a[i][m][r], (__m512bh)w[r], xb);
                        if (USE_LUT == 2)
                            a[i][m][r] = _mm512_dpbf16_ps(a[i][m][r], (__m512bh)wlo[r], xb);
                    }
                }
            }
        }
        for (int i = 0; i < NT; i++) {
            for (int r = 0; r < 4; r++) {
                __m512 zz; /* z - 136 s */
                const __m512 sc = group_scale(sz, g, row0 + i * TILE + 16 * r,
                                              USE_LUT ? 0.0f : 136.0f, &zz);
                for (int m = 0; m < MR; m++) {
                    y[i][m][r] = _mm512_fmadd_ps(sc, a[i][m][r], y[i][m][r]);
                    y[i][m][r] = _mm512_fmadd_ps(zz, _mm512_set1_ps(xsum[m * groups + g]),
                                                 y[i][m][r]);
                }
            }
        }
    }
    for (int i = 0; i < NT; i++)
        for (int m = 0; m < MR; m++)
            for (int r = 0; r < 4; r++)
                _mm512_storeu_ps(out + (i * MR + m) * TILE + 16 * r, y[i][m][r]);
}

/* One 64-row tile for 4 rows of x: the same sums as tiles_rows, in the same order, with the
 * 16 group sums in registers and the running outputs in out[m][64] (fp32) instead. */
static inline __attribute__((always_inline)) void tile_rows4(
    const uint8_t *tile, const Scales *sz, int64_t row0, const uint16_t *x,
    int64_t ldx, int64_t K, int64_t groups, const float *xsum, float *out, const int GS,
    const int USE_LUT, __m512i lut, __m512i lut_lo) {
    for (int i = 0; i < 4 * TILE; i += 16) _mm512_storeu_ps(out + i, _mm512_setzero_ps());
    for (int64_t g = 0; g < groups; g++) {
        if (g + PREFETCH_GROUPS < groups) {
            const char *ps = scales_at(sz, g + PREFETCH_GROUPS, row0);
            for (int l = 0; l < 4; l++) _mm_prefetch(ps + 64 * l, _MM_HINT_T0);
        }
        __m512 a[4][4];
        for (int m = 0; m < 4; m++)
            for (int r = 0; r < 4; r++) a[m][r] = _mm512_setzero_ps();
        const int64_t kx = g * GS - (g * GS >= K ? K : 0); /* plane 1 reads x again */
        for (int kp = 0; kp < GS / 2; kp++) {
            const uint8_t *p = tile + (g * GS + 2 * kp) * 32;
            _mm_prefetch((const char *)p + PREFETCH_BYTES, _MM_HINT_T0);
            __m512i w[4], wlo[4];
            unpack(_mm512_loadu_si512(p), w, wlo, USE_LUT, lut, lut_lo);
            for (int m = 0; m < 4; m++) {
                int32_t pair;
                __builtin_memcpy(&pair, x + m * ldx + kx + 2 * kp, 4);
                const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
                for (int r = 0; r < 4; r++) {
                    a[m][r] = _mm512_dpbf16_ps(a[m][r], (__m512bh)w[r], xb);
                    if (USE_LUT == 2)
                        a[m][r] = _mm512_dpbf16_ps(a[m][r], (__m512bh)wlo[r], xb);
                }
            }
        }
        for (int r = 0; r < 4; r++) {
            __m512 zz; /* z - 136 s */
            const __m512 sc = group_scale(sz, g, row0 + 16 * r, USE_LUT ? 0.0f : 136.0f, &zz);
            for (int m = 0; m < 4; m++) {
                float *o = out + m * TILE + 16 * r;
                __m512 y = _mm512_fmadd_ps(sc, a[m][r], _mm512_loadu_ps(o));
                y = _mm512_fmadd_ps(zz, _mm512_set1_ps(xsum[m * groups + g]), y);
                _mm512_storeu_ps(o, y);
            }
        }
    }
}



/* ---- AMX (Sapphire Rapids and later): the same sums with tile matmuls ----
 *
 * Per 64-row tile and group of 32 columns (groups of 16 stay on AVX-512), the unpacked
 * (k, k+1) pairs of four 16-row blocks are exactly four B tiles of TDPBF16PS (16 pair rows x 16 columns); x's rows for the group
 * are the A tile; C (x rows x 16 fp32) = sum x (128 + c), then the same epilogue as above.
 * Each output element is summed within one tile op whatever the number of rows, so a row's
 * result does not depend on its batch; once enabled, every call takes this path. */
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define AMX_ROWS 16
#ifndef AMX_MIN_ROWS
#define AMX_MIN_ROWS 2 /* one row stays on AVX-512 (see cpu_native.amx_enabled) */
#endif

static int amx_enabled = 0;   /* decode batches on tiles (LOCALLLM_AMX=1) */
static int amx_permitted = 0; /* the OS lets this process use tiles (int4_gemm_ready) */

/* on = 1: ask the kernel for the AMX tile state and use it; 0: stop using it; -1: only ask
 * whether it is in use. Returns whether AMX is in use. */
/* Asks the kernel for the AMX tile state once; returns whether tiles may be used at all (the
 * prompt matmuls below, and decode batches once int4_amx_enable turns them on). */
int int4_gemm_ready(void) {
    static int asked = 0;
    if (!asked) {
        asked = 1;
        amx_permitted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }
    return amx_permitted;
}

int int4_amx_enable(int on) {
    if (on == 1)
        amx_enabled = int4_gemm_ready();
    else if (on == 0)
        amx_enabled = 0;
    return amx_enabled;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) TileConfig;

/* tmm0-3: C for the four 16-row blocks of a tile; tmm4: A (x); tmm5-7: B */
static void amx_config(int64_t mr) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) {
        cfg.colsb[i] = 64;
        cfg.rows[i] = i < 5 ? (uint8_t)mr : 16;
    }
    _tile_loadconfig(&cfg);
}

static void amx_tiles(const uint16_t *x, int64_t M, int64_t K, int64_t ldx,
                      const uint8_t *packed, const Scales *sz, int64_t N, int64_t n_pad,
                      int64_t groups, const float *xsum, uint16_t *y, int64_t ldy) {
    const int64_t tiles = n_pad / TILE, tile_bytes = groups * GROUP * 32;
#pragma omp parallel
    {
        uint16_t bt[4][16][32] __attribute__((aligned(64))); /* B tiles: [r][pair row][n, 2] */
        float ct[4][AMX_ROWS][16] __attribute__((aligned(64)));
        float acc[AMX_ROWS][TILE] __attribute__((aligned(64)));
        int64_t configured = 0;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            const uint8_t *tile = packed + t * tile_bytes;
            for (int64_t m0 = 0; m0 < M; m0 += AMX_ROWS) {
                const int64_t mr = M - m0 < AMX_ROWS ? M - m0 : AMX_ROWS;
                if (mr != configured) {
                    amx_config(mr);
                    configured = mr;
                }
                memset(acc, 0, sizeof(float) * (size_t)(mr * TILE));
                for (int64_t g = 0; g < groups; g++) {
                    const uint8_t *p = tile + g * GROUP * 32;
                    _mm_prefetch((const char *)p + PREFETCH_BYTES, _MM_HINT_T0);
                    for (int kp = 0; kp < GROUP / 2; kp++) {
                        if (kp % 2 == 0)
                            _mm_prefetch((const char *)p + 64 * kp + PREFETCH_BYTES + 64,
                                         _MM_HINT_T0);
                        __m512i w[4];
                        unpack_pairs(_mm512_loadu_si512(p + 64 * kp), w);
                        for (int r = 0; r < 4; r++) _mm512_store_si512(bt[r][kp], w[r]);
                    }
                    const int64_t kx = g * GROUP - (g * GROUP >= K ? K : 0);
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_zero(2);
                    _tile_zero(3);
                    _tile_loadd(4, x + m0 * ldx + kx, ldx * 2);
                    _tile_loadd(5, bt[0], 64);
                    _tile_loadd(6, bt[1], 64);
                    _tile_loadd(7, bt[2], 64);
                    _tile_dpbf16ps(0, 4, 5);
                    _tile_dpbf16ps(1, 4, 6);
                    _tile_dpbf16ps(2, 4, 7);
                    _tile_loadd(5, bt[3], 64);
                    _tile_dpbf16ps(3, 4, 5);
                    _tile_stored(0, ct[0], 64);
                    _tile_stored(1, ct[1], 64);
                    _tile_stored(2, ct[2], 64);
                    _tile_stored(3, ct[3], 64);
                    for (int r = 0; r < 4; r++) {
                        __m512 zz; /* z - 136 s */
                        const __m512 sc = group_scale(sz, g, t * TILE + 16 * r, 136.0f, &zz);
                        for (int64_t m = 0; m < mr; m++) {
                            __m512 a = _mm512_load_ps(acc[m] + 16 * r);
                            a = _mm512_fmadd_ps(sc, _mm512_load_ps(ct[r][m]), a);
                            a = _mm512_fmadd_ps(zz, _mm512_set1_ps(xsum[(m0 + m) * groups + g]), a);
                            _mm512_store_ps(acc[m] + 16 * r, a);
                        }
                    }
                }
                const int64_t n0 = t * TILE, rows = N - n0 < TILE ? N - n0 : TILE;
                for (int64_t m = 0; m < mr; m++)
                    for (int64_t r = 0; r < rows; r += 16)
                        store_floats_bf16(acc[m] + r, y + (m0 + m) * ldy + n0 + r, rows - r);
            }
        }
        if (configured) _tile_release();
    }
}

/* x: bf16 [M][ldx] (K used); y: bf16 [M][ldy] (N written). Returns 0, or -1 if out of memory. */
/* The tiles of [t0, t1) for all M rows, with groups of GS columns. */
static inline __attribute__((always_inline)) void tile_loop(
    const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *packed,
    const Scales *sz, int64_t N, int64_t n_pad, int64_t K2, const float *xsum, uint16_t *y,
    int64_t ldy, const int GS, const int USE_LUT, __m512i lut, __m512i lut_lo) {
    const int64_t tiles = n_pad / TILE, groups = K2 / GS, tile_bytes = K2 * 32;
    /* one row of x: tiles go two at a time (independent sums hide vdpbf16ps's latency);
     * more rows: one tile at a time, rows four (then two, one) at a time */
    const int64_t step = M == 1 ? 2 : 1, units = (tiles + step - 1) / step;
#pragma omp parallel for schedule(static)
    for (int64_t u = 0; u < units; u++) {
        float out[4 * TILE];
        const int64_t t = u * step, nt = tiles - t < step ? tiles - t : step;
        const uint8_t *tile = packed + t * tile_bytes;
        const int64_t row0 = t * TILE;
        for (int64_t m = 0; m < M;) {
            const int64_t mr = M - m >= 4 ? 4 : M - m >= 2 ? 2 : 1;
            const uint16_t *xm = x + m * ldx;
            const float *xs = xsum + m * groups;
            if (mr == 4)
                tile_rows4(tile, sz, row0, xm, ldx, K, groups, xs, out, GS, USE_LUT, lut, lut_lo);
            else if (nt == 2)
                tiles_rows(tile, tile_bytes, sz, row0, xm, ldx, K, groups, xs, out, 2, 1, GS,
                           USE_LUT, lut, lut_lo);
            else if (mr == 2)
                tiles_rows(tile, tile_bytes, sz, row0, xm, ldx, K, groups, xs, out, 1, 2, GS,
                           USE_LUT, lut, lut_lo);
            else
                tiles_rows(tile, tile_bytes, sz, row0, xm, ldx, K, groups, xs, out, 1, 1, GS,
                           USE_LUT, lut, lut_lo);
            /* out holds (tile i, row m + j) at (i * mr + j) * 64 */
            for (int64_t i = 0; i < nt; i++) {
                const int64_t n0 = (t + i) * TILE, rows = N - n0 < TILE ? N - n0 : TILE;
                for (int64_t j = 0; j < mr; j++)
                    for (int64_t r = 0; r < rows; r += 16)
                        store_floats_bf16(out + (i * mr + j) * TILE + r,
                                          y + (m + j) * ldy + n0 + r, rows - r);
            }
            m += mr;
        }
    }
}

/* x: bf16 [M][ldx] (K used); y: bf16 [M][ldy] (N written); groups of gs = 32 or 16 columns;
 * lut: NULL (weights (c - 8) s + z) or a codebook's 32 bf16 values hi | lo (weights
 * (hi[c] + lo[c]) s + z; see the top of this file);
 * half_scales: sz holds fp16 scales alone (see `Scales`).
 * Returns 0, -1 if out of memory, -2 for another group size. */
static int mm(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *packed,
              const uint16_t *sz_p, int64_t N, int64_t n_pad, int64_t planes, uint16_t *y,
              int64_t ldy, int64_t gs, const uint16_t *lut, int64_t half_scales, int amx) {
    if (gs != 32 && gs != 16) return -2;
    const Scales scales = scales_of(sz_p, n_pad, K, gs, planes, half_scales), *sz = &scales;
    const int64_t K2 = planes * K, groups = K2 / gs;
    float *xsum = malloc(sizeof(float) * (size_t)(M * groups));
    if (!xsum) return -1;
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < groups; g++) {
            const uint16_t *xg = x + m * ldx + (g * gs) % K;
            float acc = 0.0f;
            for (int i = 0; i < gs; i++) {
                uint32_t bits = (uint32_t)xg[i] << 16;
                float f;
                __builtin_memcpy(&f, &bits, 4);
                acc += f;
            }
            xsum[m * groups + g] = acc;
        }
    const __m512i lutv = lut ? _mm512_maskz_loadu_epi16(0xFFFF, lut) : _mm512_setzero_si512();
    const __m512i lutlo = lut ? _mm512_maskz_loadu_epi16(0xFFFF, lut + 16) : _mm512_setzero_si512();
    /* a codebook exact in bf16 (lo all zero: 0x0000 or 0x8000) takes one product per weight */
    const int terms = !lut ? 0
                      : _mm512_test_epi16_mask(lutlo, _mm512_set1_epi16(0x7FFF)) ? 2 : 1;
    if (amx && gs == GROUP && !lut)
        amx_tiles(x, M, K, ldx, packed, sz, N, n_pad, groups, xsum, y, ldy);
    else if (gs == 32 && terms == 0)
        tile_loop(x, M, K, ldx, packed, sz, N, n_pad, K2, xsum, y, ldy, 32, 0, lutv, lutlo);
    else if (gs == 16 && terms == 0)
        tile_loop(x, M, K, ldx, packed, sz, N, n_pad, K2, xsum, y, ldy, 16, 0, lutv, lutlo);
    else if (gs == 32 && terms == 1)
        tile_loop(x, M, K, ldx, packed, sz, N, n_pad, K2, xsum, y, ldy, 32, 1, lutv, lutlo);
    else if (gs == 16 && terms == 1)
        tile_loop(x, M, K, ldx, packed, sz, N, n_pad, K2, xsum, y, ldy, 16, 1, lutv, lutlo);
    else if (gs == 32)
        tile_loop(x, M, K, ldx, packed, sz, N, n_pad, K2, xsum, y, ldy, 32, 2, lutv, lutlo);
    else
        tile_loop(x, M, K, ldx, packed, sz, N, n_pad, K2, xsum, y, ldy, 16, 2, lutv, lutlo);
    free(xsum);
    return 0;
}

int int4_mm(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *packed,
            const uint16_t *sz, int64_t N, int64_t n_pad, int64_t planes, uint16_t *y,
            int64_t ldy, int64_t gs, const uint16_t *lut, int64_t half_scales) {
    return mm(x, M, K, ldx, packed, sz, N, n_pad, planes, y, ldy, gs, lut, half_scales,
              amx_enabled && M >= AMX_MIN_ROWS);
}

/* int4_mm on AMX tiles for a prompt's rows, whatever `amx_enabled` says (which is about
 * decoding rows, whose results must not depend on their batch): groups of 32 without a
 * codebook; other weights take the AVX-512 path. Call int4_gemm_ready first. */
int int4_mm_tiles(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *packed,
                  const uint16_t *sz, int64_t N, int64_t n_pad, int64_t planes, uint16_t *y,
                  int64_t ldy, int64_t gs, const uint16_t *lut, int64_t half_scales) {
    return mm(x, M, K, ldx, packed, sz, N, n_pad, planes, y, ldy, gs, lut, half_scales,
              amx_permitted);
}


/* Per-group scales of every plane for rows 16r..16r+15 of tile t: sc[p][r], and zz[p][r] =
 * zero - bias * scale (bias 8: (c - 8) s + z = c s + zz; codebook weights: bias 0). */
static inline __attribute__((always_inline)) void tile_group_scales(
    const Scales *sz, int64_t K, int64_t gs, int64_t planes, int64_t t, int64_t g, float bias,
    __m512 sc[2][4], __m512 zz[2][4]) {
    for (int64_t p = 0; p < planes; p++)
        for (int r = 0; r < 4; r++)
            sc[p][r] = group_scale(sz, p * K / gs + g, t * TILE + 16 * r, bias, &zz[p][r]);
}

/* Column k of a 64-row tile as fp32 weights, planes summed: w[r] holds rows 16r..16r+15. */
static inline __attribute__((always_inline)) void tile_column(
    const uint8_t *tile, int64_t K, int64_t planes, int64_t k, const uint16_t *lut, __m512 lutf,
    __m512 sc[2][4], __m512 zz[2][4], __m512 w[4]) {
    for (int64_t p = 0; p < planes; p++) {
        const __m256i b = _mm256_loadu_si256((const __m256i *)(tile + (p * K + k) * 32));
        const __m256i lo = _mm256_and_si256(b, _mm256_set1_epi8(0x0F));
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), _mm256_set1_epi8(0x0F));
        const __m128i q[4] = {_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1),
                              _mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1)};
        for (int r = 0; r < 4; r++) {
            const __m512i ci = _mm512_cvtepu8_epi32(q[r]);
            const __m512 c = lut ? _mm512_permutexvar_ps(ci, lutf) : _mm512_cvtepi32_ps(ci);
            const __m512 v = _mm512_fmadd_ps(c, sc[p][r], zz[p][r]);
            w[r] = p ? _mm512_add_ps(w[r], v) : v;
        }
    }
}

/* W^T in bf16 for a dense matmul over many rows (prefill): wt[k][n] = sum over planes of
 * (c[n, k] - 8) s[k / gs, n] + z[k / gs, n], summed in fp32 and rounded once, for k < K and
 * n < n_pad (the padded rows come out as 0). wt: bf16 [K][n_pad]. */
void int4_dequant_t(const uint8_t *packed, const uint16_t *sz_p, int64_t K, int64_t n_pad,
                    int64_t planes, uint16_t *wt, int64_t gs, const uint16_t *lut,
                    int64_t half_scales) {
    const Scales scales = scales_of(sz_p, n_pad, K, gs, planes, half_scales), *sz = &scales;
    /* codebook weights: lut[c] s + z; others (c - 8) s + z = c s + (z - 8 s) */
    const __m512 lutf = codebook_f32(lut);
    const float bias = lut ? 0.0f : 8.0f;
    const int64_t K2 = planes * K;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < n_pad / TILE; t++) {
        const uint8_t *tile = packed + t * K2 * 32;
        for (int64_t g = 0; g < K / gs; g++) {
            __m512 sc[2][4], zz[2][4], w[4];
            tile_group_scales(sz, K, gs, planes, t, g, bias, sc, zz);
            for (int64_t k = g * gs; k < (g + 1) * gs; k++) {
                tile_column(tile, K, planes, k, lut, lutf, sc, zz, w);
                uint16_t *dst = wt + k * n_pad + t * TILE;
                for (int r = 0; r < 4; r++)
                    store_bf16(dst + 16 * r, w[r], 0xFFFF);
            }
        }
    }
}


/* ---- Prefill on AMX: x @ W^T for many rows without a dequantized W^T ----
 *
 * Per 64-row weight tile, its bf16 weights -- the same values int4_dequant_t writes, rounded
 * once -- go to a per-thread buffer in the pair layout TDPBF16PS takes as B (16 columns n by
 * 16 pairs (k, k+1): bt[r][k / 2][n - 16 r][2], 72 KB for K = 576), and then every 16-row
 * block of x runs the whole K against it: four C tiles of 16 x 16 fp32 sums, rounded to bf16
 * once at the end. What this saves against dequantizing W^T and calling PyTorch's matmul is
 * the W^T, the matmul library's reordered copy of it and, with `gated`, the [M, 2 I] gate/up
 * product (7-8 MB at 512 tokens of the default model). A row's sums do not depend on the other
 * rows of the batch. */

/* tile t's weights in the pair layout above */
static void tile_pairs(const uint8_t *packed, const Scales *sz, int64_t K, int64_t gs,
                       int64_t planes, const uint16_t *lut, int64_t t, uint16_t *bt) {
    /* vpermt2w indices: bf16 j of a goes to 2j, of b to 2j + 1 */
    static const uint16_t inter_idx[32] __attribute__((aligned(64))) = {
        0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
        8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    const __m512i idx = _mm512_load_si512(inter_idx);
    const __m512 lutf = codebook_f32(lut);
    const float bias = lut ? 0.0f : 8.0f;
    const uint8_t *tile = packed + t * planes * K * 32;
    for (int64_t g = 0; g < K / gs; g++) {
        __m512 sc[2][4], zz[2][4], w0[4], w1[4];
        tile_group_scales(sz, K, gs, planes, t, g, bias, sc, zz);
        for (int64_t k = g * gs; k < (g + 1) * gs; k += 2) {
            tile_column(tile, K, planes, k, lut, lutf, sc, zz, w0);
            tile_column(tile, K, planes, k + 1, lut, lutf, sc, zz, w1);
            for (int r = 0; r < 4; r++) {
                const __m512i a = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(w0[r]));
                const __m512i b = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(w1[r]));
                _mm512_store_si512(bt + (r * (K / 2) + k / 2) * 32,
                                   _mm512_permutex2var_epi16(a, idx, b));
            }
        }
    }
}

/* ct[r][m][16] = sum_k x[m0 + m, k] w[16 r + j, k] for the mr (<= 16) rows of a block, all of
 * K (a multiple of 32), against a tile's pair buffer. The tiles must be configured for mr. */
static inline void tile_block(const uint16_t *x, int64_t ldx, int64_t K, const uint16_t *bt,
                              float ct[4][AMX_ROWS][16]) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kc = 0; kc < K / 32; kc++) {
        const uint16_t *b = bt + kc * 16 * 32;
        _tile_loadd(4, x + kc * 32, ldx * 2);
        _tile_loadd(5, b, 64);
        _tile_loadd(6, b + (K / 2) * 32, 64);
        _tile_loadd(7, b + 2 * (K / 2) * 32, 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_dpbf16ps(1, 4, 6);
        _tile_dpbf16ps(2, 4, 7);
        _tile_loadd(5, b + 3 * (K / 2) * 32, 64);
        _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, ct[0], 64);
    _tile_stored(1, ct[1], 64);
    _tile_stored(2, ct[2], 64);
    _tile_stored(3, ct[3], 64);
}

/* rounds the 64 sums of row m of a block to bf16 at dst (n valid values) */
static inline void store_block_row(float ct[4][AMX_ROWS][16], int64_t m, uint16_t *dst,
                                   int64_t n) {
    for (int r = 0; r < 4 && 16 * r < n; r++)
        store_floats_bf16(ct[r][m], dst + 16 * r, n - 16 * r);
}

/* y = x @ W^T (bf16 [M][ldy], N columns) for a packed weight, or with `gated` (W stacks gate
 * and up, N = 2 I rows, I a multiple of 64): y = silu(x Wg^T) * (x Wu^T), [M][ldy], I columns,
 * each product rounded to bf16 before the activation as in silu_mul. Call int4_gemm_ready
 * first. Returns 0, -1 if out of memory, -2 for another group size. */
int int4_gemm(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *packed,
              const uint16_t *sz_p, int64_t N, int64_t n_pad, int64_t planes, uint16_t *y,
              int64_t ldy, int64_t gs, const uint16_t *lut, int64_t half_scales,
              int64_t gated) {
    if (gs != 32 && gs != 16) return -2;
    const Scales scales = scales_of(sz_p, n_pad, K, gs, planes, half_scales), *sz = &scales;
    const int64_t inter = N / 2, units = gated ? inter / TILE : n_pad / TILE;
    int failed = 0;
#pragma omp parallel
    {
        const size_t pair_bytes = sizeof(uint16_t) * (size_t)(K * TILE);
        uint16_t *bt = aligned_alloc(64, pair_bytes * (gated ? 2 : 1));
        /* gated: the tile's gate products in gu[m][0..63], up in gu[m][64..127], all rows */
        uint16_t *gu = gated ? malloc(sizeof(uint16_t) * (size_t)(M * 2 * TILE)) : NULL;
        float ct[4][AMX_ROWS][16] __attribute__((aligned(64)));
        int64_t configured = 0;
        if (!bt || (gated && !gu)) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
#pragma omp for schedule(static)
            for (int64_t u = 0; u < units; u++) {
                tile_pairs(packed, sz, K, gs, planes, lut, u, bt);
                if (gated)
                    tile_pairs(packed, sz, K, gs, planes, lut, inter / TILE + u,
                               bt + pair_bytes / sizeof(uint16_t));
                for (int64_t m0 = 0; m0 < M; m0 += AMX_ROWS) {
                    const int64_t mr = M - m0 < AMX_ROWS ? M - m0 : AMX_ROWS;
                    if (mr != configured) {
                        amx_config(mr);
                        configured = mr;
                    }
                    const uint16_t *xb = x + m0 * ldx;
                    tile_block(xb, ldx, K, bt, ct);
                    if (!gated) {
                        const int64_t n0 = u * TILE, n = N - n0 < TILE ? N - n0 : TILE;
                        for (int64_t m = 0; m < mr; m++)
                            store_block_row(ct, m, y + (m0 + m) * ldy + n0, n);
                        continue;
                    }
                    uint16_t *gm = gu + m0 * 2 * TILE;
                    for (int64_t m = 0; m < mr; m++) store_block_row(ct, m, gm + m * 2 * TILE, TILE);
                    tile_block(xb, ldx, K, bt + pair_bytes / sizeof(uint16_t), ct);
                    for (int64_t m = 0; m < mr; m++)
                        store_block_row(ct, m, gm + m * 2 * TILE + TILE, TILE);
                }
                /* the activation after the tile's AMX work: switching between tile and vector
                 * code per 16-row block cost 20% more */
                for (int64_t m = 0; gated && m < M; m++)
                    silu_mul_row(gu + m * 2 * TILE, TILE, y + m * ldy + u * TILE);
            }
        }
        if (configured) _tile_release();
        free(bt);
        free(gu);
    }
    return failed ? -1 : 0;
}
