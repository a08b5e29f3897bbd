/* One decode token through a stack of Llama layers with 4-bit weights, in one call
 * (kernels/llama_decode.py loads it, linked with paged_attention.c).
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
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "code_blocks.h"
#include "paged_attention.h"
#include "rows.h"
#include "simd.h"

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

/* a float16 (half) or float32 scale */
static inline float scale_at(const void *p, int64_t i, int half) {
    return half ? half_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
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

#ifdef SIMD_LANES
/* int4pack_gemv_impl with vectors, for blocks of 4 * SIMD_LANES rows (the layout ATen packs for the
 * same vector width): per column, the block's half-width bytes give rows j (low nibbles) and
 * half + j (high); four accumulators hold the block's rows. Scale and zero of a (group, row) are
 * one 32-bit word (zero << 16 | scale). The same sums as the generic loop. */
static void int4pack_gemv_vector(const uint8_t *packed, const uint16_t *sz, int64_t n, int64_t k, int64_t group,
                                 const float *x, float *y, int64_t begin, int64_t end) {
    const int64_t block_n = 4 * SIMD_LANES, half = 2 * SIMD_LANES;
    for (int64_t nb = begin; nb < end; nb += block_n) {
        const uint8_t *block = packed + nb * k / 2;
        simd_f32 acc[4] = {simd_zero(), simd_zero(), simd_zero(), simd_zero()};
        for (int64_t g = 0; g < k / group; g++) {
            simd_f32 part[4] = {simd_zero(), simd_zero(), simd_zero(), simd_zero()};
            float xsum = 0.0f;
            for (int64_t kk = g * group; kk < (g + 1) * group; kk++) {
                const uint8_t *b = block + kk * half;
                simd_f32 xv = simd_set1(x[kk]);
                xsum += x[kk];
                simd_i32 b0 = simd_load_u8(b), b1 = simd_load_u8(b + SIMD_LANES);
                part[0] = simd_fma(xv, simd_low_nibbles(b0, 0), part[0]);
                part[1] = simd_fma(xv, simd_low_nibbles(b1, 0), part[1]);
                part[2] = simd_fma(xv, simd_high_nibbles(b0, 0), part[2]);
                part[3] = simd_fma(xv, simd_high_nibbles(b1, 0), part[3]);
            }
            const uint16_t *pairs = sz + (g * n + nb) * 2;
            simd_f32 xs = simd_set1(xsum), x8 = simd_set1(8.0f * xsum);
            for (int i = 0; i < 4; i++) {
                simd_i32 u = simd_load_i32(pairs + 2 * i * SIMD_LANES);
                acc[i] = simd_fma(simd_bf16_low_halves(u), simd_sub(part[i], x8),
                                  simd_fma(simd_bf16_high_halves(u), xs, acc[i]));
            }
        }
        for (int i = 0; i < 4; i++) simd_store(y + nb + i * SIMD_LANES, acc[i]);
    }
}
#endif

/* rows [begin, end) of y (multiples of block_n); constant block widths and group sizes, so that
 * the loops unroll and vectorize */
static void int4pack_gemv(const uint8_t *packed, const uint16_t *sz, int64_t n, int64_t k, int64_t group,
                          int64_t block_n, const float *x, float *y, int64_t begin, int64_t end) {
#ifdef SIMD_LANES
    if (block_n == 4 * SIMD_LANES) {
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
#ifdef SIMD_LANES
        simd_f32 acc = simd_zero();
        for (int64_t g = 0; g < groups; g++) {
            simd_f32 part = simd_zero();
            for (int64_t j = g * group; j < (g + 1) * group; j += 32)
                for (int64_t h = 0; h < 16; h += SIMD_LANES) {
                    simd_i32 b = simd_load_u8(c + j / 2 + h);
                    part = simd_fma(simd_low_nibbles(b, 0), simd_load(x + j + h), part);
                    part = simd_fma(simd_high_nibbles(b, 0), simd_load(x + j + 16 + h), part);
                }
            acc = simd_fma(simd_set1(scale_at(scale, r * groups + g, half)), part, acc);
            if (mins) tail += scale_at(mins, r * groups + g, half) * xsum[g];
        }
        total = simd_hsum(acc) + tail;
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
