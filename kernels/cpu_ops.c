/* The decoder's small per-token operations on the CPU, one call each instead of a chain of torch
 * ops (kernels/cpu_ops.py loads it; kernels/dispatch.py calls it for float32 / bfloat16 CPU
 * tensors). At a decode round of one request each torch op costs a few microseconds of dispatch
 * for a few hundred elements of work; these run the whole operation in that time.
 *
 * Each computes what its torch reference (kernels/norm.py, rotary.py, kv_store.py) computes, in
 * float32, rounding to bfloat16 (nearest even) where the reference does:
 *   rms_norm:  [s = x + residual, rounded;] y = s * (1 / sqrt(mean(s^2) + eps)), rounded; y * weight, rounded;
 *   rope_neox: x1 * cos - x2 * sin and x2 * cos + x1 * sin, each product and sum rounded to float32
 *              (built with -ffp-contract=off: no fused multiply-adds), then to the dtype: the same
 *              bits as the reference;
 *   store_kv:  K and V rows copied to their slots; negative slots are skipped;
 *   paged_decode_attention: one query token per request over the paged cache, softmax in float32;
 *   paged_prefill_attention: each new token over its request's cached prefix and itself, alike;
 *   int4_llama_decode_token: one token through a whole Llama stack with 4-bit weights (below).
 * `bf16` selects the element type of every tensor argument of a call: 1 bfloat16, 0 float32.
 * Functions return 0, or -1 for an index out of range (the caller raises); a refused call has
 * written nothing into a tensor it was given to update (a KV cache).
 */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "c_parts.h"
#include "code_blocks.h"
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__)) || defined(__F16C__)
#include <immintrin.h>
#endif

/* n elements from p + at into float32 dst: one loop per dtype, so that each vectorizes */
static inline void load_row(const void *p, int64_t at, float *dst, int64_t n, int bf16) {
    if (bf16) {
        const uint16_t *src = (const uint16_t *)p + at;
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_float(src[i]);
    } else {
        memcpy(dst, (const float *)p + at, (size_t)n * sizeof(float));
    }
}

/* n float32 values into p + at in the dtype, rounded */
static inline void store_row(void *p, int64_t at, const float *src, int64_t n, int bf16) {
    if (bf16) {
        uint16_t *dst = (uint16_t *)p + at;
        for (int64_t i = 0; i < n; i++) dst[i] = float_to_bf16(src[i]);
    } else {
        memcpy((float *)p + at, src, (size_t)n * sizeof(float));
    }
}

/* values rounded to the dtype, kept in float32 */
static inline void round_row(float *v, int64_t n, int bf16) {
    if (bf16)
        for (int64_t i = 0; i < n; i++) v[i] = bf16_to_float(float_to_bf16(v[i]));
}

/* Vectors for the GEMVs and attention: AVX-512 (16 float lanes) or AVX2 + FMA (8); without either
 * GV_LANES is undefined and the scalar loops run. */
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#if defined(__AVX512F__)
#define GV_LANES 16
#define GV __m512
#define GV_ZERO() _mm512_setzero_ps()
#define GV_SET1(v) _mm512_set1_ps(v)
#define GV_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define GV_SUB(a, b) _mm512_sub_ps(a, b)
#define GV_ADD(a, b) _mm512_add_ps(a, b)
/* a vector's 16 lanes summed down to 4 (lane l: the sum of lanes l, l + 4, ...) */
static inline __m128 GV_FOLD4(__m512 v) {
    __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), high);
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}
#define GV_STORE(p, v) _mm512_storeu_ps(p, v)
#define GV_LOAD(p) _mm512_loadu_ps(p)
#define GV_HSUM(v) _mm512_reduce_add_ps(v)
#define GVI __m512i
#define GV_BYTES(p) _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p)))
/* codes to floats through a table of 0..15: the permute reads the low 4 bits of each lane */
#define GV_CODES _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
#define GV_LOW(b) _mm512_permutexvar_ps(b, GV_CODES)
#define GV_HIGH(b) _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), GV_CODES)
#define GV_PAIRS(p) _mm512_loadu_si512((const void *)(p))
#define GV_SCALE(u) _mm512_castsi512_ps(_mm512_slli_epi32(u, 16))
#define GV_ZERO_OF(u) _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32((int)0xFFFF0000u)))
#define GV_LOAD_BF16(p) \
    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#else
#define GV_LANES 8
#define GV __m256
#define GV_ZERO() _mm256_setzero_ps()
#define GV_SET1(v) _mm256_set1_ps(v)
#define GV_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define GV_SUB(a, b) _mm256_sub_ps(a, b)
#define GV_ADD(a, b) _mm256_add_ps(a, b)
static inline __m128 GV_FOLD4(__m256 v) { return _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)); }
#define GV_STORE(p, v) _mm256_storeu_ps(p, v)
#define GV_LOAD(p) _mm256_loadu_ps(p)
static inline float GV_HSUM(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#define GVI __m256i
#define GV_BYTES(p) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define GV_LOW(b) _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(0x0F)))
#define GV_HIGH(b) _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4))
#define GV_PAIRS(p) _mm256_loadu_si256((const __m256i *)(p))
#define GV_SCALE(u) _mm256_castsi256_ps(_mm256_slli_epi32(u, 16))
#define GV_ZERO_OF(u) _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32((int)0xFFFF0000u)))
#define GV_LOAD_BF16(p) \
    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#endif
#endif

#ifdef GV_LANES
/* the horizontal sums of four vectors: lane i of the result is vector i's (each folded to 4 lanes,
 * then two rounds of pairwise adds) */
static inline __m128 gv_sums4(GV a, GV b, GV c, GV d) {
    return _mm_hadd_ps(_mm_hadd_ps(GV_FOLD4(a), GV_FOLD4(b)), _mm_hadd_ps(GV_FOLD4(c), GV_FOLD4(d)));
}
#endif

#define ACC 16 /* independent partial sums: the compiler vectorizes them without reassociating */

/* the partial sums added pairwise (4 dependent adds, not 16) */
static inline float sum_parts(float *part) {
    for (int w = ACC / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++) part[l] += part[l + w];
    return part[0];
}

/* a . b in float32: ACC partial sums, then the tail */
static inline float dot(const float *a, const float *b, int64_t n) {
    float part[ACC] = {0}, tail = 0.0f;
    int64_t j = 0;
    for (; j + ACC <= n; j += ACC)
        for (int l = 0; l < ACC; l++) part[l] += a[j + l] * b[j + l];
    for (; j < n; j++) tail += a[j] * b[j];
    return tail + sum_parts(part);
}

/* exp(x) for the softmax's x <= 0, in arithmetic the compiler vectorizes: x = n ln2 + r with n
 * rounded to nearest (the 1.5 * 2^23 trick) and ln2 split in two (Cody-Waite), exp(r) on
 * |r| <= ln2 / 2 by its degree-6 Taylor polynomial (relative error < 2e-7), times 2^n built in
 * the exponent bits. Below -87 the result is exp(-87) ~ 1.6e-38, a zero to the softmax. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* out = s * (1 / sqrt(mean(s^2) + eps)), rounded to the dtype, times w, rounded */
static void norm_row(const float *s, const float *w, int64_t n, float eps, int bf16, float *out) {
    float inv = 1.0f / sqrtf(dot(s, s, n) / (float)n + eps);
    for (int64_t j = 0; j < n; j++) out[j] = s[j] * inv;
    round_row(out, n, bf16);
    for (int64_t j = 0; j < n; j++) out[j] *= w[j];
    round_row(out, n, bf16);
}

/* rows of x [rows, hidden] (row stride x_stride), residual NULL or like x (row stride res_stride);
 * out and summed (written when residual is given) contiguous [rows, hidden]. hidden <= 16384. */
int rms_norm(const void *x, int64_t x_stride, const void *residual, int64_t res_stride, const void *weight,
             void *out, void *summed, int64_t rows, int64_t hidden, float eps, int bf16) {
    if (hidden < 1 || hidden > 16384) return -1;
    float s[16384], other[16384], w[16384];
    load_row(weight, 0, w, hidden, bf16);
    for (int64_t r = 0; r < rows; r++) {
        load_row(x, r * x_stride, s, hidden, bf16);
        if (residual) {
            load_row(residual, r * res_stride, other, hidden, bf16);
            for (int64_t j = 0; j < hidden; j++) s[j] += other[j];
            round_row(s, hidden, bf16);
            store_row(summed, r * hidden, s, hidden, bf16);
        }
        norm_row(s, w, hidden, eps, bf16, other);
        store_row(out, r * hidden, other, hidden, bf16);
    }
    return 0;
}

/* NeoX rotary of `heads` heads of one token, float32 in and out: the first rotary_dim of each head
 * rotate as two halves (x1 * cos - x2 * sin, x2 * cos + x1 * sin, each product and sum rounded
 * to float32), the rest are copied. cos, sin: rotary_dim / 2 values each. */
static void rope_row(const float *x, float *out, int64_t heads, int64_t head_dim, int64_t rotary_dim,
                     const float *cos, const float *sin) {
    int64_t half = rotary_dim / 2;
    for (int64_t h = 0; h < heads; h++) {
        const float *xh = x + h * head_dim;
        float *oh = out + h * head_dim;
        for (int64_t i = 0; i < half; i++) {
            float a = xh[i] * cos[i], b = xh[half + i] * sin[i], c = xh[half + i] * cos[i], d = xh[i] * sin[i];
            oh[i] = a - b;
            oh[half + i] = c + d;
        }
        for (int64_t i = rotary_dim; i < head_dim; i++) oh[i] = xh[i];
    }
}

/* NeoX-style rotary embedding of x [tokens, heads, head_dim] (token stride x_stride, heads
 * contiguous) into out, alike (token stride out_stride), by rope_row. cos_sin [max_position,
 * rotary_dim] float32 (cos | sin). heads * head_dim <= 16384. */
int rope_neox(const void *x, int64_t x_stride, const int64_t *positions, const float *cos_sin,
              int64_t max_position, void *out, int64_t out_stride, int64_t tokens, int64_t heads, int64_t head_dim,
              int64_t rotary_dim, int bf16) {
    int64_t width = heads * head_dim;
    if (rotary_dim % 2 || rotary_dim > head_dim || width > 16384) return -1;
    float in[16384], rotated[16384];
    for (int64_t t = 0; t < tokens; t++) {
        int64_t pos = positions[t];
        if (pos < 0 || pos >= max_position) return -1;
        const float *cos = cos_sin + pos * rotary_dim;
        load_row(x, t * x_stride, in, width, bf16);
        rope_row(in, rotated, heads, head_dim, rotary_dim, cos, cos + rotary_dim / 2);
        store_row(out, t * out_stride, rotated, width, bf16);
    }
    return 0;
}

/* key and value [tokens, row] (token strides k_stride, v_stride; each row contiguous, row =
 * kv_heads * head_dim elements) into k_cache / v_cache viewed as [num_slots, row]. */
int store_kv(const void *key, int64_t k_stride, const void *value, int64_t v_stride, void *k_cache, void *v_cache,
             const int64_t *slots, int64_t tokens, int64_t row, int64_t num_slots, int bf16) {
    size_t size = bf16 ? 2 : 4, bytes = (size_t)row * size;
    for (int64_t t = 0; t < tokens; t++)
        if (slots[t] >= num_slots) return -1;
    for (int64_t t = 0; t < tokens; t++) {
        int64_t slot = slots[t];
        if (slot < 0) continue;
        memcpy((char *)k_cache + slot * bytes, (const char *)key + t * k_stride * size, bytes);
        memcpy((char *)v_cache + slot * bytes, (const char *)value + t * v_stride * size, bytes);
    }
    return 0;
}

/* Tokens [0, len) of a request through its block table, a block at a time (no division per
 * token): the body (the macro's last argument) runs with `t` and `at`, the element where token t's
 * row starts in the cache. */
#define FOR_EACH_TOKEN(table, len, block_size, row, ...)                                                        \
    for (int64_t t0_ = 0; t0_ < (len); t0_ += (block_size)) {                                                   \
        int64_t base_ = (int64_t)(table)[t0_ / (block_size)] * (block_size) * (row);                            \
        int64_t n_ = (len) - t0_ < (block_size) ? (len) - t0_ : (block_size);                                   \
        for (int64_t j_ = 0; j_ < n_; j_++) {                                                                   \
            int64_t t = t0_ + j_, at = base_ + j_ * (row);                                                      \
            __VA_ARGS__                                                                                         \
        }                                                                                                       \
    }

/* The K and V cache lines of a request, requested into L2 a few at a time while another request
 * computes: a paged cache is read block by block from scattered places, which the hardware
 * prefetchers do not foresee, and a burst of hundreds of prefetches stalls the core until the
 * memory system can take them. `per_step` pairs of lines go out at each step (a 4-token chunk of
 * scores, a token of the weighted sums), sized so that the request is covered in about one
 * request's steps. */
typedef struct {
    const char *k, *v;
    const int32_t *table;
    int64_t len, block_size, row_bytes, t0, byte, per_step;
} Prefetcher;

static void prefetcher_start(Prefetcher *p, const void *k_cache, const void *v_cache, const int32_t *table,
                             int64_t len, int64_t block_size, int64_t row_bytes, int64_t steps) {
    *p = (Prefetcher){k_cache, v_cache, table, len, block_size, row_bytes, 0, 0, 0};
    int64_t lines = (len * row_bytes + 63) / 64;
    p->per_step = steps > 0 ? (lines + steps - 1) / steps : lines;
}

static inline void prefetch_some(Prefetcher *p) {
    if (!p) return;
    for (int64_t i = 0; i < p->per_step && p->t0 < p->len; i++) {
        int64_t n = p->len - p->t0 < p->block_size ? p->len - p->t0 : p->block_size;
        int64_t at = (int64_t)p->table[p->t0 / p->block_size] * p->block_size * p->row_bytes + p->byte;
        __builtin_prefetch(p->k + at, 0, 2);
        __builtin_prefetch(p->v + at, 0, 2);
        p->byte += 64;
        if (p->byte >= n * p->row_bytes) p->byte = 0, p->t0 += p->block_size;
    }
}

#ifdef GV_LANES
#define GV_ROW(cache, at, bf16) \
    ((bf16) ? GV_LOAD_BF16((const uint16_t *)(cache) + (at)) : GV_LOAD((const float *)(cache) + (at)))

/* scores[i, t] = scale * q_i . k_t for a group's heads (qf [group, D] float32), then the weighted
 * V sums acc[i] = sum_t p[i, t] v_t, D a multiple of GV_LANES: K and V rows are read in place from
 * the cache (bf16 widened in registers). `bf16` is a constant at each call, so each dtype gets its
 * own loops. */
static inline __attribute__((always_inline)) void group_scores_vector(const float *qf, const void *cache,
                                                                      const int32_t *table, int64_t len,
                                                                      int64_t block_size, int64_t row, int64_t off,
                                                                      int64_t group, int64_t D, float scale,
                                                                      float *scores, Prefetcher *pf, const int bf16) {
    float kf[4 * 1024]; /* four bf16 K rows widened once for the group's heads */
    const __m128 scale4 = _mm_set1_ps(scale);
    for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        int64_t base = (int64_t)table[t0 / block_size] * block_size * row + off;
        int64_t n = len - t0 < block_size ? len - t0 : block_size;
        for (int64_t j = 0; j < n; j += 4) {
            int64_t m = n - j < 4 ? n - j : 4; /* tokens t0 + j .. + m - 1; missing ones read token 0 of them */
            prefetch_some(pf);
            const float *k[4];
            for (int64_t u = 0; u < 4; u++) {
                int64_t at = base + (j + (u < m ? u : 0)) * row;
                if (bf16) {
                    for (int64_t c = 0; c < D; c += GV_LANES)
                        GV_STORE(kf + u * D + c, GV_LOAD_BF16((const uint16_t *)cache + at + c));
                    k[u] = kf + u * D;
                } else {
                    k[u] = (const float *)cache + at;
                }
            }
            for (int64_t i = 0; i < group; i++) {
                const float *qi = qf + i * D;
                GV a0 = GV_ZERO(), a1 = GV_ZERO(), a2 = GV_ZERO(), a3 = GV_ZERO();
                for (int64_t c = 0; c < D; c += GV_LANES) {
                    GV qv = GV_LOAD(qi + c);
                    a0 = GV_FMA(qv, GV_LOAD(k[0] + c), a0);
                    a1 = GV_FMA(qv, GV_LOAD(k[1] + c), a1);
                    a2 = GV_FMA(qv, GV_LOAD(k[2] + c), a2);
                    a3 = GV_FMA(qv, GV_LOAD(k[3] + c), a3);
                }
                float four[4];
                _mm_storeu_ps(four, _mm_mul_ps(gv_sums4(a0, a1, a2, a3), scale4));
                for (int64_t u = 0; u < m; u++) scores[i * len + t0 + j + u] = four[u];
            }
        }
    }
}

static inline __attribute__((always_inline)) void group_values_vector(const float *scores, const void *cache,
                                                                      const int32_t *table, int64_t len,
                                                                      int64_t block_size, int64_t row, int64_t off,
                                                                      int64_t group, int64_t D, float *acc,
                                                                      Prefetcher *pf, const int bf16) {
    for (int64_t c = 0; c < D; c += 2 * GV_LANES) { /* two lane blocks, up to four heads: 8 chains */
        int two = c + GV_LANES < D;
        for (int64_t i = 0; i < group; i += 4) {
            int64_t n = group - i < 4 ? group - i : 4;
            GV a0 = GV_ZERO(), a1 = GV_ZERO(), a2 = GV_ZERO(), a3 = GV_ZERO();
            GV b0 = GV_ZERO(), b1 = GV_ZERO(), b2 = GV_ZERO(), b3 = GV_ZERO();
            const float *s = scores + i * len;
            FOR_EACH_TOKEN(table, len, block_size, row, {
                if (c == 0 && i == 0) prefetch_some(pf);
                GV v = GV_ROW(cache, at + off + c, bf16);
                GV w = two ? GV_ROW(cache, at + off + c + GV_LANES, bf16) : v;
                GV p0 = GV_SET1(s[t]);
                a0 = GV_FMA(p0, v, a0);
                b0 = GV_FMA(p0, w, b0);
                if (n > 1) {
                    GV p1 = GV_SET1(s[len + t]);
                    a1 = GV_FMA(p1, v, a1);
                    b1 = GV_FMA(p1, w, b1);
                }
                if (n > 2) {
                    GV p2 = GV_SET1(s[2 * len + t]);
                    a2 = GV_FMA(p2, v, a2);
                    b2 = GV_FMA(p2, w, b2);
                }
                if (n > 3) {
                    GV p3 = GV_SET1(s[3 * len + t]);
                    a3 = GV_FMA(p3, v, a3);
                    b3 = GV_FMA(p3, w, b3);
                }
            })
            GV out_a[4] = {a0, a1, a2, a3}, out_b[4] = {b0, b1, b2, b3};
            for (int64_t h = 0; h < n; h++) {
                GV_STORE(acc + (i + h) * D + c, out_a[h]);
                if (two) GV_STORE(acc + (i + h) * D + c + GV_LANES, out_b[h]);
            }
        }
    }
}
#endif

/* the same for any D, a K or V row at a time through kf */
static void group_scores_scalar(const float *qf, const void *cache, const int32_t *table, int64_t len,
                                int64_t block_size, int64_t row, int64_t off, int64_t group, int64_t D, float scale,
                                float *scores, int bf16) {
    float kf[1024];
    FOR_EACH_TOKEN(table, len, block_size, row, {
        load_row(cache, at + off, kf, D, bf16);
        for (int64_t i = 0; i < group; i++) scores[i * len + t] = dot(qf + i * D, kf, D) * scale;
    })
}

static void group_values_scalar(const float *scores, const void *cache, const int32_t *table, int64_t len,
                                int64_t block_size, int64_t row, int64_t off, int64_t group, int64_t D, float *acc,
                                int bf16) {
    float vf[1024];
    for (int64_t i = 0; i < group * D; i++) acc[i] = 0.0f;
    FOR_EACH_TOKEN(table, len, block_size, row, {
        load_row(cache, at + off, vf, D, bf16);
        for (int64_t i = 0; i < group; i++) {
            float p = scores[i * len + t], *a = acc + i * D;
            for (int64_t j = 0; j < D; j++) a[j] += p * vf[j];
        }
    })
}

/* softmax numerators of one row of scores in place (kept unnormalized); returns their sum */
static float softmax_numerators(float *s, int64_t len) {
    float m = -INFINITY, sum = 0.0f, part[ACC];
    for (int l = 0; l < ACC; l++) part[l] = -INFINITY;
    int64_t t = 0;
    for (; t + ACC <= len; t += ACC)
        for (int l = 0; l < ACC; l++) part[l] = s[t + l] > part[l] ? s[t + l] : part[l];
    for (; t < len; t++) m = s[t] > m ? s[t] : m;
    for (int l = 0; l < ACC; l++) m = part[l] > m ? part[l] : m;
    for (t = 0; t < len; t++) s[t] = exp_nonpositive(s[t] - m);
    for (int l = 0; l < ACC; l++) part[l] = 0.0f;
    for (t = 0; t + ACC <= len; t += ACC)
        for (int l = 0; l < ACC; l++) part[l] += s[t + l];
    for (; t < len; t++) sum += s[t];
    return sum + sum_parts(part);
}

/* out [group, D] float32: one kv head's share of a request (its group's queries qf [group, D]),
 * K/V at element `off` of each cached row; scores [group, len] is scratch */
static void attend_group(const float *qf, const void *k_cache, const void *v_cache, const int32_t *table, int64_t len,
                         int64_t block_size, int64_t row, int64_t off, int64_t group, int64_t D, float scale,
                         float *scores, Prefetcher *pf, int bf16, float *out) {
    (void)pf; /* read by the vector loops only */
#ifdef GV_LANES
    int vector = D % GV_LANES == 0;
    if (vector && bf16)
        group_scores_vector(qf, k_cache, table, len, block_size, row, off, group, D, scale, scores, pf, 1);
    else if (vector)
        group_scores_vector(qf, k_cache, table, len, block_size, row, off, group, D, scale, scores, pf, 0);
    else
#endif
        group_scores_scalar(qf, k_cache, table, len, block_size, row, off, group, D, scale, scores, bf16);
    float total[256];
    for (int64_t i = 0; i < group; i++) total[i] = softmax_numerators(scores + i * len, len);
#ifdef GV_LANES
    if (vector && bf16)
        group_values_vector(scores, v_cache, table, len, block_size, row, off, group, D, out, pf, 1);
    else if (vector)
        group_values_vector(scores, v_cache, table, len, block_size, row, off, group, D, out, pf, 0);
    else
#endif
        group_values_scalar(scores, v_cache, table, len, block_size, row, off, group, D, out, bf16);
    for (int64_t i = 0; i < group; i++)
        for (int64_t j = 0; j < D; j++) out[i * D + j] = len ? out[i * D + j] / total[i] : 0.0f;
}

enum { MAX_GROUP_DIM = 4096 }; /* query heads per kv head x head_dim */

/* The checks both attention ops make before they read anything (shapes within the buffers; each
 * request's length, block ids and, for a prefill, query offsets within range), and their scratch:
 * *scores [group, longest context] (NULL when every context is empty; the caller frees it).
 * Returns 0, -1 for something out of range, -2 without memory. */
static int attention_scores(int64_t heads, int64_t kv_heads, int64_t head_dim, const int32_t *block_tables,
                            int64_t max_blocks, const int32_t *context_lens, const int32_t *cu_seqlens_q,
                            int64_t num_blocks, int64_t block_size, int64_t r_begin, int64_t r_end, float **scores) {
    *scores = NULL;
    if (head_dim < 1 || head_dim > 1024 || kv_heads < 1 || heads % kv_heads || heads / kv_heads > 256 ||
        heads / kv_heads * head_dim > MAX_GROUP_DIM)
        return -1;
    int64_t max_len = 0;
    for (int64_t r = r_begin; r < r_end; r++) {
        int64_t len = context_lens[r];
        if (len < 0 || len > max_blocks * block_size) return -1;
        if (cu_seqlens_q) {
            int64_t q_len = (int64_t)cu_seqlens_q[r + 1] - cu_seqlens_q[r];
            if (q_len < 0 || q_len > len || cu_seqlens_q[r] < 0) return -1;
        }
        for (int64_t t = 0; t < len; t += block_size) {
            int32_t b = block_tables[r * max_blocks + t / block_size];
            if (b < 0 || b >= num_blocks) return -1;
        }
        max_len = len > max_len ? len : max_len;
    }
    if (max_len && !(*scores = malloc((size_t)(heads / kv_heads * max_len) * sizeof(float)))) return -2;
    return 0;
}

/* One query token's heads (q's row from element q_at) over the first `len` tokens of `table`, into
 * out's row from element out_at: each kv head's group of query heads by attend_group */
static void attend_token(const void *q, int64_t q_at, void *out, int64_t out_at, const void *k_cache,
                         const void *v_cache, const int32_t *table, int64_t len, int64_t block_size, int64_t heads,
                         int64_t kv_heads, int64_t head_dim, float scale, float *scores, Prefetcher *pf, int bf16) {
    int64_t group = heads / kv_heads, width = group * head_dim;
    float qf[MAX_GROUP_DIM], acc[MAX_GROUP_DIM]; /* a group's queries, its weighted sums */
    for (int64_t g = 0; g < kv_heads; g++) {
        load_row(q, q_at + g * width, qf, width, bf16);
        attend_group(qf, k_cache, v_cache, table, len, block_size, kv_heads * head_dim, g * head_dim, group, head_dim,
                     scale, scores, pf, bf16, acc);
        store_row(out, out_at + g * width, acc, width, bf16);
    }
}

/* Decode attention over the paged KV cache, one query token per request (kernels/paged_attention.py's
 * layout): out[r, h] = softmax(scale * q[r, h] . K[r, :len, h / group]) @ V[r, :len, h / group],
 * requests [r_begin, r_end). q [R, H, D] (request stride q_stride, heads dense); caches
 * [num_blocks, block_size, KVH, D] contiguous; block_tables [R, max_blocks] int32; context_lens [R]
 * int32; out [R, H, D] contiguous. Scores, softmax and the weighted sum in float32, out rounded
 * once (exp by exp_nonpositive); a request with no context gets zeros. Per request and kv head:
 * the group's scores, their softmax numerators, the weighted V sums, divided at the end; with
 * vectors (head_dim a multiple of the lanes) the next request's K/V are prefetched meanwhile.
 * Returns -1 for a block id or a length out of range (or shapes past the buffers), checked before
 * anything is read; -2 if out of memory. */
int paged_decode_attention(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                           const int32_t *block_tables, int64_t max_blocks, const int32_t *context_lens,
                           int64_t num_blocks, int64_t block_size, int64_t heads, int64_t kv_heads, int64_t head_dim,
                           float scale, void *out, int64_t r_begin, int64_t r_end, int bf16) {
    float *scores;
    int rc = attention_scores(heads, kv_heads, head_dim, block_tables, max_blocks, context_lens, NULL, num_blocks,
                              block_size, r_begin, r_end, &scores);
    if (rc) return rc;
    int64_t row = kv_heads * head_dim;
    for (int64_t r = r_begin; r < r_end; r++) {
        int64_t len = context_lens[r];
        const int32_t *table = block_tables + r * max_blocks;
        Prefetcher next, *pf = NULL; /* the next request's lines, while this one computes (vector loops) */
        if (r + 1 < r_end) {
            prefetcher_start(&next, k_cache, v_cache, block_tables + (r + 1) * max_blocks, context_lens[r + 1],
                             block_size, row * (bf16 ? 2 : 4), kv_heads * ((len + 3) / 4 + len));
            pf = &next;
        }
        attend_token(q, r * q_stride, out, r * heads * head_dim, k_cache, v_cache, table, len, block_size, heads,
                     kv_heads, head_dim, scale, scores, pf, bf16);
    }
    free(scores);
    return 0;
}

/* Prefill attention over the paged KV cache (the new tokens' K/V already stored): query token i of
 * request r (rows cu_seqlens_q[r] .. [r + 1] of q, token stride q_stride) sits at position
 * context_lens[r] - q_len + i and attends causally to the cached tokens 0 .. that position, one
 * attend_group per token and kv head. Requests [r_begin, r_end); out [num_tokens, H, D]
 * contiguous. Its work grows as q_len x context per request (dispatch.py takes it for short
 * prompts; the torch reference's batched products are faster for long ones). Returns -1 for a
 * block id, a length or offsets out of range (checked before anything is read), -2 without memory. */
int paged_prefill_attention(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                            const int32_t *block_tables, int64_t max_blocks, const int32_t *cu_seqlens_q,
                            const int32_t *context_lens, int64_t num_blocks, int64_t block_size, int64_t heads,
                            int64_t kv_heads, int64_t head_dim, float scale, void *out, int64_t r_begin,
                            int64_t r_end, int bf16) {
    float *scores;
    int rc = attention_scores(heads, kv_heads, head_dim, block_tables, max_blocks, context_lens, cu_seqlens_q,
                              num_blocks, block_size, r_begin, r_end, &scores);
    if (rc) return rc;
    for (int64_t r = r_begin; r < r_end; r++) {
        int64_t len = context_lens[r], first = cu_seqlens_q[r], q_len = (int64_t)cu_seqlens_q[r + 1] - first;
        for (int64_t i = 0; i < q_len; i++) { /* token first + i sees the prefix and new tokens 0 .. i */
            int64_t token = first + i;
            attend_token(q, token * q_stride, out, token * heads * head_dim, k_cache, v_cache,
                         block_tables + r * max_blocks, len - q_len + i + 1, block_size, heads, kv_heads, head_dim,
                         scale, scores, NULL, bf16);
        }
    }
    free(scores);
    return 0;
}

int paged_prefill_attention_parts(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                                  const int32_t *block_tables, int64_t max_blocks, const int32_t *cu_seqlens_q,
                                  const int32_t *context_lens, int64_t num_blocks, int64_t block_size, int64_t heads,
                                  int64_t kv_heads, int64_t head_dim, float scale, void *out, const int64_t *bounds,
                                  int64_t parts, int bf16) {
    RUN_PARTS(paged_prefill_attention(q, q_stride, k_cache, v_cache, block_tables, max_blocks, cu_seqlens_q,
                                      context_lens, num_blocks, block_size, heads, kv_heads, head_dim, scale, out,
                                      begin, end, bf16))
}

/* paged_decode_attention with its requests split over OpenMP threads (c_parts.h) */
int paged_decode_attention_parts(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                                 const int32_t *block_tables, int64_t max_blocks, const int32_t *context_lens,
                                 int64_t num_blocks, int64_t block_size, int64_t heads, int64_t kv_heads,
                                 int64_t head_dim, float scale, void *out, const int64_t *bounds, int64_t parts,
                                 int bf16) {
    RUN_PARTS(paged_decode_attention(q, q_stride, k_cache, v_cache, block_tables, max_blocks, context_lens, num_blocks,
                                     block_size, heads, kv_heads, head_dim, scale, out, begin, end, bf16))
}

/* ---- One decode token through a stack of Llama layers with 4-bit weights ----
 *
 * The eager path of models/llama.py for a round of one request and one token, each layer in one
 * pass with no Python in between: the same operations, rounded to the activation dtype where that
 * path's tensors are (every op's output; nothing to round in float32), with float32 sums.
 * Projections are either PyTorch's CPU int4pack layout with bfloat16 activations
 * (kernels/group_gemv.py int4pack_dequantize's reading, block_n rows per block, w = (q - 8) *
 * scale + zero) or, with float32 activations, GGUF's codes with float16 / float32 scales and mins
 * (w = scale * q + min) in GGUF's nibble order (the C GEMV's layout) or in row blocks
 * (code_blocks.h, 4-bit: ATen's int4pack order, scales [G, N]). Their sums run in another order
 * than the eager kernels', so outputs agree with the eager path to rounding, not bit for bit. */

typedef struct {
    const void *input_norm, *post_norm;               /* [hidden] in the activation dtype */
    const uint8_t *qkv, *o, *gate_up, *down;          /* 4-bit codes [N, K / 2] (int4pack, nibbles or blocks) */
    const void *qkv_sz, *o_sz, *gate_up_sz, *down_sz; /* int4pack: [G, N, 2] bf16; nibbles: scales [N, G]; blocks: [G, N] */
    const void *qkv_min, *o_min, *gate_up_min, *down_min; /* nibbles, blocks: mins like the scales, or NULL */
    void *k_cache, *v_cache;                          /* [num_blocks, block_size, kv_heads, head_dim] */
} Int4Layer;

enum { FORMAT_INT4PACK = 0, FORMAT_NIBBLES = 1, FORMAT_BLOCKS = 2 };

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, intermediate, group, block_n;
    int64_t num_blocks, block_size, max_position, rotary_dim;
    int64_t format, bf16, half; /* projections' layout; activations bfloat16 (1) or float32; nibble scales float16 */
    float eps, scale;
    const float *cos_sin; /* [max_position, rotary_dim] */
} Int4Dims;

/* a float16 (half) or float32 scale (cb_half_to_float: code_blocks.h) */
static inline float scale_at(const void *p, int64_t i, int half) {
    return half ? cb_half_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* y[n] = sum_k x[k] * w[n, k] for an int4pack weight [n, k]; per group of columns the codes are
 * summed against x first (s * (sum x q - 8 sum x) + zero * sum x), per row block of block_n. */
static inline __attribute__((always_inline)) void int4pack_gemv_impl(const uint8_t *packed, const uint16_t *sz,
                                                                      int64_t n, int64_t k, const int64_t group,
                                                                      const int64_t block_n, const float *x,
                                                                      float *y, int64_t begin, int64_t end) {
    int64_t half = block_n / 2;
    float acc[256], part[256];
    for (int64_t nb = begin; nb < end; nb += block_n) {
        const uint8_t *block = packed + nb * k / 2;
        for (int64_t j = 0; j < block_n; j++) acc[j] = 0.0f;
        for (int64_t g = 0; g < k / group; g++) {
            float xsum = 0.0f;
            for (int64_t j = 0; j < block_n; j++) part[j] = 0.0f;
            for (int64_t kk = g * group; kk < (g + 1) * group; kk++) {
                const uint8_t *restrict b = block + kk * half;
                float xv = x[kk], q[256];
                xsum += xv;
                for (int64_t j = 0; j < half; j++) {
                    q[j] = (float)(b[j] & 0x0F);
                    q[half + j] = (float)(b[j] >> 4);
                }
                for (int64_t j = 0; j < block_n; j++) part[j] = fmaf(xv, q[j], part[j]);
            }
            const uint16_t *s = sz + (g * n + nb) * 2;
            for (int64_t j = 0; j < block_n; j++) {
                float scale = bf16_to_float(s[2 * j]), zero = bf16_to_float(s[2 * j + 1]);
                acc[j] = fmaf(scale, part[j] - 8.0f * xsum, fmaf(zero, xsum, acc[j]));
            }
        }
        for (int64_t j = 0; j < block_n; j++) y[nb + j] = acc[j];
    }
}

#ifdef GV_LANES
/* int4pack_gemv_impl with vectors, for blocks of 4 * GV_LANES rows (the layout ATen packs for the
 * same vector width): per column, the block's half-width bytes give rows j (low nibbles) and
 * half + j (high); four accumulators hold the block's rows. Scale and zero of a (group, row) are
 * one 32-bit word (zero << 16 | scale). The same sums as the generic loop. */
static void int4pack_gemv_vector(const uint8_t *packed, const uint16_t *sz, int64_t n, int64_t k, int64_t group,
                                 const float *x, float *y, int64_t begin, int64_t end) {
    const int64_t block_n = 4 * GV_LANES, half = 2 * GV_LANES;
    for (int64_t nb = begin; nb < end; nb += block_n) {
        const uint8_t *block = packed + nb * k / 2;
        GV acc[4] = {GV_ZERO(), GV_ZERO(), GV_ZERO(), GV_ZERO()};
        for (int64_t g = 0; g < k / group; g++) {
            GV part[4] = {GV_ZERO(), GV_ZERO(), GV_ZERO(), GV_ZERO()};
            float xsum = 0.0f;
            for (int64_t kk = g * group; kk < (g + 1) * group; kk++) {
                const uint8_t *b = block + kk * half;
                GV xv = GV_SET1(x[kk]);
                xsum += x[kk];
                GVI b0 = GV_BYTES(b), b1 = GV_BYTES(b + GV_LANES);
                part[0] = GV_FMA(xv, GV_LOW(b0), part[0]);
                part[1] = GV_FMA(xv, GV_LOW(b1), part[1]);
                part[2] = GV_FMA(xv, GV_HIGH(b0), part[2]);
                part[3] = GV_FMA(xv, GV_HIGH(b1), part[3]);
            }
            const uint32_t *pairs = (const uint32_t *)(sz + (g * n + nb) * 2);
            GV xs = GV_SET1(xsum), x8 = GV_SET1(8.0f * xsum);
            for (int i = 0; i < 4; i++) {
                GVI u = GV_PAIRS(pairs + i * GV_LANES);
                acc[i] = GV_FMA(GV_SCALE(u), GV_SUB(part[i], x8), GV_FMA(GV_ZERO_OF(u), xs, acc[i]));
            }
        }
        for (int i = 0; i < 4; i++) GV_STORE(y + nb + i * GV_LANES, acc[i]);
    }
}
#endif

/* rows [begin, end) of y (multiples of block_n); constant block widths and group sizes, so that
 * the loops unroll and vectorize */
static void int4pack_gemv(const uint8_t *packed, const uint16_t *sz, int64_t n, int64_t k, int64_t group,
                          int64_t block_n, const float *x, float *y, int64_t begin, int64_t end) {
#ifdef GV_LANES
    if (block_n == 4 * GV_LANES) {
        int4pack_gemv_vector(packed, sz, n, k, group, x, y, begin, end);
        return;
    }
#endif
    if (block_n == 64 && group == 32)
        int4pack_gemv_impl(packed, sz, n, k, 32, 64, x, y, begin, end);
    else if (block_n == 32 && group == 32)
        int4pack_gemv_impl(packed, sz, n, k, 32, 32, x, y, begin, end);
    else
        int4pack_gemv_impl(packed, sz, n, k, group, block_n, x, y, begin, end);
}

/* rows [begin, end) of y = W x for GGUF's nibble layout (kernels/group_gemv.c's): codes [N, K / 2],
 * per 32 columns 16 bytes, byte j holding column j (low nibble) and j + 16 (high); w = scale * q
 * (+ min) per (row, group); xsum [K / group] the group sums of x (read with mins). */
static void nibble_gemv(const uint8_t *codes, const void *scale, const void *mins, int half, int64_t k, int64_t group,
                        const float *x, const float *xsum, float *y, int64_t begin, int64_t end) {
    int64_t groups = k / group;
    for (int64_t r = begin; r < end; r++) {
        const uint8_t *c = codes + r * (k / 2);
        float total = 0.0f, tail = 0.0f;
#ifdef GV_LANES
        GV acc = GV_ZERO();
        for (int64_t g = 0; g < groups; g++) {
            GV part = GV_ZERO();
            for (int64_t j = g * group; j < (g + 1) * group; j += 32)
                for (int64_t h = 0; h < 16; h += GV_LANES) {
                    GVI b = GV_BYTES(c + j / 2 + h);
                    part = GV_FMA(GV_LOW(b), GV_LOAD(x + j + h), part);
                    part = GV_FMA(GV_HIGH(b), GV_LOAD(x + j + 16 + h), part);
                }
            acc = GV_FMA(GV_SET1(scale_at(scale, r * groups + g, half)), part, acc);
            if (mins) tail += scale_at(mins, r * groups + g, half) * xsum[g];
        }
        total = GV_HSUM(acc) + tail;
#else
        for (int64_t g = 0; g < groups; g++) {
            float part = 0.0f;
            for (int64_t j = g * group; j < (g + 1) * group; j += 32)
                for (int64_t h = 0; h < 16; h++)
                    part += (float)(c[j / 2 + h] & 0x0F) * x[j + h] + (float)(c[j / 2 + h] >> 4) * x[j + 16 + h];
            total += scale_at(scale, r * groups + g, half) * part;
            if (mins) tail += scale_at(mins, r * groups + g, half) * xsum[g];
        }
        total += tail;
#endif
        y[r] = total;
    }
}

/* one projection of a layer, either layout */
typedef struct {
    int format, half;
    const uint8_t *codes;
    const void *sz, *mins;
    int64_t n, k, group, block_n;
    const float *x, *xsum;
    float *y;
} Gemv;

static void gemv_run(const Gemv *g, int64_t begin, int64_t end) {
    if (g->format == FORMAT_INT4PACK)
        int4pack_gemv(g->codes, g->sz, g->n, g->k, g->group, g->block_n, g->x, g->y, begin, end);
    else if (g->format == FORMAT_BLOCKS) /* shapes checked by decode_token */
        cb_gemv(g->codes, 4, g->sz, g->mins, g->half, g->x, g->xsum, g->y, 1, g->n, g->k, g->group, g->block_n,
                begin, end);
    else
        nibble_gemv(g->codes, g->sz, g->mins, g->half, g->k, g->group, g->x, g->xsum, g->y, begin, end);
}

/* A second thread for the GEMVs of one int4_llama_decode_token call: it spins on `posted`, claims
 * the upper half of the row blocks of each posted GEMV (`taken`), runs it and publishes `done`; the
 * caller runs the lower half meanwhile, then claims the upper half itself if the helper has not
 * (a vCPU descheduled by the host must not hold up the token), else waits for `done`. Either way
 * the rows are summed alike. Started and joined once per call (tens of microseconds against
 * milliseconds). */
typedef struct {
    Gemv job;
    int64_t begin, end;
    atomic_long posted, taken, done;
    atomic_int stop;
} GemvHelper;

/* job number `job` claimed by the calling thread (once: the helper or the caller) */
static inline int claim(GemvHelper *h, long job) {
    long expected = job - 1;
    return atomic_compare_exchange_strong_explicit(&h->taken, &expected, job, memory_order_acq_rel,
                                                   memory_order_acquire);
}

static inline void spin_pause(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static void *gemv_helper_main(void *arg) {
    GemvHelper *h = arg;
    long seen = 0;
    for (;;) {
        long posted;
        while ((posted = atomic_load_explicit(&h->posted, memory_order_acquire)) == seen) {
            if (atomic_load_explicit(&h->stop, memory_order_acquire)) return NULL;
            spin_pause();
        }
        seen = posted;
        if (claim(h, posted)) {
            gemv_run(&h->job, h->begin, h->end);
            atomic_store_explicit(&h->done, posted, memory_order_release);
        }
    }
}

/* y = W x over all rows (the layer's projection `codes`, `sz`, `mins` in the dims' layout), split
 * with the helper when there is one */
static void gemv_rows(GemvHelper *h, const Int4Dims *d, const uint8_t *codes, const void *sz, const void *mins,
                      int64_t n, int64_t k, const float *x, float *y) {
    float xsum[512]; /* k / group <= 16384 / 32 */
    Gemv g = {(int)d->format, (int)d->half, codes, sz, mins, n, k, d->group, d->block_n, x, xsum, y};
    if (d->format != FORMAT_INT4PACK && mins)
        for (int64_t i = 0; i < k / d->group; i++) {
            float sum = 0.0f;
            for (int64_t j = i * d->group; j < (i + 1) * d->group; j++) sum += x[j];
            xsum[i] = sum;
        }
    int64_t unit = d->format == FORMAT_NIBBLES ? 16 : d->block_n, mid = (n / unit / 2) * unit;
    if (!h || mid == 0) {
        gemv_run(&g, 0, n);
        return;
    }
    h->job = g, h->begin = mid, h->end = n;
    long job = atomic_load_explicit(&h->posted, memory_order_relaxed) + 1;
    atomic_store_explicit(&h->posted, job, memory_order_release);
    gemv_run(&g, 0, mid);
    if (claim(h, job))
        gemv_run(&g, mid, n);
    else
        while (atomic_load_explicit(&h->done, memory_order_acquire) != job) spin_pause();
}

/* s = round(x + residual) into residual (or residual = x for the first layer), out = RMSNorm(s);
 * n <= 16384 (checked by the caller) */
static void add_norm(const float *x, float *residual, int first, const void *weight, int64_t n, float eps, int bf16,
                     float *out) {
    float w[16384];
    for (int64_t j = 0; j < n; j++) residual[j] = first ? x[j] : x[j] + residual[j];
    round_row(residual, n, bf16);
    load_row(weight, 0, w, n, bf16);
    norm_row(residual, w, n, eps, bf16, out);
}

static int decode_token(const Int4Dims *d, const Int4Layer *layers, int64_t num_layers, void *hidden, void *residual,
                        int64_t position, int64_t slot, const int32_t *block_table, int64_t max_blocks,
                        int64_t context_len, GemvHelper *helper) {
    int64_t H = d->hidden, q_size = d->heads * d->head_dim, kv_size = d->kv_heads * d->head_dim;
    int64_t qkv_n = q_size + 2 * kv_size, I = d->intermediate;
    int bf = (int)d->bf16;
    int layout_ok = d->format == FORMAT_INT4PACK || d->format == FORMAT_BLOCKS
                        ? d->block_n > 0 && d->block_n <= 256 && d->block_n % 2 == 0 && H % d->block_n == 0 &&
                              qkv_n % d->block_n == 0 && (2 * I) % d->block_n == 0 &&
                              (d->format == FORMAT_INT4PACK || d->group <= 256)
                        : d->format == FORMAT_NIBBLES && d->group % 32 == 0;
    if (!layout_ok || position < 0 || position >= d->max_position || slot < 0 ||
        slot >= d->num_blocks * d->block_size || context_len < 1 || context_len > max_blocks * d->block_size ||
        H > 16384 || I > 16384 || q_size > 4096 || d->group < 1 || H % d->group || q_size % d->group ||
        I % d->group || d->rotary_dim > d->head_dim || d->rotary_dim % 2)
        return -1;
    for (int64_t t = 0; t < context_len; t += d->block_size) {
        int32_t b = block_table[t / d->block_size];
        if (b < 0 || b >= d->num_blocks) return -1;
    }
    size_t floats = (size_t)(3 * H + 2 * qkv_n + 2 * q_size + 4 * I);
    float *buf = malloc(floats * sizeof(float));
    if (!buf) return -2;
    float *x = buf, *res = x + H, *h = res + H, *qkv = h + H, *rot = qkv + qkv_n, *attn = rot + qkv_n,
          *gu = attn + q_size, *act = gu + 2 * I;
    float q_store[4096], out_store[4096]; /* q and the attention output in the cache's dtype */
    load_row(hidden, 0, x, H, bf);
    int64_t half = d->rotary_dim / 2, row = kv_size;
    const float *cos = d->cos_sin + position * d->rotary_dim, *sin = cos + half;
    int rc = 0;
    for (int64_t l = 0; l < num_layers && rc == 0; l++) {
        const Int4Layer *L = layers + l;
        add_norm(x, res, l == 0, L->input_norm, H, d->eps, bf, h);
        gemv_rows(helper, d, L->qkv, L->qkv_sz, L->qkv_min, qkv_n, H, h, qkv);
        round_row(qkv, qkv_n, bf);
        /* rotary on q and k heads, v as it is */
        rope_row(qkv, rot, d->heads + d->kv_heads, d->head_dim, d->rotary_dim, cos, sin);
        memcpy(rot + q_size + kv_size, qkv + q_size + kv_size, (size_t)kv_size * sizeof(float));
        round_row(rot, q_size + kv_size, bf);
        store_row(L->k_cache, slot * row, rot + q_size, kv_size, bf);
        store_row(L->v_cache, slot * row, rot + q_size + kv_size, kv_size, bf);
        store_row(q_store, 0, rot, q_size, bf);
        int32_t len32 = (int32_t)context_len;
        rc = paged_decode_attention(q_store, q_size, L->k_cache, L->v_cache, block_table, max_blocks, &len32,
                                    d->num_blocks, d->block_size, d->heads, d->kv_heads, d->head_dim, d->scale,
                                    out_store, 0, 1, bf);
        load_row(out_store, 0, attn, q_size, bf);
        gemv_rows(helper, d, L->o, L->o_sz, L->o_min, H, q_size, attn, x);
        round_row(x, H, bf);
        add_norm(x, res, 0, L->post_norm, H, d->eps, bf, h);
        gemv_rows(helper, d, L->gate_up, L->gate_up_sz, L->gate_up_min, 2 * I, H, h, gu);
        round_row(gu, 2 * I, bf);
        for (int64_t i = 0; i < I; i++) act[i] = gu[i] / (1.0f + expf(-gu[i])); /* silu, as torch computes it */
        round_row(act, I, bf);
        for (int64_t i = 0; i < I; i++) act[i] *= gu[I + i];
        round_row(act, I, bf);
        gemv_rows(helper, d, L->down, L->down_sz, L->down_min, H, I, act, x);
        round_row(x, H, bf);
    }
    if (rc == 0) {
        store_row(hidden, 0, x, H, bf);
        store_row(residual, 0, res, H, bf);
    }
    free(buf);
    return rc;
}

/* hidden [hidden] in the activation dtype: the embedding in, the last layer's MLP output out;
 * residual [hidden] out (the final norm adds them, as the eager stack does). The token is at `position`,
 * its K/V go to `slot`, attention reads context_len tokens through block_table. With threads > 1
 * a second thread takes half of each GEMV's rows. Returns 0; -1 for an index or a shape out of
 * range, found before anything is written; -2 without memory. */
int int4_llama_decode_token(const Int4Dims *d, const Int4Layer *layers, int64_t num_layers, void *hidden,
                            void *residual, int64_t position, int64_t slot, const int32_t *block_table,
                            int64_t max_blocks, int64_t context_len, int64_t threads) {
    GemvHelper helper;
    memset(&helper, 0, sizeof helper);
    atomic_init(&helper.posted, 0);
    atomic_init(&helper.taken, 0);
    atomic_init(&helper.done, 0);
    atomic_init(&helper.stop, 0);
    pthread_t thread;
    int started = threads > 1 && pthread_create(&thread, NULL, gemv_helper_main, &helper) == 0;
    int rc = decode_token(d, layers, num_layers, hidden, residual, position, slot, block_table, max_blocks,
                          context_len, started ? &helper : NULL);
    if (started) {
        atomic_store_explicit(&helper.stop, 1, memory_order_release);
        pthread_join(thread, NULL);
    }
    return rc;
}
