/* Kernels that decode_layers (cpu_layers.c) calls from every thread of one team: the AVX-512
 * build runs a whole decode step in one OpenMP parallel region, where a fork and join cost
 * 1.0-1.4 us with the caches cold from the weight stream and a barrier 0.33-0.35 us, and a
 * step had about 150 regions. Inside a team such a kernel splits its work over the calling
 * threads and ends with the team's barrier; called from outside one, it opens its own region
 * (the per-op path, the AVX2 build). The work splits the same either way. */
#ifndef LOCALLLM_CPU_TEAM_H
#define LOCALLLM_CPU_TEAM_H

#include <omp.h>
#include <string.h>

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

/* A thread's work among `total` units of a kernel split over a team: each thread owns a fixed
 * share, total * id / nth .. total * (id + 1) / nth, and takes it from its front `least` units
 * at a time; once its share is done, it takes half of what is left of another thread's share
 * from its back (work stealing), as long as any is left. On a VM the two cores' speeds differ
 * from minute to minute (one ran the same matmuls 40% slower than the other for seconds at a
 * time), and with fixed shares alone the faster one waited for the slower at every barrier.
 * Chunks claimed from a shared counter in ever smaller pieces instead (guided scheduling) cost
 * 4% of an 8-row decode step even so: each chunk began with its first lines uncached, where a
 * thread's own share streams on. A unit's result must not depend on the thread or the chunk
 * that computes it: the kernels compute each tile alike whatever their share.
 *
 * The shares' state (`ranges`): one int64 a thread, SHARE_LINE apart (a cache line each), zero
 * before each call of the kernel (once every thread is past the call before: its barrier),
 * (front + 1) << 32 | back once read; NULL: fixed shares only. */
#define SHARE_LINE 8
#define SHARE_MAX 256 /* threads a kernel's own set of ranges covers (share_ranges) */

typedef struct {
    int64_t *ranges;
    int64_t total, least, nth, id;
    int taken; /* fixed shares: taken already */
} Share;

static inline Share share_of(int64_t *ranges, int64_t total, int64_t least, int64_t nth,
                             int64_t id) {
    const Share s = {ranges, total, least, nth, id, 0};
    return s;
}

/* thread i's range, set to its fixed share by whichever thread reads it first */
static inline int64_t share_range(const Share *s, int64_t i) {
    int64_t *w = s->ranges + i * SHARE_LINE;
    int64_t v = __atomic_load_n(w, __ATOMIC_RELAXED);
    if (v == 0) {
        const int64_t init = (s->total * i / s->nth + 1) << 32 | s->total * (i + 1) / s->nth;
        if (__atomic_compare_exchange_n(w, &v, init, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
            v = init;
    }
    return v;
}

/* The next chunk [*u0, *u1) of the thread's units; 0 when none is left. Relaxed atomics: the
 * units' outputs are published by the barrier that ends the kernel. */
static inline int share_next(Share *s, int64_t *u0, int64_t *u1) {
    if (!s->ranges) {
        if (s->taken) return 0;
        s->taken = 1;
        *u0 = s->total * s->id / s->nth;
        *u1 = s->total * (s->id + 1) / s->nth;
        return *u0 < *u1;
    }
    for (int64_t k = 0; k < s->nth; k++) { /* its own share first, then the others' */
        const int64_t j = (s->id + k) % s->nth;
        int64_t *w = s->ranges + j * SHARE_LINE;
        int64_t v = share_range(s, j);
        for (;;) {
            const int64_t f = (v >> 32) - 1, b = v & 0xFFFFFFFF, left = b - f;
            if (left <= 0) break;
            int64_t n, nv;
            if (k == 0) { /* the front, up to the next multiple of least */
                n = s->least - f % s->least;
                n = n < left ? n : left;
                nv = (f + n + 1) << 32 | b;
            } else { /* the back: half of what is left, in whole `least` */
                n = left / 2 / s->least * s->least;
                n = n > 0 ? n : left < s->least ? left : s->least;
                nv = (f + 1) << 32 | (b - n);
            }
            if (__atomic_compare_exchange_n(w, &v, nv, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
                *u0 = k == 0 ? f : b - n;
                *u1 = k == 0 ? f + n : b;
                return 1;
            }
        }
    }
    return 0;
}

/* Declares `name`, zeroed ranges for a team the kernel opens itself (TEAM_RUN outside a team,
 * or its own parallel region), as many as that team can have threads; one line, unused, where
 * share_ranges will not take them (the caller's ranges `given`, a calling team, more threads
 * than SHARE_MAX), so that a decode step's kernels zero nothing of their own */
#define SHARE_OWN(name, given)                                                                 \
    const int64_t name##_n =                                                                   \
        (given) || in_team() || omp_get_max_threads() > SHARE_MAX ? 1 : omp_get_max_threads(); \
    int64_t name[name##_n * SHARE_LINE];                                                       \
    memset(name, 0, sizeof(int64_t) * (size_t)(name##_n * SHARE_LINE))

/* A kernel's ranges: the caller's (`given`), else for the team TEAM_RUN opens outside a team,
 * `own` (SHARE_OWN) where it covers the team; NULL inside a team without the caller's (fixed
 * shares: a thread's own would not be shared). */
static inline int64_t *share_ranges(int64_t *given, int64_t *own) {
    if (given) return given;
    return in_team() || omp_get_max_threads() > SHARE_MAX ? NULL : own;
}

#endif
