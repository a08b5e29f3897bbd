/* Group-quantized GEMV for the CPU (kernels/group_gemv.py builds and loads it).
 *
 *   y[m, n] = sum_g (scale[n, g] * sum_j q[n, g, j] * x[m, g, j] + min[n, g] * sum_j x[m, g, j])
 *
 * for a few rows of x (decode: one per request), x [M, K] float32, y [M, N] float32, scale and min
 * [N, K / group] float32 or float16 (`half`), min optional (NULL). Two code layouts:
 *   int8:    q [N, K] int8, row-major (GGUF Q8_0: groups of 32; Q6_K: 16);
 *   nibbles: q [N, K / 2] uint8, each 32 columns of a row as 16 bytes, byte j holding column j in
 *            its low and column j + 16 in its high nibble (GGUF's own Q4_0 / Q4_1 / Q4_K order).
 * The weights are read once for all M rows: each code is widened to float32 once, multiplied with
 * every row of x, and each group's products are scaled lane by lane (no horizontal sum until the
 * row's end). Sums in float32 with fused multiply-adds.
 *
 * A third layout, 4-bit codes in row blocks with group-major scales (code_blocks.h), has its GEMV,
 * GEMM and row gather exported here as blocks_*.
 *
 * Vector loops where the build has simd.h's vectors (AVX-512, AVX2 + FMA), scalar loops otherwise.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "c_parts.h"
#include "code_blocks.h"
#include "simd.h"

#define MAX_M 8

/* a float16 (half) or float32 scale */
static inline float load_scale(const void *p, int64_t i, int half) {
    return half ? half_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* code j of a row in either layout */
static inline float code_at(const uint8_t *row, int64_t j, int nibbles) {
    if (!nibbles) return (float)((const int8_t *)row)[j];
    uint8_t b = row[(j / 32) * 16 + (j % 16)];
    return (float)((j % 32) < 16 ? (b & 0x0F) : (b >> 4));
}

/* any group and layout; the mins' terms read the caller's group sums, as rows_vector does */
static void rows_scalar(const uint8_t *codes, int nibbles, const void *scale, const void *mins, int half,
                        const float *x, const float *xsum, float *y, int64_t m, int64_t n, int64_t k, int64_t group,
                        int64_t row_begin, int64_t row_end) {
    int64_t num_groups = k / group, row_bytes = nibbles ? k / 2 : k;
    for (int64_t r = row_begin; r < row_end; r++) {
        const uint8_t *c = codes + r * row_bytes;
        for (int64_t i = 0; i < m; i++) {
            const float *xi = x + i * k;
            float acc = 0.0f;
            for (int64_t g = 0; g < num_groups; g++) {
                float dot = 0.0f;
                for (int64_t j = g * group; j < (g + 1) * group; j++) dot += code_at(c, j, nibbles) * xi[j];
                acc += load_scale(scale, r * num_groups + g, half) * dot;
                if (mins) acc += load_scale(mins, r * num_groups + g, half) * xsum[i * num_groups + g];
            }
            y[i * n + r] = acc;
        }
    }
}

#ifdef SIMD_LANES
/* SIMD_LANES bytes of nibble codes: their low and their high nibbles, minus `offset`, as floats */
static inline void widen_nibbles(const uint8_t *p, int offset, simd_f32 *low, simd_f32 *high) {
    simd_i32 b = simd_load_u8(p);
    *low = simd_low_nibbles(b, offset);
    *high = simd_high_nibbles(b, offset);
}

/* Inlined with constant m, group and layout (the dispatch below), so that the loops unroll and the
 * accumulators stay in registers. Group sums of x (for the mins) are taken once per call. */
static inline __attribute__((always_inline)) void rows_vector(const uint8_t *codes, const int nibbles,
                                                              const void *scale, const void *mins,
                                                              const int half, const float *x, float *y,
                                                              const int64_t m, int64_t n, int64_t k,
                                                              const int64_t group, const float *xsum,
                                                              int64_t row_begin, int64_t row_end) {
    int64_t num_groups = k / group, row_bytes = nibbles ? k / 2 : k;
    for (int64_t r = row_begin; r < row_end; r++) {
        const uint8_t *c = codes + r * row_bytes;
        simd_f32 acc[MAX_M];
        float tail[MAX_M];
        for (int64_t i = 0; i < m; i++) acc[i] = simd_zero(), tail[i] = 0.0f;
        for (int64_t g = 0; g < num_groups; g++) {
            const float *xg = x + g * group;
            simd_f32 sg = simd_set1(load_scale(scale, r * num_groups + g, half));
            simd_f32 part[MAX_M];
            if (nibbles) { /* group is a multiple of 32: 16 bytes per 32 columns */
                const uint8_t *cg = c + g * group / 2;
                for (int64_t j = 0; j < group; j += 32) {
                    for (int64_t h = 0; h < 16; h += SIMD_LANES) {
                        simd_f32 low, high;
                        widen_nibbles(cg + j / 2 + h, 0, &low, &high);
                        for (int64_t i = 0; i < m; i++) {
                            simd_f32 t = simd_mul(low, simd_load(xg + i * k + j + h));
                            t = simd_fma(high, simd_load(xg + i * k + j + 16 + h), t);
                            part[i] = (j == 0 && h == 0) ? t : simd_add(part[i], t);
                        }
                    }
                }
            } else {
                const int8_t *cg = (const int8_t *)c + g * group;
                simd_f32 w = simd_load_i8(cg);
                for (int64_t i = 0; i < m; i++) part[i] = simd_mul(w, simd_load(xg + i * k));
                for (int64_t j = SIMD_LANES; j < group; j += SIMD_LANES) {
                    w = simd_load_i8(cg + j);
                    for (int64_t i = 0; i < m; i++) part[i] = simd_fma(w, simd_load(xg + i * k + j), part[i]);
                }
            }
            for (int64_t i = 0; i < m; i++) acc[i] = simd_fma(sg, part[i], acc[i]);
            if (mins) {
                float mg = load_scale(mins, r * num_groups + g, half);
                for (int64_t i = 0; i < m; i++) tail[i] += mg * xsum[i * num_groups + g];
            }
        }
        for (int64_t i = 0; i < m; i++) y[i * n + r] = simd_hsum(acc[i]) + tail[i];
    }
}

#define CASE_M(M, NIB, G)                                                                          \
    case M:                                                                                        \
        rows_vector(codes, NIB, scale, mins, half, x, y, M, n, k, G, xsum, row_begin, row_end);    \
        return 0;
#define SWITCH_M(NIB, G)                                                                           \
    switch (m) {                                                                                   \
        CASE_M(1, NIB, G) CASE_M(2, NIB, G) CASE_M(3, NIB, G) CASE_M(4, NIB, G)                    \
        CASE_M(5, NIB, G) CASE_M(6, NIB, G) CASE_M(7, NIB, G) CASE_M(8, NIB, G)                    \
    }                                                                                              \
    return -1;

static int rows_dispatch(const uint8_t *codes, int nibbles, const void *scale, const void *mins, int half,
                         const float *x, float *y, int64_t m, int64_t n, int64_t k, int64_t group,
                         const float *xsum, int64_t row_begin, int64_t row_end) {
    if (nibbles && group == 32) {
        SWITCH_M(1, 32)
    } else if (!nibbles && group == 32) {
        SWITCH_M(0, 32)
    } else if (!nibbles && group == 16) {
        SWITCH_M(0, 16)
    }
    return -1;
}
#endif

/* Rows [row_begin, row_end) of y. `xsum` [M, K / group]: the group sums of x (read only with mins).
 * Returns 0, or -1 when the shapes are not supported. */
int group_gemv(const uint8_t *codes, int nibbles, const void *scale, const void *mins, int half, const float *x,
               const float *xsum, float *y, int64_t m, int64_t n, int64_t k, int64_t group, int64_t row_begin,
               int64_t row_end) {
    if (m < 1 || m > MAX_M || group < 1 || k % group || (nibbles && group % 32) || row_begin < 0 || row_end > n ||
        row_begin > row_end)
        return -1;
#ifdef SIMD_LANES
    if (rows_dispatch(codes, nibbles, scale, mins, half, x, y, m, n, k, group, xsum, row_begin, row_end) == 0)
        return 0;
#endif
    rows_scalar(codes, nibbles, scale, mins, half, x, xsum, y, m, n, k, group, row_begin, row_end);
    return 0;
}

/* ---- Dequantization: rounds of more than MAX_M rows rebuild the weight and multiply densely ---- */

#ifdef SIMD_LANES
/* w into out + at, float32 or bfloat16 (simd.h's rounding; w holds no subnormal and no NaN: the
 * caller has checked its scales, simd.h's any_unsafe_scale) */
static inline void store_out(void *out, int64_t at, simd_f32 w, const int out_bf16) {
    if (out_bf16)
        simd_store_bf16_normal((uint16_t *)out + at, w);
    else
        simd_store((float *)out + at, w);
}
#endif

/* Whether no weight of `count` groups from group `at` can be subnormal or NaN (simd.h's
 * any_unsafe_scale of their scales and mins), so that their bfloat16 stores may skip the tests */
static int scales_normal(const void *scale, const void *mins, int half, int64_t at, int64_t count) {
    if (half)
        return !any_unsafe_scale_half((const uint16_t *)scale + at, count) &&
               !(mins && any_unsafe_scale_half((const uint16_t *)mins + at, count));
    return !any_unsafe_scale((const float *)scale + at, count) &&
           !(mins && any_unsafe_scale((const float *)mins + at, count));
}

/* Whether rows may take dequantize_row's vector loops: groups of whole vectors and, for bfloat16
 * output, scales_normal over their `count` groups from `at` */
static int vector_rows(int64_t group, int out_bf16, const void *scale, const void *mins, int half, int64_t at,
                       int64_t count) {
#ifdef SIMD_LANES
    int64_t lanes = SIMD_LANES;
#else
    int64_t lanes = 0; /* no vector loops */
#endif
    return lanes && group % lanes == 0 && (!out_bf16 || scales_normal(scale, mins, half, at, count));
}

/* One row of a group-quantized weight (either layout, as group_gemv reads it) into `out` [K], float32
 * or bfloat16: w = code * scale (+ min) with one rounding to float32 (a fused multiply-add), then
 * one to bfloat16. The product of a code and GGUF's scales is exact in float32, so for GGUF's
 * weights this also equals torch's addcmul(min, code, scale), which rounds the product first.
 * `vector`: the vector loops (groups of whole vectors, no subnormal or NaN weight), else the scalar
 * ones; `out_bf16` and `vector` constants where inlined (dequantize_row). */
static inline __attribute__((always_inline)) void dequantize_row_impl(const uint8_t *c, int nibbles, const void *scale,
                                                                       const void *mins, int half, int64_t scale_row,
                                                                       int64_t k, int64_t group, void *out,
                                                                       const int out_bf16, const int vector) {
    int64_t num_groups = k / group;
    float w[256]; /* one group at a time (group <= 256 is checked by the caller) */
    for (int64_t g = 0; g < num_groups; g++) {
        float s = load_scale(scale, scale_row * num_groups + g, half);
        float m = mins ? load_scale(mins, scale_row * num_groups + g, half) : 0.0f;
#ifdef SIMD_LANES
        if (vector) {
            simd_f32 vs = simd_set1(s), vm = simd_set1(m);
            int64_t at = g * group;
            if (nibbles) {
                const uint8_t *cg = c + g * group / 2;
                for (int64_t j = 0; j < group; j += 32)
                    for (int64_t h = 0; h < 16; h += SIMD_LANES) {
                        simd_f32 low, high;
                        widen_nibbles(cg + j / 2 + h, 0, &low, &high);
                        store_out(out, at + j + h, simd_fma(low, vs, vm), out_bf16);
                        store_out(out, at + j + 16 + h, simd_fma(high, vs, vm), out_bf16);
                    }
            } else {
                const int8_t *cg = (const int8_t *)c + g * group;
                for (int64_t j = 0; j < group; j += SIMD_LANES) {
                    simd_f32 q = simd_load_i8(cg + j);
                    store_out(out, at + j, mins ? simd_fma(q, vs, vm) : simd_mul(q, vs), out_bf16);
                }
            }
            continue;
        }
#else
        (void)vector; /* no vector loops in this build */
#endif
        if (nibbles) {
            const uint8_t *cg = c + g * group / 2;
            for (int64_t j = 0; j < group; j += 32)
                for (int64_t h = 0; h < 16; h++) {
                    w[j + h] = fmaf((float)(cg[j / 2 + h] & 0x0F), s, m);
                    w[j + 16 + h] = fmaf((float)(cg[j / 2 + h] >> 4), s, m);
                }
        } else {
            const int8_t *cg = (const int8_t *)c + g * group;
            if (mins)
                for (int64_t j = 0; j < group; j++) w[j] = fmaf((float)cg[j], s, m);
            else
                for (int64_t j = 0; j < group; j++) w[j] = (float)cg[j] * s;
        }
        if (out_bf16) {
            uint16_t *o = (uint16_t *)out + g * group;
            for (int64_t j = 0; j < group; j++) o[j] = float_to_bf16(w[j]);
        } else {
            memcpy((float *)out + g * group, w, (size_t)group * sizeof(float));
        }
    }
}

/* `vector`: the row may take the vector loops (the caller's scales_normal for bfloat16) */
static void dequantize_row(const uint8_t *c, int nibbles, const void *scale, const void *mins, int half,
                           int64_t scale_row, int64_t k, int64_t group, void *out, int out_bf16, int vector) {
    if (out_bf16 && vector)
        dequantize_row_impl(c, nibbles, scale, mins, half, scale_row, k, group, out, 1, 1);
    else if (out_bf16)
        dequantize_row_impl(c, nibbles, scale, mins, half, scale_row, k, group, out, 1, 0);
    else if (vector)
        dequantize_row_impl(c, nibbles, scale, mins, half, scale_row, k, group, out, 0, 1);
    else
        dequantize_row_impl(c, nibbles, scale, mins, half, scale_row, k, group, out, 0, 0);
}

/* Rows of the weight into out [R, K] (float32, or bfloat16 with `out_bf16`): row i of out is weight
 * row rows[i] (a gather, e.g. an embedding) or, with rows NULL, row row_begin + i; i runs over
 * [out_begin, out_end) so that threads can split one call. Returns 0, or -1 for unsupported shapes. */
int group_dequantize(const uint8_t *codes, int nibbles, const void *scale, const void *mins, int half,
                     const int64_t *rows, int64_t row_begin, int64_t out_begin, int64_t out_end, int64_t k,
                     int64_t group, void *out, int out_bf16) {
    if (group < 1 || group > 256 || k % group || (nibbles && group % 32) || out_begin < 0 || out_begin > out_end)
        return -1;
    int64_t row_bytes = nibbles ? k / 2 : k, elem = out_bf16 ? 2 : 4, groups = k / group;
    /* a range of rows: their scales checked in one pass (row by row, the check costs a tenth of the
     * work); a gather: row by row */
    int vector = !rows && vector_rows(group, out_bf16, scale, mins, half, (row_begin + out_begin) * groups,
                                      (out_end - out_begin) * groups);
    for (int64_t i = out_begin; i < out_end; i++) {
        int64_t r = rows ? rows[i] : row_begin + i;
        if (rows) vector = vector_rows(group, out_bf16, scale, mins, half, r * groups, groups);
        dequantize_row(codes + r * row_bytes, nibbles, scale, mins, half, r, k, group, (uint8_t *)out + i * k * elem,
                       out_bf16, vector);
    }
    return 0;
}

/* columns [kk, stop) of one block of int4pack_dequantize: w = (q - 8) * s + z rounded once to
 * bfloat16, into out (row stride ld); `half_n` (block_n / 2) a constant where inlined, so that the
 * vector loop unrolls; `vector`: whole vectors, and no scale that could give a subnormal or NaN weight */
static inline __attribute__((always_inline)) void int4pack_columns(const uint8_t *block, const float *s,
                                                                    const float *z, int64_t kk, int64_t stop,
                                                                    const int64_t half_n, int vector, uint16_t *out,
                                                                    int64_t ld) {
    for (; kk < stop; kk++) {
        const uint8_t *b = block + kk * half_n;
        uint16_t *o = out + kk * ld;
#ifdef SIMD_LANES
        if (vector) {
            for (int64_t j = 0; j < half_n; j += SIMD_LANES) {
                simd_f32 low, high; /* codes - 8 */
                widen_nibbles(b + j, 8, &low, &high);
                simd_f32 w_low = simd_fma(low, simd_load(s + j), simd_load(z + j));
                simd_f32 w_high = simd_fma(high, simd_load(s + half_n + j), simd_load(z + half_n + j));
                simd_store_bf16_normal(o + j, w_low);
                simd_store_bf16_normal(o + half_n + j, w_high);
            }
            continue;
        }
#else
        (void)vector; /* no vector loop in this build */
#endif
        for (int64_t j = 0; j < half_n; j++) {
            o[j] = float_to_bf16(fmaf((float)((b[j] & 0x0F) - 8), s[j], z[j]));
            o[half_n + j] = float_to_bf16(fmaf((float)((b[j] >> 4) - 8), s[half_n + j], z[half_n + j]));
        }
    }
}

/* PyTorch's CPU int4pack layout (`_convert_weight_to_int4pack_for_cpu`, N a multiple of block_n):
 * per block of block_n output rows, per column k, block_n / 2 bytes, byte j holding row j in its
 * low and row block_n / 2 + j in its high nibble; scales_zeros [G, N, 2] bfloat16 with
 * w = (q - 8) * scale + zero. Writes the transposed weight, out[k][n - n_begin] for k in
 * [k_begin, k_end) and n in [n_begin, n_end) (multiples of block_n), bfloat16, row stride
 * n_end - n_begin: x @ out is x @ W^T. w is computed in float32 and rounded once. */
int int4pack_dequantize(const uint8_t *packed, const uint16_t *scales_zeros, int64_t n, int64_t k, int64_t group,
                        int64_t block_n, int64_t n_begin, int64_t n_end, int64_t k_begin, int64_t k_end,
                        uint16_t *out) {
    if (block_n < 2 || block_n > 256 || block_n % 2 || n % block_n || n_begin % block_n || n_end % block_n ||
        n_begin < 0 || n_end > n || n_begin > n_end || group < 1 || k % group || k_begin < 0 || k_end > k ||
        k_begin > k_end)
        return -1;
    int64_t half_n = block_n / 2, ld = n_end - n_begin;
    float s[256], z[256];
    /* the vector loop for whole vectors, unless a scale or zero of the call's groups could give a
     * subnormal or NaN weight (simd.h's any_unsafe_scale): then the scalar loop, whose rounding
     * takes them */
#ifdef SIMD_LANES
    int vector = half_n % SIMD_LANES == 0;
    for (int64_t g = k_begin / group; g * group < k_end && vector; g++)
        vector = !any_unsafe_scale_bf16(scales_zeros + 2 * (g * n + n_begin), 2 * (n_end - n_begin));
#else
    int vector = 0;
#endif
    for (int64_t nb = n_begin; nb < n_end; nb += block_n) {
        const uint8_t *block = packed + nb * k / 2;
        for (int64_t kk = k_begin; kk < k_end;) {
            int64_t g = kk / group, stop = (g + 1) * group < k_end ? (g + 1) * group : k_end;
            const uint16_t *sz = scales_zeros + (g * n + nb) * 2;
            for (int64_t j = 0; j < block_n; j++) {
                s[j] = bf16_to_float(sz[2 * j]);
                z[j] = bf16_to_float(sz[2 * j + 1]);
            }
            uint16_t *o = out + (nb - n_begin);
            if (half_n == 32) /* 64-row blocks: ATen's layout with AVX-512 */
                int4pack_columns(block, s, z, kk, stop, 32, vector, o, ld);
            else if (half_n == 16) /* 32-row blocks: with AVX2 */
                int4pack_columns(block, s, z, kk, stop, 16, vector, o, ld);
            else
                int4pack_columns(block, s, z, kk, stop, half_n, vector, o, ld);
            kk = stop;
        }
    }
    return 0;
}

/* The vectors the library was built for: 512, 256 (bits) or 0 (scalar). */
int group_gemv_width(void) {
#ifdef SIMD_LANES
    return SIMD_LANES * 32;
#else
    return 0;
#endif
}

/* the kernels above with their rows split over OpenMP threads (c_parts.h) */
int group_gemv_parts(const uint8_t *codes, int nibbles, const void *scale, const void *mins, int half,
                     const float *x, const float *xsum, float *y, int64_t m, int64_t n, int64_t k, int64_t group,
                     const int64_t *bounds, int64_t parts) {
    RUN_PARTS(group_gemv(codes, nibbles, scale, mins, half, x, xsum, y, m, n, k, group, begin, end))
}

int group_dequantize_parts(const uint8_t *codes, int nibbles, const void *scale, const void *mins, int half,
                           const int64_t *rows, int64_t row_begin, const int64_t *bounds, int64_t parts, int64_t k,
                           int64_t group, void *out, int out_bf16) {
    RUN_PARTS(group_dequantize(codes, nibbles, scale, mins, half, rows, row_begin, begin, end, k, group, out, out_bf16))
}

int int4pack_dequantize_parts(const uint8_t *packed, const uint16_t *scales_zeros, int64_t n, int64_t k,
                              int64_t group, int64_t block_n, int64_t n_begin, int64_t n_end, const int64_t *bounds,
                              int64_t parts, uint16_t *out) {
    RUN_PARTS(int4pack_dequantize(packed, scales_zeros, n, k, group, block_n, n_begin, n_end, begin, end, out))
}

/* code blocks (code_blocks.h), 4- or 8-bit: y = x W^T for rows [begin, end) of y (multiples of
 * block_n), a few rows of x (GEMV) or more (GEMM); rows of W gathered into out rows [out_begin, out_end) */
int blocks_gemv(const uint8_t *packed, int bits, const void *scale, const void *mins, int half, const float *x,
                const float *xsum, float *y, int64_t m, int64_t n, int64_t k, int64_t group, int64_t block_n,
                int64_t begin, int64_t end) {
    return cb_gemv(packed, bits, scale, mins, half, x, xsum, y, m, n, k, group, block_n, begin, end);
}

int blocks_gemm(const uint8_t *packed, int bits, const void *scale, const void *mins, int half, const float *x,
                float *y, int64_t m, int64_t n, int64_t k, int64_t group, int64_t block_n, int64_t begin, int64_t end) {
    return cb_gemm(packed, bits, scale, mins, half, x, y, m, n, k, group, block_n, begin, end);
}

int blocks_gemm_bf16(const uint8_t *packed, int bits, const void *scale, const void *mins, int half, const uint16_t *x,
                     float *y, int64_t m, int64_t n, int64_t k, int64_t group, int64_t block_n, int64_t begin,
                     int64_t end) {
    return cb_gemm_bf16(packed, bits, scale, mins, half, x, y, m, n, k, group, block_n, begin, end);
}

int blocks_gather(const uint8_t *packed, int bits, const void *scale, const void *mins, int half, int64_t n, int64_t k,
                  int64_t group, int64_t block_n, const int64_t *rows, int64_t row_begin, int64_t out_begin,
                  int64_t out_end, float *out) {
    return cb_gather(packed, bits, scale, mins, half, n, k, group, block_n, rows, row_begin, out_begin, out_end, out);
}

int blocks_gemv_parts(const uint8_t *packed, int bits, const void *scale, const void *mins, int half, const float *x,
                      const float *xsum, float *y, int64_t m, int64_t n, int64_t k, int64_t group, int64_t block_n,
                      const int64_t *bounds, int64_t parts) {
    RUN_PARTS(cb_gemv(packed, bits, scale, mins, half, x, xsum, y, m, n, k, group, block_n, begin, end))
}

int blocks_gemm_parts(const uint8_t *packed, int bits, const void *scale, const void *mins, int half, const float *x,
                      float *y, int64_t m, int64_t n, int64_t k, int64_t group, int64_t block_n, const int64_t *bounds,
                      int64_t parts) {
    RUN_PARTS(cb_gemm(packed, bits, scale, mins, half, x, y, m, n, k, group, block_n, begin, end))
}

int blocks_gemm_bf16_parts(const uint8_t *packed, int bits, const void *scale, const void *mins, int half,
                           const uint16_t *x, float *y, int64_t m, int64_t n, int64_t k, int64_t group, int64_t block_n,
                           const int64_t *bounds, int64_t parts) {
    RUN_PARTS(cb_gemm_bf16(packed, bits, scale, mins, half, x, y, m, n, k, group, block_n, begin, end))
}

/* 1 where blocks_gemm_bf16 runs (AVX512-BF16), else 0 */
int blocks_bf16_gemm(void) {
#ifdef CB_BF16_GEMM
    return 1;
#else
    return 0;
#endif
}

int blocks_gather_parts(const uint8_t *packed, int bits, const void *scale, const void *mins, int half, int64_t n,
                        int64_t k, int64_t group, int64_t block_n, const int64_t *rows, int64_t row_begin,
                        const int64_t *bounds, int64_t parts, float *out) {
    RUN_PARTS(cb_gather(packed, bits, scale, mins, half, n, k, group, block_n, rows, row_begin, begin, end, out))
}

/* the row block the vector loops of code_blocks.h read (4 vectors of float32 lanes), 0 without them */
int blocks_block_n(void) {
#ifdef SIMD_LANES
    return 4 * SIMD_LANES;
#else
    return 0;
#endif
}
