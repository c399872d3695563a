/* Internal to the AVX-512 build's integer path (its formula: cpu_int4_vnni.c): what its VNNI
 * kernels (cpu_int4_vnni.c) and its AMX-INT8 kernel (cpu_int4_amx_int8.c) share. The codes of
 * a tile as both take them (quad_half), a group's update of 16 output rows (update), and the
 * AMX-INT8 kernel's entry points. */
#ifndef LOCALLLM_CPU_INT4_VNNI_H
#define LOCALLLM_CPU_INT4_VNNI_H

#include <immintrin.h>
#include <stdint.h>

#include "cpu_int4.h"
#include "cpu_int4_xint.h"

#define VNNI_ROWS 8 /* rows of x per pass over a tile: running sums fp32 [8][64] on the stack */

/* vpermt2b indices for half j of a tile: lane n takes byte 16 j + n of each of the 4 columns
 * (the low nibbles: rows 16 j + n; the high ones: rows 32 + 16 j + n) */
#define QUAD(f, n) (f) + (n), 32 + (f) + (n), 64 + (f) + (n), 96 + (f) + (n)
#define QUADS(f) QUAD(f, 0), QUAD(f, 1), QUAD(f, 2), QUAD(f, 3), QUAD(f, 4), QUAD(f, 5), \
    QUAD(f, 6), QUAD(f, 7), QUAD(f, 8), QUAD(f, 9), QUAD(f, 10), QUAD(f, 11), QUAD(f, 12), \
    QUAD(f, 13), QUAD(f, 14), QUAD(f, 15)
static const uint8_t QUAD_INDEX[2][64] __attribute__((aligned(64))) = {{QUADS(0)}, {QUADS(16)}};

/* Columns 4q..4q+3 of a group (128 bytes at p) for half j: the codes of row block j (rows
 * 16 j ..) in *lo and of row block j + 2 (rows 32 + 16 j ..) in *hi, 4 columns a lane */
static inline __attribute__((always_inline)) void quad_half(const uint8_t *p, const int j,
                                                            __m512i *lo, __m512i *hi) {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const __m512i b = _mm512_permutex2var_epi8(_mm512_loadu_si512(p),
                                               _mm512_load_si512(QUAD_INDEX[j]),
                                               _mm512_loadu_si512(p + 64));
    *lo = _mm512_and_si512(b, low4);
    *hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), low4);
}

/* y + the group's terms for 16 output rows: A = 256 H + L, y = fma(s, A xs, y), then
 * y = fma(zz, sxr, y) (the AVX2 build's update_int, lane for lane) */
static inline __m512 update(__m512i H, __m512i L, __m512 sc, __m512 zz, float xs, float sxr,
                            __m512 y) {
    const __m512i A = _mm512_add_epi32(_mm512_slli_epi32(H, 8), L);
    const __m512 a = _mm512_mul_ps(_mm512_cvtepi32_ps(A), _mm512_set1_ps(xs));
    return _mm512_fmadd_ps(zz, _mm512_set1_ps(sxr), _mm512_fmadd_ps(sc, a, y));
}

/* AMX-INT8 (cpu_int4_amx_int8.c), groups of GROUP columns: the A cells of x's M rows, chunks
 * of VNNI_ROWS rows (a chunk of one row has none) in the calling thread's buffer, NULL if out
 * of memory; then halves j0 .. j1 - 1 of a 64-row tile (codes at `tile`, output rows from
 * row0) for the mc (2..VNNI_ROWS) rows of chunk m0 / VNNI_ROWS (their xs, sxr from the first,
 * per_plane apart) into out (fp32 [mc][64]). The caller holds the OS's permission and
 * releases the tiles (int4_tiles_release). */
INT4_INTERNAL const uint8_t *int4_int8_cells(const IntRows *xr, int64_t M, int64_t K,
                                             int64_t groups);
INT4_INTERNAL void int4_int8_rows(const uint8_t *cells, int64_t m0, int64_t mc,
                                  const uint8_t *tile, const Scales *sz, int64_t row0,
                                  int64_t groups, int64_t per_plane, const float *xs,
                                  const float *sxr, float *out, int j0, int j1);

#endif
