/* A kernel's parts run at once on OpenMP threads: the `NAME_parts` entry points of group_gemv.c and
 * paged_attention.c take the same arguments as NAME with [begin, end) replaced by `bounds` (parts + 1
 * offsets) and `parts`, and return the smallest of the parts' return codes (0, or a refusal).
 *
 * Built with -fopenmp (c_library.py), the libraries link libgomp.so.1, which the dynamic loader
 * resolves to the copy torch has already loaded: our parts then run on the threads of torch's own
 * OpenMP pool. A pool of threads of our own would run beside torch's workers, which spin for a
 * while after each torch op and take the core from it. Without OpenMP the parts run one after
 * another on the calling thread. */
#ifndef MOEMESH_C_PARTS_H
#define MOEMESH_C_PARTS_H

#include <stdint.h>

/* the loop over the parts, threaded where the build has OpenMP (without it, an `omp` pragma would
 * be an unknown one, which -Wall reports) */
#ifdef _OPENMP
#define PARTS_LOOP _Pragma("omp parallel for num_threads(parts) schedule(static, 1) reduction(min : rc_)")
#else
#define PARTS_LOOP
#endif

/* The body of a NAME_parts function whose parameters include `bounds` and `parts`: CALL (the
 * macro's last argument) is NAME's call with `begin` and `end`. */
#define RUN_PARTS(...)                                                                                          \
    int rc_ = 0;                                                                                               \
    PARTS_LOOP                                                                                                 \
    for (int64_t p_ = 0; p_ < parts; p_++) {                                                                   \
        int64_t begin = bounds[p_], end = bounds[p_ + 1];                                                       \
        int r_ = (__VA_ARGS__);                                                                                 \
        rc_ = r_ < rc_ ? r_ : rc_;                                                                             \
    }                                                                                                          \
    return rc_;

#endif
