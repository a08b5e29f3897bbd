/* Attention over the paged KV cache on the CPU (kernels/paged_attention.py's layout): one query
 * token per request (decode) or the new tokens of short prompts (prefill), softmax in float32
 * (kernels/cpu_ops.py loads it with cpu_ops.c; llama_decode.c calls the decode form, declared in
 * paged_attention.h). `bf16` selects the element type of q, the caches and out: 1 bfloat16,
 * 0 float32. Functions return 0, -1 for an index out of range, -2 without memory; a refused call
 * has read nothing.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "c_parts.h"
#include "paged_attention.h"
#include "rows.h"
#include "simd.h"

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

#ifdef SIMD_LANES
/* SIMD_LANES elements of a cached row as floats; `bf16` a constant where inlined */
static inline __attribute__((always_inline)) simd_f32 load_lanes(const void *cache, int64_t at, const int bf16) {
    return bf16 ? simd_load_bf16((const uint16_t *)cache + at) : simd_load((const float *)cache + at);
}

/* scores[i, t] = scale * q_i . k_t for a group's heads (qf [group, D] float32), then the weighted
 * V sums acc[i] = sum_t p[i, t] v_t, D a multiple of SIMD_LANES: K and V rows are read in place from
 * the cache (bf16 widened in registers). `bf16` is a constant at each call, so each dtype gets its
 * own loops. */
static inline __attribute__((always_inline)) void group_scores_vector(const float *qf, const void *cache,
                                                                      const int32_t *table, int64_t len,
                                                                      int64_t block_size, int64_t row, int64_t off,
                                                                      int64_t group, int64_t D, float scale,
                                                                      float *scores, Prefetcher *pf, const int bf16) {
    float kf[4 * 1024]; /* four bf16 K rows widened once for the group's heads */
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
                    for (int64_t c = 0; c < D; c += SIMD_LANES)
                        simd_store(kf + u * D + c, simd_load_bf16((const uint16_t *)cache + at + c));
                    k[u] = kf + u * D;
                } else {
                    k[u] = (const float *)cache + at;
                }
            }
            for (int64_t i = 0; i < group; i++) {
                const float *qi = qf + i * D;
                simd_f32 a0 = simd_zero(), a1 = simd_zero(), a2 = simd_zero(), a3 = simd_zero();
                for (int64_t c = 0; c < D; c += SIMD_LANES) {
                    simd_f32 qv = simd_load(qi + c);
                    a0 = simd_fma(qv, simd_load(k[0] + c), a0);
                    a1 = simd_fma(qv, simd_load(k[1] + c), a1);
                    a2 = simd_fma(qv, simd_load(k[2] + c), a2);
                    a3 = simd_fma(qv, simd_load(k[3] + c), a3);
                }
                float four[4];
                simd_hsum4(a0, a1, a2, a3, four);
                for (int64_t u = 0; u < m; u++) scores[i * len + t0 + j + u] = four[u] * scale;
            }
        }
    }
}

static inline __attribute__((always_inline)) void group_values_vector(const float *scores, const void *cache,
                                                                      const int32_t *table, int64_t len,
                                                                      int64_t block_size, int64_t row, int64_t off,
                                                                      int64_t group, int64_t D, float *acc,
                                                                      Prefetcher *pf, const int bf16) {
    for (int64_t c = 0; c < D; c += 2 * SIMD_LANES) { /* two lane blocks, up to four heads: 8 chains */
        int two = c + SIMD_LANES < D;
        for (int64_t i = 0; i < group; i += 4) {
            int64_t n = group - i < 4 ? group - i : 4;
            simd_f32 a0 = simd_zero(), a1 = simd_zero(), a2 = simd_zero(), a3 = simd_zero();
            simd_f32 b0 = simd_zero(), b1 = simd_zero(), b2 = simd_zero(), b3 = simd_zero();
            const float *s = scores + i * len;
            FOR_EACH_TOKEN(table, len, block_size, row, {
                if (c == 0 && i == 0) prefetch_some(pf);
                simd_f32 v = load_lanes(cache, at + off + c, bf16);
                simd_f32 w = two ? load_lanes(cache, at + off + c + SIMD_LANES, bf16) : v;
                simd_f32 p0 = simd_set1(s[t]);
                a0 = simd_fma(p0, v, a0);
                b0 = simd_fma(p0, w, b0);
                if (n > 1) {
                    simd_f32 p1 = simd_set1(s[len + t]);
                    a1 = simd_fma(p1, v, a1);
                    b1 = simd_fma(p1, w, b1);
                }
                if (n > 2) {
                    simd_f32 p2 = simd_set1(s[2 * len + t]);
                    a2 = simd_fma(p2, v, a2);
                    b2 = simd_fma(p2, w, b2);
                }
                if (n > 3) {
                    simd_f32 p3 = simd_set1(s[3 * len + t]);
                    a3 = simd_fma(p3, v, a3);
                    b3 = simd_fma(p3, w, b3);
                }
            })
            simd_f32 out_a[4] = {a0, a1, a2, a3}, out_b[4] = {b0, b1, b2, b3};
            for (int64_t h = 0; h < n; h++) {
                simd_store(acc + (i + h) * D + c, out_a[h]);
                if (two) simd_store(acc + (i + h) * D + c + SIMD_LANES, out_b[h]);
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
#ifdef SIMD_LANES
    int vector = D % SIMD_LANES == 0;
    if (vector && bf16)
        group_scores_vector(qf, k_cache, table, len, block_size, row, off, group, D, scale, scores, pf, 1);
    else if (vector)
        group_scores_vector(qf, k_cache, table, len, block_size, row, off, group, D, scale, scores, pf, 0);
    else
#endif
        group_scores_scalar(qf, k_cache, table, len, block_size, row, off, group, D, scale, scores, bf16);
    float total[256];
    for (int64_t i = 0; i < group; i++) total[i] = softmax_numerators(scores + i * len, len);
#ifdef SIMD_LANES
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
