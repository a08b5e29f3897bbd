/* The routed experts of a decode round on the CPU: entries grouped by expert, a few rows each
 * (kernels/cpu_moe.py loads it; kernels/dispatch.py calls it for CPU tensors).
 *
 * For each group (an expert and its entries, rows of x), in group order:
 *   gate_up = x[rows] @ w13[e]^T            (rounded to the dtype)
 *   act     = silu(gate) * up               (float32, rounded to the dtype)
 *   y       = act @ w2[e]^T                 (rounded to the dtype)
 *   out[rows] += y * weight                 (float32, entry order: index_add's sums)
 * which is what kernels/moe.py's grouped_moe_ref computes, with float32 dot products summed in
 * another order. A decode round gives each expert a few rows, where a matmul call pays for more
 * than the weights' bytes (torch's bf16 matmul of 4 rows by a 1 MB expert: ~170 us; the bytes
 * stream in ~45 us): here each expert's weights are read once per four rows, from one call for
 * the whole layer.
 *
 * `bf16` selects the element type of x, w13 and w2 (1 bfloat16, 0 float32); out and the weights
 * are float32. Dot products: AVX-512 BF16 pair dot products (bfloat16), else float32 fused
 * multiply-adds over AVX-512 / AVX2 lanes, else scalar loops. Hidden and intermediate sizes must
 * be multiples of 32 (the caller checks).
 *
 * Threads (OpenMP, torch's pool as in c_parts.h): the intermediate rows split first, then the
 * hidden columns of the output; each column's sums run in group order on one thread, so the
 * result does not depend on the thread count.
 *
 * Returns 0; -1 for an expert or row id out of range (nothing written); -2 when memory for the
 * activations cannot be had. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define CHUNK 4 /* rows of x per pass over a weight row (8 measured no faster) */

#ifdef SIMD_LANES
/* res[0:mc] = the lane sums of acc[0:mc] (mc <= 4). Each sum is added in the same order whatever
 * its position and mc: an entry's result does not depend on how many rows share its expert (one
 * micro-batch or two give the same bits) */
static inline __attribute__((always_inline)) void hsums(const simd_f32 *acc, float *res, const int mc) {
    simd_f32 zero = simd_zero();
    float sums[4];
    simd_hsum4(acc[0], mc > 1 ? acc[1] : zero, mc > 2 ? acc[2] : zero, mc > 3 ? acc[3] : zero, sums);
    for (int m = 0; m < mc; m++) res[m] = sums[m];
}
#endif

/* res[m] = dot(w[0:k], x[m][0:k]) for m < mc, in float32. (Two weight rows per pass, each x
 * vector loaded once for both, measured slower: 8.3 against 6.4 ms for a layer of 64 experts at
 * 32 tokens; so did software prefetches of the rows ahead.) */
static inline __attribute__((always_inline)) void dot_rows(const void *w, const void *const *x, float *res,
                                                           int64_t k, const int bf16, const int mc) {
#if defined(__AVX512BF16__)
    if (bf16) {
        __m512 acc[CHUNK];
        for (int m = 0; m < mc; m++) acc[m] = _mm512_setzero_ps();
        for (int64_t i = 0; i < k; i += 32) {
            __m512bh wv = (__m512bh)_mm512_loadu_si512((const uint16_t *)w + i);
            for (int m = 0; m < mc; m++)
                acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)_mm512_loadu_si512((const uint16_t *)x[m] + i), wv);
        }
        hsums(acc, res, mc);
        return;
    }
#endif
#ifdef SIMD_LANES
    simd_f32 acc[CHUNK];
    for (int m = 0; m < mc; m++) acc[m] = simd_zero();
    for (int64_t i = 0; i < k; i += SIMD_LANES) {
        if (bf16) {
            simd_f32 wv = simd_load_bf16((const uint16_t *)w + i);
            for (int m = 0; m < mc; m++) acc[m] = simd_fma(simd_load_bf16((const uint16_t *)x[m] + i), wv, acc[m]);
        } else {
            simd_f32 wv = simd_load((const float *)w + i);
            for (int m = 0; m < mc; m++) acc[m] = simd_fma(simd_load((const float *)x[m] + i), wv, acc[m]);
        }
    }
    hsums(acc, res, mc);
#else
    for (int m = 0; m < mc; m++) {
        float sum = 0.0f;
        if (bf16) {
            const uint16_t *a = (const uint16_t *)w, *b = (const uint16_t *)x[m];
            for (int64_t i = 0; i < k; i++) sum += bf16_to_float(a[i]) * bf16_to_float(b[i]);
        } else {
            const float *a = (const float *)w, *b = (const float *)x[m];
            for (int64_t i = 0; i < k; i++) sum += a[i] * b[i];
        }
        res[m] = sum;
    }
#endif
}

/* dot_rows with the dtype and the row count as constants (one specialization each) */
static void dots(const void *w, const void *const *x, float *res, int64_t k, int bf16, int mc) {
#define DOTS_CASE(MC)                                                                                          \
    case MC:                                                                                                   \
        if (bf16)                                                                                              \
            dot_rows(w, x, res, k, 1, MC);                                                                     \
        else                                                                                                   \
            dot_rows(w, x, res, k, 0, MC);                                                                     \
        return;
    switch (mc) {
        DOTS_CASE(1)
        DOTS_CASE(2)
        DOTS_CASE(3)
        DOTS_CASE(4)
    }
#undef DOTS_CASE
}

static inline float rounded(float v, int bf16) { return bf16 ? bf16_round(v) : v; }

static inline const void *row_at(const void *base, int64_t row, int64_t stride, int bf16) {
    return bf16 ? (const void *)((const uint16_t *)base + row * stride) : (const void *)((const float *)base + row * stride);
}

/* act rows [starts[g], starts[g] + sizes[g]) for weight rows [n0, n1) of the intermediate: CHUNK
 * rows of x over the expert's rows, then the next CHUNK (the expert's weights again, from L2).
 * The other order, a weight row over up to 16 rows of x while in L1, measured slower: 15 against
 * 11 ms for 64 experts of 8 rows each */
static void gate_up_rows(const void *x, int64_t x_stride, const void *w13, int64_t hidden, int64_t inter,
                         const int64_t *row_ids, const int64_t *experts, const int64_t *sizes, const int64_t *starts,
                         int64_t num_groups, void *act, int bf16, int64_t n0, int64_t n1) {
    const void *xs[CHUNK];
    float g[CHUNK], u[CHUNK];
    for (int64_t grp = 0; grp < num_groups; grp++) {
        const void *w = row_at(w13, experts[grp] * 2 * inter, hidden, bf16);
        for (int64_t m0 = 0; m0 < sizes[grp]; m0 += CHUNK) {
            int mc = sizes[grp] - m0 < CHUNK ? (int)(sizes[grp] - m0) : CHUNK;
            int64_t entry = starts[grp] + m0;
            for (int m = 0; m < mc; m++) xs[m] = row_at(x, row_ids[entry + m], x_stride, bf16);
            for (int64_t n = n0; n < n1; n++) {
                dots(row_at(w, n, hidden, bf16), xs, g, hidden, bf16, mc);
                dots(row_at(w, inter + n, hidden, bf16), xs, u, hidden, bf16, mc);
                for (int m = 0; m < mc; m++) {
                    float gate = rounded(g[m], bf16), up = rounded(u[m], bf16);
                    float a = gate / (1.0f + expf(-gate)) * up;
                    if (bf16)
                        ((uint16_t *)act)[(entry + m) * inter + n] = float_to_bf16(a);
                    else
                        ((float *)act)[(entry + m) * inter + n] = a;
                }
            }
        }
    }
}

/* out columns [j0, j1): out[row] += weight * (act @ w2[e]^T) per entry, groups in order */
static void down_cols(const void *act, const void *w2, int64_t hidden, int64_t inter, const int64_t *row_ids,
                      const int64_t *experts, const int64_t *sizes, const int64_t *starts, int64_t num_groups,
                      const float *weights, float *out, int bf16, int64_t j0, int64_t j1) {
    const void *as[CHUNK];
    float y[CHUNK];
    for (int64_t grp = 0; grp < num_groups; grp++) {
        const void *w = row_at(w2, experts[grp] * hidden, inter, bf16);
        for (int64_t m0 = 0; m0 < sizes[grp]; m0 += CHUNK) {
            int mc = sizes[grp] - m0 < CHUNK ? (int)(sizes[grp] - m0) : CHUNK;
            int64_t entry = starts[grp] + m0;
            for (int m = 0; m < mc; m++) as[m] = row_at(act, entry + m, inter, bf16);
            for (int64_t j = j0; j < j1; j++) {
                dots(row_at(w, j, inter, bf16), as, y, inter, bf16, mc);
                for (int m = 0; m < mc; m++) out[row_ids[entry + m] * hidden + j] += rounded(y[m], bf16) * weights[entry + m];
            }
        }
    }
}

int grouped_moe(const void *x, int64_t x_stride, int64_t num_rows, const void *w13, const void *w2,
                int64_t num_experts, int64_t hidden, int64_t inter, const int64_t *row_ids, const int64_t *experts,
                const int64_t *sizes, int64_t num_groups, const float *weights, float *out, int bf16, int threads) {
    int64_t *starts = malloc((size_t)(num_groups > 0 ? num_groups : 1) * sizeof(int64_t));
    if (!starts) return -2;
    int64_t num_entries = 0;
    for (int64_t grp = 0; grp < num_groups; grp++) {
        if (experts[grp] < 0 || experts[grp] >= num_experts || sizes[grp] < 0) {
            free(starts);
            return -1;
        }
        starts[grp] = num_entries;
        num_entries += sizes[grp];
    }
    for (int64_t i = 0; i < num_entries; i++) {
        if (row_ids[i] < 0 || row_ids[i] >= num_rows) {
            free(starts);
            return -1;
        }
    }
    void *act = malloc((size_t)(num_entries > 0 ? num_entries : 1) * (size_t)inter * (bf16 ? 2 : 4));
    if (!act) {
        free(starts);
        return -2;
    }
    int parts = threads > 1 ? threads : 1;
#ifdef _OPENMP /* without it the parts run one after another (c_parts.h) */
#pragma omp parallel num_threads(parts)
#endif
    {
#ifdef _OPENMP
#pragma omp for schedule(static, 1)
#endif
        for (int p = 0; p < parts; p++)
            gate_up_rows(x, x_stride, w13, hidden, inter, row_ids, experts, sizes, starts, num_groups, act, bf16,
                         inter * p / parts, inter * (p + 1) / parts);
#ifdef _OPENMP
#pragma omp for schedule(static, 1)
#endif
        for (int p = 0; p < parts; p++)
            down_cols(act, w2, hidden, inter, row_ids, experts, sizes, starts, num_groups, weights, out, bf16,
                      hidden * p / parts, hidden * (p + 1) / parts);
    }
    free(act);
    free(starts);
    return 0;
}
