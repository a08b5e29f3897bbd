/* The decoder's small per-token operations on the CPU, one call each instead of a chain of torch
 * ops (kernels/cpu_ops.py loads it, with paged_attention.c; kernels/dispatch.py calls it for
 * float32 / bfloat16 CPU tensors). At a decode round of one request each torch op costs a few
 * microseconds of dispatch for a few hundred elements of work; these run the whole operation in
 * that time.
 *
 * Each computes what its torch reference (kernels/norm.py, rotary.py, kv_store.py) computes, in
 * float32, rounding to bfloat16 (nearest even) where the reference does:
 *   rms_norm:  [s = x + residual, rounded;] y = s * (1 / sqrt(mean(s^2) + eps)), rounded; y * weight, rounded;
 *   rope_neox: x1 * cos - x2 * sin and x2 * cos + x1 * sin, each product and sum rounded to float32
 *              (built with -ffp-contract=off: no fused multiply-adds), then to the dtype: the same
 *              bits as the reference;
 *   store_kv:  K and V rows copied to their slots; negative slots are skipped.
 * `bf16` selects the element type of every tensor argument of a call: 1 bfloat16, 0 float32.
 * Functions return 0, or -1 for an index out of range (the caller raises); a refused call has
 * written nothing into a tensor it was given to update (a KV cache).
 */
#include <stdint.h>
#include <string.h>

#include "rows.h"

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
