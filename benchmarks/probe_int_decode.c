/* Probe: the decode matmul with x as 16-bit integers per group (the AVX2 build's formula,
 * kernels/cpu_int4_avx2_int.c) on AVX-512 VNNI and AMX-INT8, beside the AVX-512 build's
 * int4_mm in its three decode modes (cpu_native.amx_mode: VNNI alone, every row on bf16
 * tiles, batches on AMX-INT8), one thread, one weight that stays in L2 (3072 x 576, the
 * default model's gate/up). Not part of the runtime: it measured whether the integer formula
 * was worth taking to the AVX-512 build (kernels/cpu_int4_vnni.c now runs it), and checks that
 * each integer kernel's group sums equal the exact ones, so that any of them gives a row the
 * same bits alone or in a batch.
 *
 *     gcc -O3 -fopenmp -ffp-contract=off -mavx512f -mavx512bw -mavx512vl -mavx512vbmi \
 *         -mavx512bf16 -mavx512vnni -mfma -mamx-tile -mamx-bf16 -mamx-int8 -Ikernels \
 *         benchmarks/probe_int_decode.c kernels/cpu_int4.c kernels/cpu_int4_avx512.c \
 *         kernels/cpu_int4_vnni.c kernels/cpu_int4_amx_int8.c kernels/cpu_int4_amx.c \
 *         kernels/cpu_int4_dequant.c kernels/cpu_int4_rows.c kernels/cpu_int8_logits.c \
 *         kernels/cpu_ops.c \
 *         kernels/cpu_sample.c kernels/cpu_layers.c -lm -o /tmp/probe_int_decode
 *     /tmp/probe_int_decode [rounds]
 *
 * Needs a CPU with AVX-512 VNNI/VBMI/BF16 and AMX (a Xeon of Sapphire Rapids or later).
 * Prints ns per 64-row tile and 32-column group (best of `rounds`), for 1 and 8 rows of x
 * (int4_mm's include rounding x; the probe kernels' x is rounded before the timing).
 *
 * The integer kernels, on the packed layout of kernels/cpu_int4.h (byte j of column k of a
 * tile: row j in the low nibble, row 32 + j in the high one):
 * - quads: 128 bytes (columns k..k+3) -> four vectors of u8 codes, row block r's 16 rows x 4
 *   columns each (two vpermt2b, four and/shift): VNNI's and AMX-INT8's operand layout.
 * - vnni_planes, one row: v = 256 h + l (h = v >> 8 signed, l = v & 255 unsigned); the codes
 *   times h by vpdpbusd(codes as u8, h as s8), times l by vpdpbusd(l as u8, codes as s8).
 * - vnni_words, M rows: the codes as 16-bit (k, k+1) pairs (the bf16 path's unpack without
 *   its bias) times v's pairs by vpdpwssd, half a tile (32 rows) at a time.
 * - amx_int8, M rows: per two groups (64 columns: one B tile of quads for each row block), A
 *   tiles of h (TDPBSUD) and l (TDPBUUD) with group i's rows zero outside its 32 columns, so
 *   that each C row holds one group's sums; half a tile a pass (C: h and l for 2 row blocks).
 * Each then takes y += s a + zz sx per group and row block in fp32 (a = the group's integer
 * sum), as the AVX2 build's epilogue does.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "cpu_kernels.h"

#define N 3072
#define K 576
#define G (K / 32)
#define T (N / 64)
#define MAXM 8

static uint8_t W[T][K][32] __attribute__((aligned(64)));
static uint16_t SZ[G][N][2] __attribute__((aligned(64))); /* bf16 (scale, zero): int4_mm's */
static float S[G][N], ZZ[G][N];                           /* the integer epilogue's */
static int16_t V[MAXM][K];                                /* x's rows as integers */
static float SX[MAXM][G];
static uint8_t XH[K], XL[K];                              /* row 0's planes: v >> 8, v & 255 */
static int32_t REF[MAXM][N][G], OUT[MAXM][N][G];
static float Y[MAXM][N];
static uint8_t QIDX[2][64] __attribute__((aligned(64)));  /* quads' vpermt2b indices */
static uint8_t PIDX[2][64] __attribute__((aligned(64)));  /* words' vpermb indices */
static int8_t AH[G / 2][16][64] __attribute__((aligned(64)));
static uint8_t AL[G / 2][16][64] __attribute__((aligned(64)));
static uint8_t BT[3][4][16][64] __attribute__((aligned(64)));

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int code(int n, int k) {
    const uint8_t b = W[n / 64][k][n % 32];
    return n % 64 < 32 ? b & 15 : b >> 4;
}

/* y[16 r ..] += s a + zz sx for group g, rows 64 t + 16 r .. + 15 */
static inline __attribute__((always_inline)) __m512 epilogue(__m512 y, __m512i a, int g, int t,
                                                             int r, float sx) {
    const int n = 64 * t + 16 * r;
    y = _mm512_fmadd_ps(_mm512_loadu_ps(&S[g][n]), _mm512_cvtepi32_ps(a), y);
    return _mm512_fmadd_ps(_mm512_loadu_ps(&ZZ[g][n]), _mm512_set1_ps(sx), y);
}

static inline __attribute__((always_inline)) void keep(int check, int m, int t, int r, int g,
                                                       __m512i a) {
    if (check)
        for (int i = 0; i < 16; i++) OUT[m][64 * t + 16 * r + i][g] = ((int32_t *)&a)[i];
}

static inline __attribute__((always_inline)) void quads(const uint8_t *p, __m512i b[4]) {
    const __m512i l0 = _mm512_loadu_si512(p), l1 = _mm512_loadu_si512(p + 64);
    const __m512i low4 = _mm512_set1_epi8(15);
    const __m512i p0 = _mm512_permutex2var_epi8(l0, _mm512_load_si512(QIDX[0]), l1);
    const __m512i p1 = _mm512_permutex2var_epi8(l0, _mm512_load_si512(QIDX[1]), l1);
    b[0] = _mm512_and_si512(p0, low4);
    b[1] = _mm512_and_si512(p1, low4);
    b[2] = _mm512_and_si512(_mm512_srli_epi16(p0, 4), low4);
    b[3] = _mm512_and_si512(_mm512_srli_epi16(p1, 4), low4);
}

static void vnni_planes(int check) {
    for (int t = 0; t < T; t++) {
        __m512 y[4];
        for (int r = 0; r < 4; r++) y[r] = _mm512_setzero_ps();
        for (int g = 0; g < G; g++) {
            __m512i ah[4], al[4];
            for (int r = 0; r < 4; r++) ah[r] = al[r] = _mm512_setzero_si512();
            for (int p = 0; p < 8; p++) {
                const int k = 32 * g + 4 * p;
                _mm_prefetch((const char *)&W[t][k][0] + 4096, _MM_HINT_T1);
                _mm_prefetch((const char *)&W[t][k][0] + 4096 + 64, _MM_HINT_T1);
                __m512i b[4];
                quads(&W[t][k][0], b);
                int32_t qh, ql;
                memcpy(&qh, XH + k, 4);
                memcpy(&ql, XL + k, 4);
                const __m512i bh = _mm512_set1_epi32(qh), bl = _mm512_set1_epi32(ql);
                for (int r = 0; r < 4; r++) {
                    ah[r] = _mm512_dpbusd_epi32(ah[r], b[r], bh);
                    al[r] = _mm512_dpbusd_epi32(al[r], bl, b[r]);
                }
            }
            for (int r = 0; r < 4; r++) {
                const __m512i a = _mm512_add_epi32(_mm512_slli_epi32(ah[r], 8), al[r]);
                keep(check, 0, t, r, g, a);
                y[r] = epilogue(y[r], a, g, t, r, SX[0][g]);
            }
        }
        for (int r = 0; r < 4; r++) _mm512_storeu_ps(&Y[0][64 * t + 16 * r], y[r]);
    }
}

static void vnni_words(int M, int check) {
    const __m512i low4 = _mm512_set1_epi8(15);
    const __m512i ia = _mm512_load_si512(PIDX[0]), ib = _mm512_load_si512(PIDX[1]);
    for (int t = 0; t < T; t++) {
        __m512 y[MAXM][4];
        for (int m = 0; m < M; m++)
            for (int r = 0; r < 4; r++) y[m][r] = _mm512_setzero_ps();
        for (int g = 0; g < G; g++) {
            for (int h = 0; h < 2; h++) {
                __m512i a[MAXM][2];
                for (int m = 0; m < M; m++) a[m][0] = a[m][1] = _mm512_setzero_si512();
                for (int kp = 0; kp < 16; kp++) {
                    const uint8_t *p = &W[t][32 * g + 2 * kp][0];
                    if (h == 0) _mm_prefetch((const char *)p + 4096, _MM_HINT_T1);
                    const __m512i b = _mm512_loadu_si512(p);
                    const __m512i nib = h ? _mm512_and_si512(_mm512_srli_epi16(b, 4), low4)
                                          : _mm512_and_si512(b, low4);
                    const __m512i w0 = _mm512_maskz_permutexvar_epi8(0x5555555555555555ULL, ia, nib);
                    const __m512i w1 = _mm512_maskz_permutexvar_epi8(0x5555555555555555ULL, ib, nib);
                    for (int m = 0; m < M; m++) {
                        int32_t pair;
                        memcpy(&pair, &V[m][32 * g + 2 * kp], 4);
                        const __m512i xb = _mm512_set1_epi32(pair);
                        a[m][0] = _mm512_dpwssd_epi32(a[m][0], w0, xb);
                        a[m][1] = _mm512_dpwssd_epi32(a[m][1], w1, xb);
                    }
                }
                for (int m = 0; m < M; m++)
                    for (int r = 0; r < 2; r++) {
                        keep(check, m, t, 2 * h + r, g, a[m][r]);
                        y[m][2 * h + r] = epilogue(y[m][2 * h + r], a[m][r], g, t, 2 * h + r, SX[m][g]);
                    }
            }
        }
        for (int m = 0; m < M; m++)
            for (int r = 0; r < 4; r++) _mm512_storeu_ps(&Y[m][64 * t + 16 * r], y[m][r]);
    }
}

static void unpack_pair(int t, int q, uint8_t b[4][16][64]) {
    const uint8_t *src = &W[t][64 * q][0];
    for (int kq = 0; kq < 16; kq++) {
        _mm_prefetch((const char *)src + 128 * kq + 4096, _MM_HINT_T1);
        _mm_prefetch((const char *)src + 128 * kq + 4096 + 64, _MM_HINT_T1);
        __m512i w[4];
        quads(src + 128 * kq, w);
        for (int r = 0; r < 4; r++) _mm512_store_si512(b[r][kq], w[r]);
    }
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) TileConfig;

static void amx_config(int M) {
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 8; i++) {
        c.colsb[i] = 64;
        c.rows[i] = (uint8_t)(i < 6 ? 2 * M : 16);
    }
    _tile_loadconfig(&c);
}

/* A tiles of h and l for M rows: pair q's rows i M + m hold group 2 q + i of row m */
static void amx_rows(int M) {
    memset(AH, 0, sizeof AH);
    memset(AL, 0, sizeof AL);
    for (int q = 0; q < G / 2; q++)
        for (int i = 0; i < 2; i++)
            for (int m = 0; m < M; m++)
                for (int k = 0; k < 32; k++) {
                    const int v = V[m][64 * q + 32 * i + k];
                    AH[q][i * M + m][32 * i + k] = (int8_t)(v >> 8);
                    AL[q][i * M + m][32 * i + k] = (uint8_t)(v & 255);
                }
}

static void amx_int8(int M, int check) {
    /* the B tiles of the next pair are unpacked before this pair's products: a tile load of
     * lines just stored waits for the stores (same-pair: about 1.8x the time a group) */
    for (int t = 0; t < T; t++) {
        int32_t ct[4][16][16] __attribute__((aligned(64)));
        __m512 y[MAXM][4];
        for (int m = 0; m < M; m++)
            for (int r = 0; r < 4; r++) y[m][r] = _mm512_setzero_ps();
        unpack_pair(t, 0, BT[0]);
        for (int q = 0; q < G / 2; q++) {
            if (q + 1 < G / 2) unpack_pair(t, q + 1, BT[(q + 1) % 3]);
            uint8_t(*b)[16][64] = BT[q % 3];
            _tile_loadd(4, AH[q], 64);
            _tile_loadd(5, AL[q], 64);
            for (int half = 0; half < 2; half++) {
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                _tile_loadd(6, b[2 * half], 64);
                _tile_loadd(7, b[2 * half + 1], 64);
                _tile_dpbsud(0, 4, 6);
                _tile_dpbsud(1, 4, 7);
                _tile_dpbuud(2, 5, 6);
                _tile_dpbuud(3, 5, 7);
                _tile_stored(0, ct[0], 64);
                _tile_stored(1, ct[1], 64);
                _tile_stored(2, ct[2], 64);
                _tile_stored(3, ct[3], 64);
                for (int i = 0; i < 2; i++)
                    for (int m = 0; m < M; m++)
                        for (int rr = 0; rr < 2; rr++) {
                            const int row = i * M + m, r = 2 * half + rr, g = 2 * q + i;
                            const __m512i a = _mm512_add_epi32(
                                _mm512_slli_epi32(_mm512_load_si512(ct[rr][row]), 8),
                                _mm512_load_si512(ct[2 + rr][row]));
                            keep(check, m, t, r, g, a);
                            y[m][r] = epilogue(y[m][r], a, g, t, r, SX[m][g]);
                        }
            }
        }
        for (int m = 0; m < M; m++)
            for (int r = 0; r < 4; r++) _mm512_storeu_ps(&Y[m][64 * t + 16 * r], y[m][r]);
    }
}

static int mismatches(int M) {
    int bad = 0;
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++)
            for (int g = 0; g < G; g++) bad += OUT[m][n][g] != REF[m][n][g];
    memset(OUT, 0, sizeof OUT);
    return bad;
}

static uint16_t XB[MAXM][K] __attribute__((aligned(64))); /* bf16 x for int4_mm */
static uint16_t YB[MAXM][N] __attribute__((aligned(64)));
static int64_t CLAIM[64] __attribute__((aligned(64)));

static void int4_mm_call(int M) {
    memset(CLAIM, 0, sizeof CLAIM);
    int4_mm_shared(XB[0], M, K, K, &W[0][0][0], &SZ[0][0][0], N, N, 1, YB[0], N, 32, NULL, 0,
                   CLAIM);
}

static double best_of(int rounds, int kind, int M) {
    double best = 1e9;
    for (int r = 0; r < rounds; r++) {
        const double t0 = now();
        switch (kind) {
        case 0: int4_mm_call(M); break;
        case 1: vnni_planes(0); break;
        case 2: vnni_words(M, 0); break;
        default: amx_int8(M, 0); break;
        }
        const double dt = now() - t0;
        if (dt < best) best = dt;
    }
    return 1e9 * best / (T * G);
}

int main(int argc, char **argv) {
    const int rounds = argc > 1 ? atoi(argv[1]) : 20;
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */)) {
        fprintf(stderr, "probe_int_decode: the OS does not grant AMX tiles here\n");
        return 1;
    }
    for (int n = 0; n < 16; n++)
        for (int i = 0; i < 4; i++) {
            QIDX[0][4 * n + i] = (uint8_t)(32 * i + n);
            QIDX[1][4 * n + i] = (uint8_t)(32 * i + 16 + n);
        }
    for (int i = 0; i < 16; i++) {
        PIDX[0][4 * i] = (uint8_t)i, PIDX[0][4 * i + 2] = (uint8_t)(32 + i);
        PIDX[1][4 * i] = (uint8_t)(16 + i), PIDX[1][4 * i + 2] = (uint8_t)(48 + i);
    }
    srand(7);
    for (size_t i = 0; i < sizeof W; i++) ((uint8_t *)W)[i] = (uint8_t)rand();
    for (int g = 0; g < G; g++)
        for (int n = 0; n < N; n++) {
            S[g][n] = 1e-3f * (float)(1 + rand() % 100);
            ZZ[g][n] = -8.0f * S[g][n];
            SZ[g][n][0] = 0x3a83, SZ[g][n][1] = 0xbc00; /* bf16 0.001, -0.0078 */
        }
    for (int m = 0; m < MAXM; m++) {
        for (int k = 0; k < K; k++) {
            V[m][k] = (int16_t)(rand() % 65281 - 32640); /* round_group's range */
            XB[m][k] = (uint16_t)(0x3f00 + (rand() & 0xff));
        }
        for (int g = 0; g < G; g++) SX[m][g] = 1.0f / 32768.0f;
    }
    for (int k = 0; k < K; k++) XH[k] = (uint8_t)(V[0][k] >> 8), XL[k] = (uint8_t)(V[0][k] & 255);
    for (int m = 0; m < MAXM; m++)
        for (int n = 0; n < N; n++)
            for (int g = 0; g < G; g++) {
                int32_t s = 0;
                for (int k = 32 * g; k < 32 * g + 32; k++) s += code(n, k) * V[m][k];
                REF[m][n][g] = s;
            }
    int bad = 0;
    vnni_planes(1);
    bad += mismatches(1);
    for (int M = 1; M <= MAXM; M *= 8) {
        vnni_words(M, 1);
        bad += mismatches(M);
        amx_rows(M);
        amx_config(M);
        amx_int8(M, 1);
        bad += mismatches(M);
        _tile_release();
    }
    printf("integer group sums that differ from the exact ones: %d\n", bad);
    printf("ns per 64-row tile and 32-column group, one thread, best of %d:\n", rounds);
    for (int M = 1; M <= MAXM; M *= 8) {
        int4_amx_enable(0); /* int4_mm on VNNI */
        const double avx = best_of(rounds, 0, M);
        int4_amx_enable(2); /* int4_mm on bf16 tiles */
        const double tiles = best_of(rounds, 0, M);
        int4_amx_enable(1); /* int4_mm with batches on AMX-INT8 */
        const double int8 = best_of(rounds, 0, M);
        int4_tiles_release();
        const double planes = M == 1 ? best_of(rounds, 1, M) : 0.0;
        const double words = best_of(rounds, 2, M);
        amx_rows(M);
        amx_config(M);
        const double amx8 = best_of(rounds, 3, M);
        _tile_release();
        printf("%d row%s: int4_mm VNNI %.1f, bf16 tiles %.1f, AMX-INT8 %.1f | probe: ", M,
               M > 1 ? "s" : " ", avx, tiles, int8);
        if (M == 1) printf("VNNI planes %.1f, ", planes);
        printf("VNNI words %.1f, AMX-INT8 %.1f\n", words, amx8);
    }
    return bad != 0;
}
