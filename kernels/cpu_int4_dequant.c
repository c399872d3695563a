/* int4_dequant_t: W^T of a packed int4 weight in bf16 (layout: cpu_int4.h), for PyTorch's
 * dense matmul over a prompt's rows where int4_gemm does not run.
 */
#include <immintrin.h>
#include <stdint.h>

#include "cpu_int4.h"
#include "cpu_kernels.h"
#include "cpu_simd.h"

/* W^T in bf16 for a dense matmul over many rows (prefill): wt[k][n] = sum over planes of
 * (c[n, k] - 8) s[k / gs, n] + z[k / gs, n], summed in fp32 and rounded once, for k < K and
 * n < n_pad (the padded rows come out as 0). wt: bf16 [K][n_pad]. */
void int4_dequant_t(const uint8_t *packed, const uint16_t *sz_p, int64_t K, int64_t n_pad,
                    int64_t planes, uint16_t *wt, int64_t gs, const uint16_t *lut,
                    int64_t scales_form) {
    const Scales scales = scales_of(sz_p, n_pad, K, gs, planes, scales_form), *sz = &scales;
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
