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

/* `stmt` on every thread of the calling team, then its barrier, or of a team of its own;
 * `nth` and `id` name the team's size and the thread's number inside stmt */
#define TEAM_RUN(nth, id, stmt)                                                                \
    do {                                                                                       \
        if (in_team()) {                                                                       \
            const int64_t nth = omp_get_num_threads(), id = omp_get_thread_num();              \
            stmt;                                                                              \
            _Pragma("omp barrier")                                                             \
        } else {                                                                               \
            _Pragma("omp parallel") {                                                          \
                const int64_t nth = omp_get_num_threads(), id = omp_get_thread_num();          \
                stmt;                                                                          \
            }                                                                                  \
        }                                                                                      \
    } while (0)

/* `stmt` for each row t (int64_t) of n: split over the calling team, or over a team of their
 * own where `own` holds (else on this thread) */
#define TEAM_ROWS(n, own, t, stmt)                                                             \
    do {                                                                                       \
        const int64_t team_rows_ = (n);                                                        \
        const int team_own_ = (own);                                                           \
        if (in_team()) {                                                                       \
            _Pragma("omp for schedule(static)") for (int64_t t = 0; t < team_rows_; t++) stmt; \
        } else {                                                                               \
            _Pragma("omp parallel for schedule(static) if (team_own_)")                      \
            for (int64_t t = 0; t < team_rows_; t++) stmt;                                     \
        }                                                                                      \
    } while (0)

/* `stmt` (the rest of the arguments) for each row t (int64_t) of n: split over a team of their
 * own where `own` holds and the caller is not a thread of a team, else all on the calling
 * thread (a nested region, even of one thread, costs about 0.5 us) */
#define OWN_ROWS(n, own, t, ...)                                                               \
    do {                                                                                       \
        const int64_t own_rows_ = (n);                                                         \
        if ((own) && !in_team()) {                                                             \
            _Pragma("omp parallel for schedule(static)")                                      \
            for (int64_t t = 0; t < own_rows_; t++) __VA_ARGS__                                \
        } else {                                                                               \
            for (int64_t t = 0; t < own_rows_; t++) __VA_ARGS__                                \
        }                                                                                      \
    } while (0)

#endif
