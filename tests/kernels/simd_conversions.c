/* kernels/csrc/simd.h's conversions as entry points, for test_simd_conversions.py: each runs its
 * vector form over whole vectors (where the build has them) and the scalar form over the tail, so
 * that one call compares both on the same values. Built by that test only; nothing ships it. */
#include <stdint.h>

#include "../../kernels/csrc/simd.h"

int lanes(void) {
#ifdef SIMD_LANES
    return SIMD_LANES;
#else
    return 0;
#endif
}

/* float32 -> bfloat16: `form` 0 simd_store_bf16, 1 its _normal form (no subnormal or NaN input), 2 the
 * low halves of simd_bf16_bits' lanes; the tail by float_to_bf16 */
void to_bf16(const float *src, uint16_t *dst, int64_t n, int form) {
    int64_t i = 0;
#ifdef SIMD_LANES
    for (; i + SIMD_LANES <= n; i += SIMD_LANES) {
        simd_f32 v = simd_load(src + i);
        if (form == 0) {
            simd_store_bf16(dst + i, v);
        } else if (form == 1) {
            simd_store_bf16_normal(dst + i, v);
        } else {
            simd_i32 bits = simd_bf16_bits(v);
            uint32_t lanes32[SIMD_LANES];
            memcpy(lanes32, &bits, sizeof lanes32);
            for (int l = 0; l < SIMD_LANES; l++) dst[i + l] = (uint16_t)lanes32[l];
        }
    }
#else
    (void)form; /* one form without vectors */
#endif
    for (; i < n; i++) dst[i] = float_to_bf16(src[i]);
}

/* bfloat16 -> float32: simd_load_bf16, the tail by bf16_to_float */
void from_bf16(const uint16_t *src, float *dst, int64_t n) {
    int64_t i = 0;
#ifdef SIMD_LANES
    for (; i + SIMD_LANES <= n; i += SIMD_LANES) simd_store(dst + i, simd_load_bf16(src + i));
#endif
    for (; i < n; i++) dst[i] = bf16_to_float(src[i]);
}

/* float16 -> float32: simd_load_half where the build has it, the tail by half_to_float */
void from_half(const uint16_t *src, float *dst, int64_t n) {
    int64_t i = 0;
#ifdef SIMD_HAS_HALF
    for (; i + SIMD_LANES <= n; i += SIMD_LANES) simd_store(dst + i, simd_load_half(src + i));
#endif
    for (; i < n; i++) dst[i] = half_to_float(src[i]);
}

/* whether some of the n float32 / bfloat16 / float16 scales is unsafe (simd.h's any_unsafe_scale) */
int any_unsafe(const float *p, int64_t n) { return any_unsafe_scale(p, n); }
int any_unsafe_bf16(const uint16_t *p, int64_t n) { return any_unsafe_scale_bf16(p, n); }
int any_unsafe_half(const uint16_t *p, int64_t n) { return any_unsafe_scale_half(p, n); }

/* the lane sums of four vectors of floats (4 * SIMD_LANES values) by simd_hsum4, and of the first
 * by simd_hsum, into out[0..4] and out[4] */
void hsums(const float *v, float *out) {
#ifdef SIMD_LANES
    simd_hsum4(simd_load(v), simd_load(v + SIMD_LANES), simd_load(v + 2 * SIMD_LANES), simd_load(v + 3 * SIMD_LANES),
               out);
    out[4] = simd_hsum(simd_load(v));
#else
    (void)v, (void)out;
#endif
}
