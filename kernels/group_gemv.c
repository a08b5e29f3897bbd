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
 * Built with -march=native: AVX-512 or AVX2 where the compiler targets them, a scalar loop otherwise.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "c_parts.h"
#include "code_blocks.h"
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define MAX_M 8

/* a float16 (half) or float32 scale (cb_half_to_float: code_blocks.h) */
static inline float load_scale(const void *p, int64_t i, int half) {
    return half ? cb_half_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* code j of a row in either layout */
static inline float code_at(const uint8_t *row, int64_t j, int nibbles) {
    if (!nibbles) return (float)((const int8_t *)row)[j];
    uint8_t b = row[(j / 32) * 16 + (j % 16)];
    return (float)((j % 32) < 16 ? (b & 0x0F) : (b >> 4));
}

static void rows_scalar(const uint8_t *codes, int nibbles, const void *scale, const void *mins, int half,
                        const float *x, float *y, int64_t m, int64_t n, int64_t k, int64_t group,
                        int64_t row_begin, int64_t row_end) {
    int64_t num_groups = k / group, row_bytes = nibbles ? k / 2 : k;
    for (int64_t r = row_begin; r < row_end; r++) {
        const uint8_t *c = codes + r * row_bytes;
        for (int64_t i = 0; i < m; i++) {
            const float *xi = x + i * k;
            float acc = 0.0f;
            for (int64_t g = 0; g < num_groups; g++) {
                float dot = 0.0f, sum = 0.0f;
                for (int64_t j = g * group; j < (g + 1) * group; j++) {
                    dot += code_at(c, j, nibbles) * xi[j];
                    sum += xi[j];
                }
                acc += load_scale(scale, r * num_groups + g, half) * dot;
                if (mins) acc += load_scale(mins, r * num_groups + g, half) * sum;
            }
            y[i * n + r] = acc;
        }
    }
}

#if defined(__AVX512F__)
#define LANES 16
#define VEC __m512
#define ZERO() _mm512_setzero_ps()
#define LOAD(p) _mm512_loadu_ps(p)
#define MUL(a, b) _mm512_mul_ps(a, b)
#define ADD(a, b) _mm512_add_ps(a, b)
#define FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define SET1(s) _mm512_set1_ps(s)
static inline float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }
static inline __m512 widen_i8(const int8_t *p) { /* 16 codes */
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline void widen_nibbles(const uint8_t *p, __m512 *low, __m512 *high) { /* 16 bytes: 32 codes */
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    *low = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(0x0F)));
    *high = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
}
#elif defined(__AVX2__)
#define LANES 8
#define VEC __m256
#define ZERO() _mm256_setzero_ps()
#define LOAD(p) _mm256_loadu_ps(p)
#define MUL(a, b) _mm256_mul_ps(a, b)
#define ADD(a, b) _mm256_add_ps(a, b)
#define FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define SET1(s) _mm256_set1_ps(s)
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline __m256 widen_i8(const int8_t *p) { /* 8 codes */
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline void widen_nibbles(const uint8_t *p, __m256 *low, __m256 *high) { /* 8 bytes: 16 codes */
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    *low = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(0x0F)));
    *high = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
}
#endif

#ifdef LANES
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
        VEC acc[MAX_M];
        float tail[MAX_M];
        for (int64_t i = 0; i < m; i++) acc[i] = ZERO(), tail[i] = 0.0f;
        for (int64_t g = 0; g < num_groups; g++) {
            const float *xg = x + g * group;
            VEC sg = SET1(load_scale(scale, r * num_groups + g, half));
            VEC part[MAX_M];
            if (nibbles) { /* group is a multiple of 32: 16 bytes per 32 columns */
                const uint8_t *cg = c + g * group / 2;
                for (int64_t j = 0; j < group; j += 32) {
                    for (int64_t h = 0; h < 16; h += LANES) {
                        VEC low, high;
                        widen_nibbles(cg + j / 2 + h, &low, &high);
                        for (int64_t i = 0; i < m; i++) {
                            VEC t = MUL(low, LOAD(xg + i * k + j + h));
                            t = FMA(high, LOAD(xg + i * k + j + 16 + h), t);
                            part[i] = (j == 0 && h == 0) ? t : ADD(part[i], t);
                        }
                    }
                }
            } else {
                const int8_t *cg = (const int8_t *)c + g * group;
                VEC w = widen_i8(cg);
                for (int64_t i = 0; i < m; i++) part[i] = MUL(w, LOAD(xg + i * k));
                for (int64_t j = LANES; j < group; j += LANES) {
                    w = widen_i8(cg + j);
                    for (int64_t i = 0; i < m; i++) part[i] = FMA(w, LOAD(xg + i * k + j), part[i]);
                }
            }
            for (int64_t i = 0; i < m; i++) acc[i] = FMA(sg, part[i], acc[i]);
            if (mins) {
                float mg = load_scale(mins, r * num_groups + g, half);
                for (int64_t i = 0; i < m; i++) tail[i] += mg * xsum[i * num_groups + g];
            }
        }
        for (int64_t i = 0; i < m; i++) y[i * n + r] = hsum(acc[i]) + tail[i];
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
#ifdef LANES
    if (rows_dispatch(codes, nibbles, scale, mins, half, x, y, m, n, k, group, xsum, row_begin, row_end) == 0)
        return 0;
#endif
    rows_scalar(codes, nibbles, scale, mins, half, x, y, m, n, k, group, row_begin, row_end);
    return 0;
}

/* ---- Dequantization: rounds of more than MAX_M rows rebuild the weight and multiply densely ---- */

/* One row of a group-quantized weight (either layout, as group_gemv reads it) into `out` [K], float32
 * or bfloat16: w = code * scale (+ min) with one rounding to float32 (a fused multiply-add), then
 * one to bfloat16. The product of a code and GGUF's scales is exact in float32, so for GGUF's
 * weights this also equals torch's addcmul(min, code, scale), which rounds the product first. */
#ifdef LANES
/* LANES bytes widened to int32 lanes */
#if defined(__AVX512F__)
#define IVEC __m512i
static inline __m512i widen_u8(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
#define IAND(a, m) _mm512_and_si512(a, _mm512_set1_epi32(m))
#define ISHR(a, b) _mm512_srli_epi32(a, b)
#define ISUB(a, b) _mm512_sub_epi32(a, _mm512_set1_epi32(b))
#define ITOF(a) _mm512_cvtepi32_ps(a)
#define STORE(p, v) _mm512_storeu_ps(p, v)
static inline void store_bf16(uint16_t *p, __m512 v) {
#if defined(__AVX512BF16__)
    _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(v));
#else
    __m512i u = _mm512_castps_si512(v);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(u));
#endif
}
#else
#define IVEC __m256i
static inline __m256i widen_u8(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
#define IAND(a, m) _mm256_and_si256(a, _mm256_set1_epi32(m))
#define ISHR(a, b) _mm256_srli_epi32(a, b)
#define ISUB(a, b) _mm256_sub_epi32(a, _mm256_set1_epi32(b))
#define ITOF(a) _mm256_cvtepi32_ps(a)
#define STORE(p, v) _mm256_storeu_ps(p, v)
static inline void store_bf16(uint16_t *p, __m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1)));
}
#endif

static inline void store_out(void *out, int64_t at, VEC w, int out_bf16) {
    if (out_bf16)
        store_bf16((uint16_t *)out + at, w);
    else
        STORE((float *)out + at, w);
}
#endif

static void dequantize_row(const uint8_t *c, int nibbles, const void *scale, const void *mins, int half,
                           int64_t scale_row, int64_t k, int64_t group, void *out, int out_bf16) {
    int64_t num_groups = k / group;
    float w[256]; /* one group at a time (group <= 256 is checked by the caller) */
    for (int64_t g = 0; g < num_groups; g++) {
        float s = load_scale(scale, scale_row * num_groups + g, half);
        float m = mins ? load_scale(mins, scale_row * num_groups + g, half) : 0.0f;
#ifdef LANES
        if (group % LANES == 0) {
            VEC vs = SET1(s), vm = SET1(m);
            int64_t at = g * group;
            if (nibbles) {
                const uint8_t *cg = c + g * group / 2;
                for (int64_t j = 0; j < group; j += 32)
                    for (int64_t h = 0; h < 16; h += LANES) {
                        IVEC b = widen_u8(cg + j / 2 + h);
                        store_out(out, at + j + h, FMA(ITOF(IAND(b, 0x0F)), vs, vm), out_bf16);
                        store_out(out, at + j + 16 + h, FMA(ITOF(ISHR(b, 4)), vs, vm), out_bf16);
                    }
            } else {
                const int8_t *cg = (const int8_t *)c + g * group;
                for (int64_t j = 0; j < group; j += LANES) {
                    VEC q = widen_i8(cg + j);
                    store_out(out, at + j, mins ? FMA(q, vs, vm) : MUL(q, vs), out_bf16);
                }
            }
            continue;
        }
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

/* Rows of the weight into out [R, K] (float32, or bfloat16 with `out_bf16`): row i of out is weight
 * row rows[i] (a gather, e.g. an embedding) or, with rows NULL, row row_begin + i; i runs over
 * [out_begin, out_end) so that threads can split one call. Returns 0, or -1 for unsupported shapes. */
int group_dequantize(const uint8_t *codes, int nibbles, const void *scale, const void *mins, int half,
                     const int64_t *rows, int64_t row_begin, int64_t out_begin, int64_t out_end, int64_t k,
                     int64_t group, void *out, int out_bf16) {
    if (group < 1 || group > 256 || k % group || (nibbles && group % 32) || out_begin < 0 || out_begin > out_end)
        return -1;
    int64_t row_bytes = nibbles ? k / 2 : k, elem = out_bf16 ? 2 : 4;
    for (int64_t i = out_begin; i < out_end; i++) {
        int64_t r = rows ? rows[i] : row_begin + i;
        dequantize_row(codes + r * row_bytes, nibbles, scale, mins, half, r, k, group, (uint8_t *)out + i * k * elem,
                       out_bf16);
    }
    return 0;
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
    for (int64_t nb = n_begin; nb < n_end; nb += block_n) {
        const uint8_t *block = packed + nb * k / 2;
        for (int64_t kk = k_begin; kk < k_end;) {
            int64_t g = kk / group, stop = (g + 1) * group < k_end ? (g + 1) * group : k_end;
            const uint16_t *sz = scales_zeros + (g * n + nb) * 2;
            for (int64_t j = 0; j < block_n; j++) {
                s[j] = bf16_to_float(sz[2 * j]);
                z[j] = bf16_to_float(sz[2 * j + 1]);
            }
            for (; kk < stop; kk++) {
                const uint8_t *b = block + kk * half_n;
                uint16_t *o = out + kk * ld + (nb - n_begin);
#ifdef LANES
                if (half_n % LANES == 0) {
                    for (int64_t j = 0; j < half_n; j += LANES) {
                        IVEC q = widen_u8(b + j);
                        store_bf16(o + j, FMA(ITOF(ISUB(IAND(q, 0x0F), 8)), LOAD(s + j), LOAD(z + j)));
                        store_bf16(o + half_n + j, FMA(ITOF(ISUB(ISHR(q, 4), 8)), LOAD(s + half_n + j), LOAD(z + half_n + j)));
                    }
                    continue;
                }
#endif
                for (int64_t j = 0; j < half_n; j++) {
                    o[j] = float_to_bf16(fmaf((float)((b[j] & 0x0F) - 8), s[j], z[j]));
                    o[half_n + j] = float_to_bf16(fmaf((float)((b[j] >> 4) - 8), s[half_n + j], z[half_n + j]));
                }
            }
        }
    }
    return 0;
}

/* The vectors the library was built for: 512, 256 (bits) or 0 (scalar). */
int group_gemv_width(void) {
#ifdef LANES
    return LANES * 32;
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
#ifdef CB_LANES
    return 4 * CB_LANES;
#else
    return 0;
#endif
}
