/* GGUF's 4- and 8-bit weights in row blocks ("code blocks") with their exact scales: the GEMV (a
 * few rows of x), the GEMM (more rows) and the row gather, shared by group_gemv.c and llama_decode.c.
 *
 * Layout, per block of `block_n` output rows, per column k:
 *   bits 4: block_n / 2 bytes, byte j holding row j in its low and row block_n / 2 + j in its high
 *           nibble (ATen's int4pack code order), codes 0..15 as GGUF stores them;
 *   bits 8: block_n signed bytes, byte j row j (GGUF's Q8_0 codes, Q6_K's 6-bit ones as -32..31).
 * Scale and min [G, N] (group-major: one group's scales of a block are contiguous), float16
 * (`half`) or float32, min optional (NULL); w = scale * q + min.
 *
 * Against GGUF's own order (a row's codes together), one column's codes of a block are one
 * vector load for many rows: a column's x is broadcast once, a group's scales are
 * applied with one vector multiply-add per lane block, and no row ends in a horizontal sum
 * (SmolLM2's projections at one row, float32, one thread: 8.2 -> 5.5 ms a token).
 *
 * Vector loops run for block_n == 4 * SIMD_LANES (64 with AVX-512, 32 with AVX2 + FMA), scalar
 * loops for any other even block_n. Float32 sums with fused multiply-adds. */
#ifndef MOEMESH_CODE_BLOCKS_H
#define MOEMESH_CODE_BLOCKS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

/* the entry points: static in each including file, which may use only some of them */
#define CB_API static __attribute__((unused))

/* count scales from p[at...] (float16 or float32) into dst as float32 */
static inline void cb_scales(const void *p, int64_t at, int half, float *dst, int64_t count) {
    if (!half) {
        memcpy(dst, (const float *)p + at, (size_t)count * sizeof(float));
        return;
    }
    const uint16_t *h = (const uint16_t *)p + at;
    int64_t j = 0;
#ifdef SIMD_HAS_HALF
    for (; j + SIMD_LANES <= count; j += SIMD_LANES) simd_store(dst + j, simd_load_half(h + j));
#endif
    for (; j < count; j++) dst[j] = half_to_float(h[j]);
}

/* the shapes every entry point checks: 0 if usable */
static inline int cb_check(int bits, int64_t n, int64_t k, int64_t group, int64_t block_n) {
    return (bits == 4 || bits == 8) && block_n >= 2 && block_n <= 256 && block_n % 2 == 0 && n % block_n == 0 &&
                   group >= 1 && group <= 256 && k % group == 0 && k % 2 == 0
               ? 0
               : -1;
}

/* the codes of the block of rows at nb, and the bytes from one column to the next */
static inline const uint8_t *cb_block(const uint8_t *packed, int bits, int64_t k, int64_t nb) {
    return packed + nb * k * bits / 8;
}
static inline int64_t cb_column_bytes(int bits, int64_t block_n) { return block_n * bits / 8; }

/* code j (< block_n) of one column of a block */
static inline float cb_code(const uint8_t *column, int bits, int64_t j, int64_t block_n) {
    if (bits == 8) return (float)((const int8_t *)column)[j];
    return (float)(j < block_n / 2 ? column[j] & 0x0F : column[j - block_n / 2] >> 4);
}

#ifdef SIMD_LANES
/* the 4 vectors of weights codes of one column of a block of 4 * SIMD_LANES rows, rows
 * i * SIMD_LANES ..; `bits` a constant where inlined */
static inline __attribute__((always_inline)) void cb_column(const uint8_t *b, const int bits, simd_f32 w[4]) {
    if (bits == 8) {
        for (int i = 0; i < 4; i++) w[i] = simd_load_i8((const int8_t *)(b + i * SIMD_LANES));
        return;
    }
    simd_i32 b0 = simd_load_u8(b), b1 = simd_load_u8(b + SIMD_LANES);
    w[0] = simd_low_nibbles(b0, 0), w[1] = simd_low_nibbles(b1, 0);
    w[2] = simd_high_nibbles(b0, 0), w[3] = simd_high_nibbles(b1, 0);
}

/* cb_gemv_block's vector loop for blocks of 4 * SIMD_LANES rows, `bits` a constant where inlined */
static inline __attribute__((always_inline)) void cb_gemv_block_vector(const uint8_t *block, const int bits,
                                                                       const void *scale, const void *mins, int half,
                                                                       int64_t n, int64_t k, int64_t group,
                                                                       const float *x, const float *xsum, float *y,
                                                                       int64_t nb) {
    const int64_t block_n = 4 * SIMD_LANES, stride = cb_column_bytes(bits, block_n);
    float s[4 * SIMD_LANES], m[4 * SIMD_LANES];
    simd_f32 acc[4] = {simd_zero(), simd_zero(), simd_zero(), simd_zero()};
    for (int64_t g = 0; g < k / group; g++) {
        /* two columns at a time into two sets of sums: eight independent multiply-add chains */
        simd_f32 p[8];
        for (int i = 0; i < 8; i++) p[i] = simd_zero();
        simd_f32 w0[4], w1[4];
        int64_t kk = g * group, stop = kk + group;
        for (; kk + 1 < stop; kk += 2) {
            const uint8_t *b = block + kk * stride;
            simd_f32 x0 = simd_set1(x[kk]), x1 = simd_set1(x[kk + 1]);
            cb_column(b, bits, w0);
            cb_column(b + stride, bits, w1);
            for (int i = 0; i < 4; i++) {
                p[i] = simd_fma(x0, w0[i], p[i]);
                p[i + 4] = simd_fma(x1, w1[i], p[i + 4]);
            }
        }
        if (kk < stop) { /* an odd group */
            simd_f32 x0 = simd_set1(x[kk]);
            cb_column(block + kk * stride, bits, w0);
            for (int i = 0; i < 4; i++) p[i] = simd_fma(x0, w0[i], p[i]);
        }
        cb_scales(scale, g * n + nb, half, s, block_n);
        if (mins) cb_scales(mins, g * n + nb, half, m, block_n);
        simd_f32 xs = simd_set1(mins ? xsum[g] : 0.0f);
        for (int i = 0; i < 4; i++) {
            acc[i] = simd_fma(simd_load(s + i * SIMD_LANES), simd_add(p[i], p[i + 4]), acc[i]);
            if (mins) acc[i] = simd_fma(simd_load(m + i * SIMD_LANES), xs, acc[i]);
        }
    }
    for (int i = 0; i < 4; i++) simd_store(y + nb + i * SIMD_LANES, acc[i]);
}
#endif

/* y[nb + j] for the block of rows at nb (j < block_n): one row of x; xsum [K / group] its group sums
 * (read only with mins) */
static void cb_gemv_block(const uint8_t *packed, int bits, const void *scale, const void *mins, int half, int64_t n,
                          int64_t k, int64_t group, int64_t block_n, const float *x, const float *xsum, float *y,
                          int64_t nb) {
    const uint8_t *block = cb_block(packed, bits, k, nb);
    int64_t groups = k / group, stride = cb_column_bytes(bits, block_n);
    float s[256], m[256];
#ifdef SIMD_LANES
    if (block_n == 4 * SIMD_LANES) { /* the vector loop, specialized for each width */
        if (bits == 8)
            cb_gemv_block_vector(block, 8, scale, mins, half, n, k, group, x, xsum, y, nb);
        else
            cb_gemv_block_vector(block, 4, scale, mins, half, n, k, group, x, xsum, y, nb);
        return;
    }
#endif
    float acc[256], part[256];
    for (int64_t j = 0; j < block_n; j++) acc[j] = 0.0f;
    for (int64_t g = 0; g < groups; g++) {
        for (int64_t j = 0; j < block_n; j++) part[j] = 0.0f;
        for (int64_t kk = g * group; kk < (g + 1) * group; kk++)
            for (int64_t j = 0; j < block_n; j++) part[j] = fmaf(x[kk], cb_code(block + kk * stride, bits, j, block_n), part[j]);
        cb_scales(scale, g * n + nb, half, s, block_n);
        if (mins) cb_scales(mins, g * n + nb, half, m, block_n);
        for (int64_t j = 0; j < block_n; j++) {
            acc[j] = fmaf(s[j], part[j], acc[j]);
            if (mins) acc[j] = fmaf(m[j], xsum[g], acc[j]);
        }
    }
    for (int64_t j = 0; j < block_n; j++) y[nb + j] = acc[j];
}

/* y = x W^T for rows [begin, end) of y (multiples of block_n), m rows of x ([M, K], y [M, N], xsum
 * [M, K / group]); each block's codes are read from memory once and from cache for the other
 * rows of x. Returns 0, or -1 for shapes it does not take. */
CB_API int cb_gemv(const uint8_t *packed, int bits, const void *scale, const void *mins, int half, const float *x,
                   const float *xsum, float *y, int64_t m, int64_t n, int64_t k, int64_t group, int64_t block_n,
                   int64_t begin, int64_t end) {
    if (cb_check(bits, n, k, group, block_n) || m < 1 || begin < 0 || end > n || begin > end || begin % block_n ||
        end % block_n)
        return -1;
    for (int64_t nb = begin; nb < end; nb += block_n)
        for (int64_t i = 0; i < m; i++)
            cb_gemv_block(packed, bits, scale, mins, half, n, k, group, block_n, x + i * k, xsum + i * (k / group),
                          y + i * n, nb);
    return 0;
}

/* W^T of one block of rows (nb .. nb + block_n) for columns [k_begin, k_end): column kk's block_n
 * weights at out + (kk - k_begin) * ld, float32: w = scale * q + min, one rounding (a fused
 * multiply-add; exactly GGUF's value where scale * q is exact, as for its own scales). `normal`
 * (NULL: not asked) is cleared where the scales could give a subnormal or NaN weight (simd.h's
 * any_unsafe_scale). */
static void cb_dequantize_block(const uint8_t *packed, int bits, const void *scale, const void *mins, int half,
                                int64_t n, int64_t k, int64_t group, int64_t block_n, int64_t nb, int64_t k_begin,
                                int64_t k_end, float *out, int64_t ld, int *normal) {
    const uint8_t *block = cb_block(packed, bits, k, nb);
    int64_t stride = cb_column_bytes(bits, block_n);
    float s[256], m[256];
    for (int64_t kk = k_begin; kk < k_end;) {
        int64_t g = kk / group, stop = (g + 1) * group < k_end ? (g + 1) * group : k_end;
        cb_scales(scale, g * n + nb, half, s, block_n);
        if (mins)
            cb_scales(mins, g * n + nb, half, m, block_n);
        else
            memset(m, 0, (size_t)block_n * sizeof(float));
        if (normal) *normal &= !any_unsafe_scale(s, block_n) && !any_unsafe_scale(m, block_n);
        for (; kk < stop; kk++) {
            const uint8_t *b = block + kk * stride;
            float *o = out + (kk - k_begin) * ld;
#ifdef SIMD_LANES
            if (bits == 8 && block_n % SIMD_LANES == 0) {
                for (int64_t j = 0; j < block_n; j += SIMD_LANES)
                    simd_store(o + j,
                               simd_fma(simd_load_i8((const int8_t *)(b + j)), simd_load(s + j), simd_load(m + j)));
                continue;
            }
            int64_t half_n = block_n / 2;
            if (bits == 4 && half_n % SIMD_LANES == 0) {
                for (int64_t j = 0; j < half_n; j += SIMD_LANES) {
                    simd_i32 q = simd_load_u8(b + j);
                    simd_store(o + j, simd_fma(simd_low_nibbles(q, 0), simd_load(s + j), simd_load(m + j)));
                    simd_store(o + half_n + j,
                               simd_fma(simd_high_nibbles(q, 0), simd_load(s + half_n + j), simd_load(m + half_n + j)));
                }
                continue;
            }
#endif
            for (int64_t j = 0; j < block_n; j++) o[j] = fmaf(cb_code(b, bits, j, block_n), s[j], m[j]);
        }
    }
}

/* ---- y = x W^T for rounds of several rows: each block's W^T rebuilt a slice of columns at a time
 * (CB_KC with 64-row blocks) into a buffer that stays in the core's cache, and multiplied there
 * with every row of x (CB_ROWS rows of x at a time against the block's 4 vectors of outputs:
 * 4 * CB_ROWS sums in registers). No dequantized weight is written to memory, and nothing is
 * packed again by a BLAS (SmolLM2's projections at 64 rows, float32, one thread: 136 against
 * 194 ms for 30 layers of rebuild + MKL). Sums in float32, column by column (k ascending). */
#define CB_KC 128
#ifdef SIMD_LANES
#if SIMD_LANES == 16
#define CB_ROWS 6
#else
#define CB_ROWS 3
#endif

/* rows r < R of y[.., 0 .. 4 * SIMD_LANES) += x[r, 0 .. kc) . panel (set, not added, when `first`) */
#define CB_TILE(R)                                                                                          \
    static inline void cb_tile_##R(const float *x, int64_t ldx, const float *panel, int64_t kc, float *y,    \
                                   int64_t ldy, int first) {                                                \
        simd_f32 acc[R][4];                                                                                 \
        for (int r = 0; r < R; r++)                                                                         \
            for (int j = 0; j < 4; j++) acc[r][j] = first ? simd_zero() : simd_load(y + r * ldy + j * SIMD_LANES); \
        for (int64_t kk = 0; kk < kc; kk++) {                                                               \
            const float *p = panel + kk * 4 * SIMD_LANES;                                                   \
            simd_f32 w[4];                                                                                  \
            for (int j = 0; j < 4; j++) w[j] = simd_load(p + j * SIMD_LANES);                               \
            for (int r = 0; r < R; r++) { /* one broadcast register: 4 * R sums + 5 fit the 32 (16) registers */ \
                simd_f32 xr = simd_set1(x[r * ldx + kk]);                                                   \
                for (int j = 0; j < 4; j++) acc[r][j] = simd_fma(xr, w[j], acc[r][j]);                      \
            }                                                                                               \
        }                                                                                                   \
        for (int r = 0; r < R; r++)                                                                         \
            for (int j = 0; j < 4; j++) simd_store(y + r * ldy + j * SIMD_LANES, acc[r][j]);                \
    }
CB_TILE(1)
CB_TILE(2)
CB_TILE(3)
#if CB_ROWS == 6
CB_TILE(4)
CB_TILE(5)
CB_TILE(6)
#endif

static inline void cb_tile(int rows, const float *x, int64_t ldx, const float *panel, int64_t kc, float *y,
                           int64_t ldy, int first) {
    switch (rows) {
    case 1: cb_tile_1(x, ldx, panel, kc, y, ldy, first); break;
    case 2: cb_tile_2(x, ldx, panel, kc, y, ldy, first); break;
    case 3: cb_tile_3(x, ldx, panel, kc, y, ldy, first); break;
#if CB_ROWS == 6
    case 4: cb_tile_4(x, ldx, panel, kc, y, ldy, first); break;
    case 5: cb_tile_5(x, ldx, panel, kc, y, ldy, first); break;
    case 6: cb_tile_6(x, ldx, panel, kc, y, ldy, first); break;
#endif
    }
}

#endif

/* y [M, N] = x [M, K] W^T for rows [begin, end) of W (multiples of block_n): the vector tiles for
 * block_n = 4 * SIMD_LANES, a scalar loop over the same panels otherwise. Returns 0, or -1 for
 * shapes it does not take. */
CB_API int cb_gemm(const uint8_t *packed, int bits, const void *scale, const void *mins, int half, const float *x,
                   float *y, int64_t m, int64_t n, int64_t k, int64_t group, int64_t block_n, int64_t begin,
                   int64_t end) {
    if (cb_check(bits, n, k, group, block_n) || m < 1 || begin < 0 || end > n || begin > end || begin % block_n ||
        end % block_n)
        return -1;
    float panel[CB_KC * 64] __attribute__((aligned(64))); /* columns of one block: CB_KC with 64 rows */
    int64_t kc_max = CB_KC * 64 / block_n;
#ifdef SIMD_LANES
    int vector = block_n == 4 * SIMD_LANES;
#else
    int vector = 0;
#endif
    for (int64_t nb = begin; nb < end; nb += block_n)
        for (int64_t k0 = 0; k0 < k; k0 += kc_max) {
            int64_t kc = k - k0 < kc_max ? k - k0 : kc_max;
            cb_dequantize_block(packed, bits, scale, mins, half, n, k, group, block_n, nb, k0, k0 + kc, panel, block_n,
                                NULL);
#ifdef SIMD_LANES
            if (vector) {
                for (int64_t i = 0; i < m; i += CB_ROWS) {
                    int rows = m - i < CB_ROWS ? (int)(m - i) : CB_ROWS;
                    cb_tile(rows, x + i * k + k0, k, panel, kc, y + i * n + nb, n, k0 == 0);
                }
                continue;
            }
#endif
            (void)vector;
            for (int64_t i = 0; i < m; i++) {
                float *yi = y + i * n + nb;
                if (k0 == 0) memset(yi, 0, (size_t)block_n * sizeof(float));
                for (int64_t kk = 0; kk < kc; kk++)
                    for (int64_t j = 0; j < block_n; j++) yi[j] = fmaf(x[i * k + k0 + kk], panel[kk * block_n + j], yi[j]);
            }
        }
    return 0;
}

/* ---- The GEMM for bfloat16 x with AVX512-BF16: the same panels, rounded to bfloat16 (as a
 * bfloat16 copy of the weight would be) and interleaved in column pairs, multiplied with
 * vdpbf16ps (two products per float32 lane and instruction: twice the float32 tile's rate) into
 * float32 sums. */
#if defined(__AVX512BF16__) && defined(SIMD_LANES) && SIMD_LANES == 16
#define CB_BF16_GEMM 1

/* lane j: bf16(lo[j]) in the low half, bf16(hi[j]) in the high half (simd.h's rounding; `normal`:
 * no lane is subnormal or NaN) */
static inline __m512i cb_bf16_pairs(__m512 lo, __m512 hi, int normal) {
    __m512i low = normal ? simd_bf16_bits_normal(lo) : simd_bf16_bits(lo);
    __m512i high = normal ? simd_bf16_bits_normal(hi) : simd_bf16_bits(hi);
    return _mm512_or_si512(low, _mm512_slli_epi32(high, 16));
}

/* rows r < R of y[.., 0 .. 64) += x[r, 0 .. 2 * pairs) . panel (set when `first`); x bfloat16 */
#define CB_TILE_BF16(R)                                                                                             \
    static inline void cb_tile_bf16_##R(const uint16_t *x, int64_t ldx, const __m512i *panel, int64_t pairs,       \
                                        float *y, int64_t ldy, int first) {                                         \
        __m512 acc[R][4];                                                                                           \
        for (int r = 0; r < R; r++)                                                                                 \
            for (int j = 0; j < 4; j++) acc[r][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(y + r * ldy + j * 16); \
        for (int64_t p = 0; p < pairs; p++) {                                                                       \
            __m512bh w[4];                                                                                          \
            for (int j = 0; j < 4; j++) w[j] = (__m512bh)_mm512_load_si512(panel + p * 4 + j);                     \
            for (int r = 0; r < R; r++) { /* one broadcast register: 24 sums + 5 fit the 32 registers */             \
                uint32_t pair;                                                                                      \
                memcpy(&pair, x + r * ldx + 2 * p, sizeof pair);                                                    \
                __m512bh xr = (__m512bh)_mm512_set1_epi32((int)pair);                                               \
                for (int j = 0; j < 4; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xr, w[j]);                      \
            }                                                                                                       \
        }                                                                                                           \
        for (int r = 0; r < R; r++)                                                                                 \
            for (int j = 0; j < 4; j++) _mm512_storeu_ps(y + r * ldy + j * 16, acc[r][j]);                          \
    }
CB_TILE_BF16(1)
CB_TILE_BF16(2)
CB_TILE_BF16(3)
CB_TILE_BF16(4)
CB_TILE_BF16(5)
CB_TILE_BF16(6)

static inline void cb_tile_bf16(int rows, const uint16_t *x, int64_t ldx, const __m512i *panel, int64_t pairs,
                                float *y, int64_t ldy, int first) {
    switch (rows) {
    case 1: cb_tile_bf16_1(x, ldx, panel, pairs, y, ldy, first); break;
    case 2: cb_tile_bf16_2(x, ldx, panel, pairs, y, ldy, first); break;
    case 3: cb_tile_bf16_3(x, ldx, panel, pairs, y, ldy, first); break;
    case 4: cb_tile_bf16_4(x, ldx, panel, pairs, y, ldy, first); break;
    case 5: cb_tile_bf16_5(x, ldx, panel, pairs, y, ldy, first); break;
    case 6: cb_tile_bf16_6(x, ldx, panel, pairs, y, ldy, first); break;
    }
}
#endif

/* y [M, N] float32 = x [M, K] bfloat16 W^T, W rounded to bfloat16, for rows [begin, end) of W.
 * Returns 0, or -1 without AVX512-BF16, for blocks of other than 64 rows, an odd K, or shapes it
 * does not take. */
CB_API int cb_gemm_bf16(const uint8_t *packed, int bits, const void *scale, const void *mins, int half,
                        const uint16_t *x, float *y, int64_t m, int64_t n, int64_t k, int64_t group, int64_t block_n,
                        int64_t begin, int64_t end) {
#ifdef CB_BF16_GEMM
    if (cb_check(bits, n, k, group, block_n) || block_n != 64 || k % 2 || m < 1 || begin < 0 || end > n ||
        begin > end || begin % block_n || end % block_n)
        return -1;
    float weights[CB_KC * 64] __attribute__((aligned(64)));
    __m512i panel[CB_KC / 2 * 4];
    for (int64_t nb = begin; nb < end; nb += block_n)
        for (int64_t k0 = 0; k0 < k; k0 += CB_KC) {
            int64_t kc = k - k0 < CB_KC ? k - k0 : CB_KC; /* even: k and CB_KC are */
            int normal = 1;
            cb_dequantize_block(packed, bits, scale, mins, half, n, k, group, block_n, nb, k0, k0 + kc, weights, 64,
                                &normal);
            for (int64_t p = 0; p < kc / 2; p++)
                for (int j = 0; j < 4; j++)
                    panel[p * 4 + j] = cb_bf16_pairs(_mm512_load_ps(weights + 2 * p * 64 + j * 16),
                                                     _mm512_load_ps(weights + (2 * p + 1) * 64 + j * 16), normal);
            for (int64_t i = 0; i < m; i += 6) {
                int rows = m - i < 6 ? (int)(m - i) : 6;
                cb_tile_bf16(rows, x + i * k + k0, k, panel, kc / 2, y + i * n + nb, n, k0 == 0);
            }
        }
    return 0;
#else
    (void)packed, (void)bits, (void)scale, (void)mins, (void)half, (void)x, (void)y, (void)m, (void)n, (void)k;
    (void)group, (void)block_n, (void)begin, (void)end;
    return -1;
#endif
}

/* Rows of W into out [R, K] float32: row i of out is W's row rows[i] (a gather, e.g. an embedding)
 * or, with rows NULL, row row_begin + i; i runs over [out_begin, out_end). The same values as
 * cb_dequantize_block. Returns 0, or -1 for shapes or rows it does not take. */
CB_API int cb_gather(const uint8_t *packed, int bits, const void *scale, const void *mins, int half, int64_t n,
                     int64_t k, int64_t group, int64_t block_n, const int64_t *rows, int64_t row_begin,
                     int64_t out_begin, int64_t out_end, float *out) {
    if (cb_check(bits, n, k, group, block_n) || out_begin < 0 || out_begin > out_end) return -1;
    int64_t groups = k / group, stride = cb_column_bytes(bits, block_n);
    for (int64_t i = out_begin; i < out_end; i++) {
        int64_t r = rows ? rows[i] : row_begin + i;
        if (r < 0 || r >= n) return -1;
        const uint8_t *block = cb_block(packed, bits, k, r - r % block_n);
        float *o = out + i * k;
        for (int64_t g = 0; g < groups; g++) {
            float sg, mg = 0.0f;
            cb_scales(scale, g * n + r, half, &sg, 1);
            if (mins) cb_scales(mins, g * n + r, half, &mg, 1);
            for (int64_t kk = g * group; kk < (g + 1) * group; kk++)
                o[kk] = fmaf(cb_code(block + kk * stride, bits, r % block_n, block_n), sg, mg);
        }
    }
    return 0;
}

#endif
