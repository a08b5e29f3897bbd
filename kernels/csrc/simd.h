/* The C kernels' one SIMD vocabulary: vector types and lane count, loads and stores, float32
 * arithmetic with fused multiply-adds, horizontal sums, 4- and 8-bit codes widened to floats, and
 * the bfloat16 / float16 <-> float32 conversions. Three targets, chosen by the compiler's flags
 * (c_library.py builds -march=native, and the tests AVX2-only and scalar copies):
 *   AVX-512:    SIMD_LANES 16;
 *   AVX2 + FMA: SIMD_LANES 8 (SIMD_HAS_HALF only with F16C);
 *   neither:    SIMD_LANES undefined, and each kernel runs its scalar loops.
 *
 * One rule for every conversion, so that a value's bits do not depend on which loop (a vector
 * body, its scalar tail, a scalar build) converted it:
 *   float32 -> bfloat16: round to nearest, ties to even, on the bits (torch's .to(bfloat16));
 *     subnormals are rounded like any other value, never flushed; a NaN keeps its sign and its
 *     top payload bits, with the quiet bit set.
 *   bfloat16 -> float32: exact, the float's high half (a NaN's payload as it is, as torch does);
 *   float16 -> float32: exact; a NaN keeps its payload and comes back quiet (F16C's rule).
 * AVX512-BF16's vcvtneps2bf16 rounds the same way except that it flushes subnormal inputs to
 * zero: simd_bf16_bits / simd_store_bf16 send a vector holding a subnormal to the integer path
 * (a test and a branch per vector), and without it the integer path keeps NaNs quiet with a mask.
 * The _normal forms skip both, for values that are neither subnormal nor NaN (any_unsafe_scale:
 * a dequantized weight's scales rule them out).
 *
 * Horizontal sums add in one order everywhere: within each 128-bit block lanes (0 + 2) + (1 + 3),
 * then the blocks pairwise ((0 + 2) + (1 + 3) for AVX-512, 0 + 1 for AVX2); simd_hsum4 gives each
 * of its four vectors the sum simd_hsum gives it alone.
 *
 * Kernel-specific instructions with no portable counterpart (AVX512-BF16's bfloat16 dot products in
 * cpu_moe.c and code_blocks.h) stay in those kernels, under their own feature tests. */
#ifndef MOEMESH_SIMD_H
#define MOEMESH_SIMD_H

#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

/* ---- scalar conversions (the rule above) ---- */

static inline float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* branch-free, so that the compiler vectorizes loops of it */
static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16, quiet = (u >> 16) | 0x40u;
    return (uint16_t)((u & 0x7FFFFFFFu) > 0x7F800000u ? quiet : rounded);
}

/* v rounded to bfloat16, kept in float32 */
static inline float bf16_round(float v) { return bf16_to_float(float_to_bf16(v)); }

static inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu, bits;
    if (exp == 0x1F) /* infinity, or a NaN made quiet as F16C makes it */
        bits = sign | 0x7F800000u | (man << 13) | (man ? 0x00400000u : 0u);
    else if (exp)
        bits = sign | ((exp + 112) << 23) | (man << 13);
    else if (man) { /* subnormal: renormalize */
        exp = 113;
        while (!(man & 0x400u)) man <<= 1, exp--;
        bits = sign | (exp << 23) | ((man & 0x3FFu) << 13);
    } else
        bits = sign;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

/* Whether some of n scales (or mins) s is "unsafe": one with which a weight q * s + m (q an
 * integer, rounded once) could be subnormal or NaN: nonzero and below 2^-102 in magnitude,
 * infinite, or NaN. With safe s and m, q * s and m are finite multiples of 2^-125, and so is their
 * sum (or it overflows to an infinity): a weight the _normal conversions take. On the bits, as the
 * least of |s| - 1 (zero wraps to the largest) and the largest |s|, which vectorize. */
static inline int any_unsafe_scale(const float *p, int64_t n) {
    uint32_t least = 0xFFFFFFFFu, most = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t a;
        memcpy(&a, p + i, sizeof a);
        a &= 0x7FFFFFFFu;
        least = a - 1u < least ? a - 1u : least;
        most = a > most ? a : most;
    }
    return least < 0x0C7FFFFFu || most >= 0x7F800000u; /* 2^-102 is 0x0C800000 */
}

/* the same for bfloat16 scales */
static inline int any_unsafe_scale_bf16(const uint16_t *p, int64_t n) {
    uint16_t least = 0xFFFFu, most = 0;
    for (int64_t i = 0; i < n; i++) {
        uint16_t a = (uint16_t)(p[i] & 0x7FFFu), a1 = (uint16_t)(a - 1u);
        least = a1 < least ? a1 : least;
        most = a > most ? a : most;
    }
    return least < 0x0C7Fu || most >= 0x7F80u;
}

/* and for float16 ones: a nonzero float16 is at least 2^-24, so only infinities and NaNs are */
static inline int any_unsafe_scale_half(const uint16_t *p, int64_t n) {
    uint16_t most = 0;
    for (int64_t i = 0; i < n; i++) {
        uint16_t a = (uint16_t)(p[i] & 0x7FFFu);
        most = a > most ? a : most;
    }
    return most >= 0x7C00u;
}

/* ---- vectors ---- */

#if defined(__AVX512F__)
#define SIMD_LANES 16
#define SIMD_HAS_HALF 1
typedef __m512 simd_f32;  /* SIMD_LANES float32 lanes */
typedef __m512i simd_i32; /* SIMD_LANES int32 lanes */

static inline simd_f32 simd_zero(void) { return _mm512_setzero_ps(); }
static inline simd_f32 simd_set1(float v) { return _mm512_set1_ps(v); }
static inline simd_f32 simd_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void simd_store(float *p, simd_f32 v) { _mm512_storeu_ps(p, v); }
static inline simd_f32 simd_add(simd_f32 a, simd_f32 b) { return _mm512_add_ps(a, b); }
static inline simd_f32 simd_sub(simd_f32 a, simd_f32 b) { return _mm512_sub_ps(a, b); }
static inline simd_f32 simd_mul(simd_f32 a, simd_f32 b) { return _mm512_mul_ps(a, b); }
/* a * b + c, rounded once */
static inline simd_f32 simd_fma(simd_f32 a, simd_f32 b, simd_f32 c) { return _mm512_fmadd_ps(a, b, c); }

static inline simd_i32 simd_load_i32(const void *p) { return _mm512_loadu_si512(p); }
/* SIMD_LANES unsigned bytes, each widened to an int32 lane */
static inline simd_i32 simd_load_u8(const uint8_t *p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
}
/* SIMD_LANES signed bytes as floats */
static inline simd_f32 simd_load_i8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
/* the low and the high nibble of each lane's byte, minus `offset` (in integers: exact, and off the
 * floating-point ports), as floats */
static inline simd_f32 simd_low_nibbles(simd_i32 b, int offset) {
    __m512i q = _mm512_and_si512(b, _mm512_set1_epi32(0x0F));
    return _mm512_cvtepi32_ps(_mm512_sub_epi32(q, _mm512_set1_epi32(offset)));
}
static inline simd_f32 simd_high_nibbles(simd_i32 b, int offset) {
    return _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(b, 4), _mm512_set1_epi32(offset)));
}

/* lanes holding bfloat16 pairs (high << 16 | low): the low halves, the high halves as floats */
static inline simd_f32 simd_bf16_low_halves(simd_i32 u) { return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16)); }
static inline simd_f32 simd_bf16_high_halves(simd_i32 u) {
    return _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32((int)0xFFFF0000u)));
}
static inline simd_f32 simd_load_bf16(const uint16_t *p) {
    return simd_bf16_low_halves(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)));
}
static inline simd_f32 simd_load_half(const uint16_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

/* each lane's bfloat16 (the rule) in the low half of the lane, with integer operations: rounded
 * to nearest even, and (`nan`) NaN lanes made quiet */
static inline simd_i32 simd_bf16_bits_int(simd_f32 v, const int nan) {
    __m512i u = _mm512_castps_si512(v), high = _mm512_srli_epi32(u, 16);
    __m512i bias = _mm512_add_epi32(_mm512_and_si512(high, _mm512_set1_epi32(1)), _mm512_set1_epi32(0x7FFF));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
    if (!nan) return rounded;
    __mmask16 lanes = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_mask_or_epi32(rounded, lanes, high, _mm512_set1_epi32(0x40));
}
static inline simd_i32 simd_bf16_bits_exact(simd_f32 v) { return simd_bf16_bits_int(v, 1); }

/* the 16 bfloat16 of v packed, v holding no subnormal and no NaN: vcvtneps2bf16 where the
 * hardware has it */
static inline __m256i simd_bf16_packed_normal(simd_f32 v) {
#if defined(__AVX512BF16__)
    return (__m256i)_mm512_cvtneps_pbh(v);
#else
    return _mm512_cvtepi32_epi16(simd_bf16_bits_int(v, 0));
#endif
}
static inline __m256i simd_bf16_packed(simd_f32 v) {
#if defined(__AVX512BF16__) && defined(__AVX512DQ__)
    if (__builtin_expect(_mm512_fpclass_ps_mask(v, 0x20) != 0, 0)) /* a subnormal lane */
        return _mm512_cvtepi32_epi16(simd_bf16_bits_exact(v));
    return (__m256i)_mm512_cvtneps_pbh(v); /* NaNs as the rule has them */
#else
    return _mm512_cvtepi32_epi16(simd_bf16_bits_exact(v));
#endif
}
static inline simd_i32 simd_bf16_bits(simd_f32 v) { return _mm512_cvtepu16_epi32(simd_bf16_packed(v)); }
static inline simd_i32 simd_bf16_bits_normal(simd_f32 v) {
    return _mm512_cvtepu16_epi32(simd_bf16_packed_normal(v));
}
static inline void simd_store_bf16(uint16_t *p, simd_f32 v) {
    _mm256_storeu_si256((__m256i *)p, simd_bf16_packed(v));
}
static inline void simd_store_bf16_normal(uint16_t *p, simd_f32 v) {
    _mm256_storeu_si256((__m256i *)p, simd_bf16_packed_normal(v));
}

static inline float simd_hsum(simd_f32 v) {
    __m512 t = _mm512_add_ps(v, _mm512_permute_ps(v, _MM_SHUFFLE(1, 0, 3, 2))); /* lane i + lane i ^ 2 */
    t = _mm512_add_ps(t, _mm512_permute_ps(t, _MM_SHUFFLE(2, 3, 0, 1)));        /* + lane i ^ 1 */
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(t),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(t), 1)));
    return _mm_cvtss_f32(_mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}

/* out[i] = the sum of the i-th vector's lanes; the four reductions share their shuffles */
static inline void simd_hsum4(simd_f32 a, simd_f32 b, simd_f32 c, simd_f32 d, float out[4]) {
    __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b)); /* a0+a2 b0+b2 a1+a3 b1+b3 */
    __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2))); /* a b c d per block */
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(abcd),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1)));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}

#elif defined(__AVX2__) && defined(__FMA__)
#define SIMD_LANES 8
#if defined(__F16C__)
#define SIMD_HAS_HALF 1
#endif
typedef __m256 simd_f32;
typedef __m256i simd_i32;

static inline simd_f32 simd_zero(void) { return _mm256_setzero_ps(); }
static inline simd_f32 simd_set1(float v) { return _mm256_set1_ps(v); }
static inline simd_f32 simd_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void simd_store(float *p, simd_f32 v) { _mm256_storeu_ps(p, v); }
static inline simd_f32 simd_add(simd_f32 a, simd_f32 b) { return _mm256_add_ps(a, b); }
static inline simd_f32 simd_sub(simd_f32 a, simd_f32 b) { return _mm256_sub_ps(a, b); }
static inline simd_f32 simd_mul(simd_f32 a, simd_f32 b) { return _mm256_mul_ps(a, b); }
static inline simd_f32 simd_fma(simd_f32 a, simd_f32 b, simd_f32 c) { return _mm256_fmadd_ps(a, b, c); }

static inline simd_i32 simd_load_i32(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline simd_i32 simd_load_u8(const uint8_t *p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}
static inline simd_f32 simd_load_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline simd_f32 simd_low_nibbles(simd_i32 b, int offset) {
    __m256i q = _mm256_and_si256(b, _mm256_set1_epi32(0x0F));
    return _mm256_cvtepi32_ps(_mm256_sub_epi32(q, _mm256_set1_epi32(offset)));
}
static inline simd_f32 simd_high_nibbles(simd_i32 b, int offset) {
    return _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(b, 4), _mm256_set1_epi32(offset)));
}

static inline simd_f32 simd_bf16_low_halves(simd_i32 u) { return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16)); }
static inline simd_f32 simd_bf16_high_halves(simd_i32 u) {
    return _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32((int)0xFFFF0000u)));
}
static inline simd_f32 simd_load_bf16(const uint16_t *p) {
    return simd_bf16_low_halves(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)));
}
#ifdef SIMD_HAS_HALF
static inline simd_f32 simd_load_half(const uint16_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
#endif

/* as the AVX-512 simd_bf16_bits_int */
static inline simd_i32 simd_bf16_bits_int(simd_f32 v, const int nan) {
    __m256i u = _mm256_castps_si256(v), high = _mm256_srli_epi32(u, 16);
    __m256i bias = _mm256_add_epi32(_mm256_and_si256(high, _mm256_set1_epi32(1)), _mm256_set1_epi32(0x7FFF));
    __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
    if (!nan) return rounded;
    __m256i quiet = _mm256_or_si256(high, _mm256_set1_epi32(0x40));
    return _mm256_blendv_epi8(rounded, quiet, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}
static inline simd_i32 simd_bf16_bits(simd_f32 v) { return simd_bf16_bits_int(v, 1); }
static inline simd_i32 simd_bf16_bits_normal(simd_f32 v) { return simd_bf16_bits_int(v, 0); }
/* lanes <= 0xFFFF: the unsigned saturation keeps them */
static inline void simd_store_bf16_lanes(uint16_t *p, __m256i u) {
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1)));
}
static inline void simd_store_bf16(uint16_t *p, simd_f32 v) { simd_store_bf16_lanes(p, simd_bf16_bits(v)); }
static inline void simd_store_bf16_normal(uint16_t *p, simd_f32 v) {
    simd_store_bf16_lanes(p, simd_bf16_bits_normal(v));
}

static inline float simd_hsum(simd_f32 v) {
    __m256 t = _mm256_add_ps(v, _mm256_permute_ps(v, _MM_SHUFFLE(1, 0, 3, 2)));
    t = _mm256_add_ps(t, _mm256_permute_ps(t, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtss_f32(_mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
}

static inline void simd_hsum4(simd_f32 a, simd_f32 b, simd_f32 c, simd_f32 d, float out[4]) {
    __m256 ab = _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
    __m256 cd = _mm256_add_ps(_mm256_unpacklo_ps(c, d), _mm256_unpackhi_ps(c, d));
    __m256 abcd = _mm256_add_ps(_mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                _mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
}
#endif

#endif
