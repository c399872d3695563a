/* Kernels that decode_layers (cpu_layers.c) calls from every thread of one team: the AVX-512
 * build runs a whole decode step in one OpenMP parallel region, where a fork and join cost
 * 1.0-1.4 us with the caches cold from the weight stream and a barrier 0.33-0.35 us, and a
 * step had about 150 regions. Inside a team such a kernel splits its work over the calling
 * threads and ends with the team's barrier; called from outside one, it opens its own region
 * (the per-op path, the AVX2 build). The work splits the same either way. */
#ifndef LOCALLLM_CPU_TEAM_H
#define LOCALLLM_CPU_TEAM_H

#include <omp.h>

/* Whether the caller is one thread of an active team (decode_layers'). */
static inline int in_team(void) { return omp_in_parallel(); }

#endif
