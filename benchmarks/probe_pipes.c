/* Probe: how many 512-bit integer dot products (vpdpbusd, vpdpwssd), other integer multiplies
 * (vpmaddubsw, vpmaddwd) and FMAs a core retires a second with every core busy, alone and
 * mixed (in the ratio of the decode epilogue; half and half with another multiply, and with an
 * add for contrast): whether any multiply runs beside vpdpbusd. Not part of the runtime: it
 * gives the instruction floor of a batched decode step on this CPU, the figure
 * benchmarks/README.md weighs the 8-stream target against (an 8-row step of the default model
 * needs 26.5 M vpdpbusd for its int4 projections and 7.1 M vpdpwssd for its Q8_0 head).
 *
 *     gcc -O2 -fopenmp -mavx512f -mavx512bw -mavx512vnni benchmarks/probe_pipes.c \
 *         -o /tmp/probe_pipes
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
#define FOUR(ins, a, b, c, d) OP(ins, a) OP(ins, b) OP(ins, c) OP(ins, d)
#define TWELVE(ins) FOUR(ins, 0, 1, 2, 3) FOUR(ins, 4, 5, 6, 7) FOUR(ins, 8, 9, 10, 11)
/* half the sums by one instruction, half by another */
#define HALVES(a, b) FOUR(a, 0, 1, 2, 3) OP(a, 4) OP(a, 5) FOUR(b, 6, 7, 8, 9) OP(b, 10) OP(b, 11)
#define CLOBBERS                                                                               \
    "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",   \
        "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "xmm18"

/* One timed loop a kind: `n` passes of its body on every thread at once, in seconds */
#define KIND(fn, body)                                                                         \
    static double fn(long n, int threads) {                                                    \
        const double t0 = omp_get_wtime();                                                     \
        _Pragma("omp parallel num_threads(threads)") for (long i = 0; i < n; i++)             \
            __asm__ volatile(body::: CLOBBERS);                                                \
        return omp_get_wtime() - t0;                                                           \
    }
KIND(busd, TWELVE("vpdpbusd"))
KIND(wssd, TWELVE("vpdpwssd"))
KIND(fmadd, TWELVE("vfmadd231ps"))
KIND(maddubs, TWELVE("vpmaddubsw"))
KIND(maddwd, TWELVE("vpmaddwd"))
/* 16 vpdpbusd and 3 FMAs: the VNNI decode kernel's products for one x row, group of 32 and
 * 16 outputs (two byte planes x 8 column quads) against its epilogue's multiply and two FMAs */
KIND(epilogue, TWELVE("vpdpbusd") FOUR("vpdpbusd", 12, 13, 14, 15)
                   OP("vfmadd231ps", 16) OP("vfmadd231ps", 17) OP("vfmadd231ps", 18))
KIND(busd_maddubs, HALVES("vpdpbusd", "vpmaddubsw"))
KIND(busd_maddwd, HALVES("vpdpbusd", "vpmaddwd"))
KIND(busd_add, HALVES("vpdpbusd", "vpaddd"))

static const struct {
    const char *name;
    double (*run)(long, int);
    int per_pass; /* operations a pass */
} KINDS[] = {
    {"vpdpbusd", busd, 12},
    {"vpdpwssd", wssd, 12},
    {"vfmadd231ps", fmadd, 12},
    {"vpmaddubsw", maddubs, 12},
    {"vpmaddwd", maddwd, 12},
    {"16 vpdpbusd + 3 vfmadd231ps", epilogue, 19},
    {"6 vpdpbusd + 6 vpmaddubsw", busd_maddubs, 12},
    {"6 vpdpbusd + 6 vpmaddwd", busd_maddwd, 12},
    {"6 vpdpbusd + 6 vpaddd", busd_add, 12},
};

int main(int argc, char **argv) {
    const int threads = argc > 1 ? atoi(argv[1]) : omp_get_max_threads();
    const long n = 20000000;
    printf("G operations a second a thread, %d thread(s) at once, best of 5:\n", threads);
    for (size_t k = 0; k < sizeof KINDS / sizeof KINDS[0]; k++) {
        double best = 1e30;
        for (int r = 0; r < 5; r++) {
            const double t = KINDS[k].run(n, threads);
            if (t < best) best = t;
        }
        printf("  %-28s %6.2f\n", KINDS[k].name, (double)KINDS[k].per_pass * n / best / 1e9);
    }
    return 0;
}
