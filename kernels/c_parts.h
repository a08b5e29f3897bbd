/* A kernel's parts run at once on OpenMP threads: the `NAME_parts` entry points of group_gemv.c and
 * cpu_ops.c take the same arguments as NAME with [begin, end) replaced by `bounds` (parts + 1
 * offsets) and `parts`, and return the smallest of the parts' return codes (0, or a refusal).
 *
 * Built with -fopenmp (c_library.py), the libraries link libgomp.so.1, which the dynamic loader
 * resolves to the copy torch has already loaded: our parts then run on the threads of torch's own
 * OpenMP pool. A pool of threads of our own would run beside torch's workers, which spin for a
 * while after each torch op and take the core from it. Without OpenMP the pragma is ignored and
 * the parts run one after another on the calling thread. */
#ifndef MOEMESH_C_PARTS_H
#define MOEMESH_C_PARTS_H

#include <stdint.h>

/* The body of a NAME_parts function whose parameters include `bounds` and `parts`: CALL (the
 * macro's last argument) is NAME's call with `begin` and `end`. */
#define RUN_PARTS(...)                                                                                          \
    int rc_ = 0;                                                                                               \
    _Pragma("omp parallel for num_threads(parts) schedule(static, 1) reduction(min : rc_)")                    \
    for (int64_t p_ = 0; p_ < parts; p_++) {                                                                   \
        int64_t begin = bounds[p_], end = bounds[p_ + 1];                                                       \
        int r_ = (__VA_ARGS__);                                                                                 \
        rc_ = r_ < rc_ ? r_ : rc_;                                                                             \
    }                                                                                                          \
    return rc_;

#endif
