/* Int4 weight-only matmuls on PyTorch's packed int4 CPU layout (cpu_int4.h): int4_mm's choice
 * of path, integer products on VNNI and, where enabled, AMX-INT8 tiles (cpu_int4_vnni.c), bf16
 * AMX tiles for a prompt's rows (cpu_int4_amx.c) or AVX-512 BF16 for codebook weights
 * (cpu_int4_avx512.c), and the OS's permission to use the tiles.
 * Rows are split across OpenMP threads; this library links the libgomp that PyTorch already
 * loaded (same soname), so it shares PyTorch's thread team and thread count.
 */
#include <stdint.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "cpu_int4.h"
#include "cpu_kernels.h"

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* decoding rows on tiles (cpu_native.AMX_DEFAULT): 0 none, AMX_INT8 (batches of 2-8 rows on
 * AMX-INT8, one row on VNNI: the same bits) or AMX_BF16 (every row on bf16 tiles) */
#define AMX_INT8 1
#define AMX_BF16 2
static int amx_enabled = 0;
static int amx_permitted = 0; /* the OS lets this process use tiles (int4_gemm_ready) */

/* Asks the kernel for the AMX tile state once; returns whether tiles may be used at all (the
 * prompt matmuls, and decoding rows in the modes int4_amx_enable turns on). */
int int4_gemm_ready(void) {
    static int asked = 0;
    if (!asked) {
        asked = 1;
        amx_permitted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }
    return amx_permitted;
}

/* on = AMX_INT8 or AMX_BF16: ask the kernel for the AMX tile state and run decoding rows on
 * those tiles; 0: stop using them; -1: only ask. Returns the mode in use (0: none). */
int int4_amx_enable(int on) {
    if (on == AMX_INT8 || on == AMX_BF16)
        amx_enabled = int4_gemm_ready() ? on : 0;
    else if (on == 0)
        amx_enabled = 0;
    return amx_enabled;
}

/* int4_mm (operands in cpu_kernels.h), tiles as `amx` says (amx_enabled's modes). A weight in
 * groups of 32 without a codebook takes the bf16 tiles with AMX_BF16 (cpu_int4_amx.c); others
 * without a codebook the integer path (VNNI; with AMX_INT8, batches of a weight in groups of
 * 32 on AMX-INT8 tiles, the same bits: cpu_int4_vnni.c); codebook weights the sum of x over
 * each group of columns and AVX-512 BF16 dot products (cpu_int4_avx512.c). lut: NULL (weights
 * (c - 8) s + z) or a codebook's 32 bf16 values hi | lo (weights (hi[c] + lo[c]) s + z; see
 * cpu_int4.h). Returns 0, -1 if out of memory, -2 for another group size. */
static int mm(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *packed,
              const uint16_t *sz_p, int64_t N, int64_t n_pad, int64_t planes, uint16_t *y,
              int64_t ldy, int64_t gs, const uint16_t *lut, int64_t scales_form, int amx,
              int64_t *claim) {
    if (gs != 32 && gs != 16) return -2;
    const Scales scales = scales_of(sz_p, n_pad, K, gs, planes, scales_form), *sz = &scales;
    const int64_t K2 = planes * K, groups = K2 / gs;
    const int bf16_tiles = amx == AMX_BF16 && gs == GROUP;
    if (!lut && !bf16_tiles)
        return int4_mm_vnni(x, M, K, ldx, packed, sz, N, n_pad, K2, y, ldy, gs,
                            amx == AMX_INT8 && gs == GROUP, claim);
    float room[XSUM_ROOM];
    float *xsum = x_group_sums(x, M, K, ldx, gs, groups, room);
    if (!xsum) return -1;
    if (!lut)
        int4_mm_amx(x, M, K, ldx, packed, sz, N, n_pad, groups, xsum, y, ldy, claim);
    else
        int4_mm_avx512(x, M, K, ldx, packed, sz, N, n_pad, K2, xsum, y, ldy, gs, lut, claim);
    if (xsum != room) free(xsum);
    return 0;
}

int int4_mm(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *packed,
            const uint16_t *sz, int64_t N, int64_t n_pad, int64_t planes, uint16_t *y,
            int64_t ldy, int64_t gs, const uint16_t *lut, int64_t scales_form) {
    return mm(x, M, K, ldx, packed, sz, N, n_pad, planes, y, ldy, gs, lut, scales_form,
              amx_enabled, NULL);
}

int int4_mm_shared(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *packed,
                   const uint16_t *sz, int64_t N, int64_t n_pad, int64_t planes, uint16_t *y,
                   int64_t ldy, int64_t gs, const uint16_t *lut, int64_t scales_form,
                   int64_t *claim) {
    return mm(x, M, K, ldx, packed, sz, N, n_pad, planes, y, ldy, gs, lut, scales_form,
              amx_enabled, claim);
}

/* a prompt's rows: bf16 tiles wherever permitted, whatever `amx_enabled` says (which is
 * about decoding rows, whose results must not depend on their batch) */
int int4_mm_tiles(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *packed,
                  const uint16_t *sz, int64_t N, int64_t n_pad, int64_t planes, uint16_t *y,
                  int64_t ldy, int64_t gs, const uint16_t *lut, int64_t scales_form) {
    return mm(x, M, K, ldx, packed, sz, N, n_pad, planes, y, ldy, gs, lut, scales_form,
              amx_permitted ? AMX_BF16 : 0, NULL);
}
