/* A row of activations in float32 and in the tensors' dtype (`bf16`: 1 bfloat16, 0 float32), and
 * the per-row operations the decoder's small ops (cpu_ops.c), the paged attention
 * (paged_attention.c) and the one-token Llama decoder (llama_decode.c) share: loads, stores and
 * roundings to the dtype (simd.h's rounding), float32 dot products, the RMSNorm of a row and the
 * NeoX rotation of a token's heads, each rounding where its torch reference does. */
#ifndef MOEMESH_ROWS_H
#define MOEMESH_ROWS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

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
        for (int64_t i = 0; i < n; i++) v[i] = bf16_round(v[i]);
}

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

/* out = s * (1 / sqrt(mean(s^2) + eps)), rounded to the dtype, times w, rounded */
static inline void norm_row(const float *s, const float *w, int64_t n, float eps, int bf16, float *out) {
    float inv = 1.0f / sqrtf(dot(s, s, n) / (float)n + eps);
    for (int64_t j = 0; j < n; j++) out[j] = s[j] * inv;
    round_row(out, n, bf16);
    for (int64_t j = 0; j < n; j++) out[j] *= w[j];
    round_row(out, n, bf16);
}

/* NeoX rotary of `heads` heads of one token, float32 in and out: the first rotary_dim of each head
 * rotate as two halves (x1 * cos - x2 * sin, x2 * cos + x1 * sin, each product and sum rounded
 * to float32), the rest are copied. cos, sin: rotary_dim / 2 values each. */
static inline void rope_row(const float *x, float *out, int64_t heads, int64_t head_dim, int64_t rotary_dim,
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

#endif
