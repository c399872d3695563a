/* Probe: how many 512-bit integer dot products (vpdpbusd, vpdpwssd) and FMAs a core retires a
 * second with every core busy, alone and mixed in the ratio of the decode epilogue. Not part
 * of the runtime: it gives the instruction floor of a batched decode step on this CPU, the
 * figure benchmarks/README.md weighs the 8-stream target against (an 8-row step of the default
 * model needs 26.5 M vpdpbusd for its int4 projections and 7.1 M vpdpwssd for its Q8_0 head).
 *
 *     gcc -O2 -fopenmp -mavx512f -mavx512vnni benchmarks/probe_pipes.c -o /tmp/probe_pipes
 *     /tmp/probe_pipes [threads]          (threads: default, every CPU OpenMP sees)
 *
 * Each loop runs 12 independent sums in registers (more than the operations' latency times
 * their rate), so it measures throughput, not latency. Prints G operations a second a thread,
 * the best of 5 runs, all threads at once.
 */
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>

#define OP(ins, r) ins " %%zmm30, %%zmm31, %%zmm" #r "\n\t"
#define TWELVE(ins)                                                                            \
    OP(ins, 0) OP(ins, 1) OP(ins, 2) OP(ins, 3) OP(ins, 4) OP(ins, 5) OP(ins, 6) OP(ins, 7)   \
    OP(ins, 8) OP(ins, 9) OP(ins, 10) OP(ins, 11)
/* 16 vpdpbusd and 3 FMAs: the VNNI decode kernel's products for one x row, group of 32 and
 * 16 outputs (two byte planes x 8 column quads) against its epilogue's multiply and two FMAs */
#define MIXED                                                                                  \
    TWELVE("vpdpbusd") OP("vpdpbusd", 12) OP("vpdpbusd", 13) OP("vpdpbusd", 14)               \
    OP("vpdpbusd", 15) OP("vfmadd231ps", 16) OP("vfmadd231ps", 17) OP("vfmadd231ps", 18)
#define CLOBBERS                                                                               \
    "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",   \
        "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "xmm18"

enum { BUSD, WSSD, FMA, MIX, KINDS };
static const char *NAMES[KINDS] = {"vpdpbusd", "vpdpwssd", "vfmadd231ps",
                                   "16 vpdpbusd + 3 vfmadd231ps"};
static const int PER_LOOP[KINDS] = {12, 12, 12, 19};

/* seconds for n loops of kind k on every thread at once */
static double run(int k, long n, int threads) {
    const double t0 = omp_get_wtime();
#pragma omp parallel num_threads(threads)
    {
        for (long i = 0; i < n; i++) {
            if (k == BUSD) __asm__ volatile(TWELVE("vpdpbusd")::: CLOBBERS);
            else if (k == WSSD) __asm__ volatile(TWELVE("vpdpwssd")::: CLOBBERS);
            else if (k == FMA) __asm__ volatile(TWELVE("vfmadd231ps")::: CLOBBERS);
            else __asm__ volatile(MIXED::: CLOBBERS);
        }
    }
    return omp_get_wtime() - t0;
}

int main(int argc, char **argv) {
    const int threads = argc > 1 ? atoi(argv[1]) : omp_get_max_threads();
    const long n = 20000000;
    printf("G operations a second a thread, %d thread(s) at once, best of 5:\n", threads);
    for (int k = 0; k < KINDS; k++) {
        double best = 1e30;
        for (int r = 0; r < 5; r++) {
            const double t = run(k, n, threads);
            if (t < best) best = t;
        }
        printf("  %-28s %6.2f\n", NAMES[k], (double)PER_LOOP[k] * n / best / 1e9);
    }
    return 0;
}
