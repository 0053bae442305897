/* Math helpers for kvfleet's CPU kernels (cpu_attention.c, cpu_elementwise.c, cpu_gemm.c):
 * bf16 conversions, one RMSNorm row, and an exp that gcc vectorises. Plain float and integer
 * arithmetic throughout, so loops over these compile to SIMD under -O3 -march=native without
 * -ffast-math. */
#ifndef KVFLEET_CPU_MATH_H
#define KVFLEET_CPU_MATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* bf16 is the upper 16 bits of an IEEE float32: widening is a shift, exact. */
static inline float bf16_to_f32(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* float32 → bf16, rounding to nearest even as torch's .to(torch.bfloat16) does; NaN stays a
 * (quiet) NaN instead of rounding into infinity. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    return (bits & 0x7FFFFFFFu) > 0x7F800000u ? (uint16_t)((bits >> 16) | 0x40u)
                                                : (uint16_t)rounded;
}

/* Activations are bf16 (as uint16) or float32. The row functions below take the type as a flag
 * that every caller passes as a literal, so each inlined copy is one type's loop, no branch. */
static inline float load_act(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store_act(void *p, int64_t i, float v, int bf16) {
    if (bf16)
        ((uint16_t *)p)[i] = f32_to_bf16(v);
    else
        ((float *)p)[i] = v;
}

/* One row of RMSNorm with its residual add: r = x + r (r = x when has_residual is 0), in float32
 * and in place; o = r / sqrt(mean(r^2) + eps) * weight, in the activations' type. hidden a
 * multiple of 16. The bf16 form is shared by the RMSNorm kernel and the AMX GEMM that normalises
 * its input rows while packing them, so both give the same bits. */
static inline void add_rms_norm_row_as(const void *x, float *r, int has_residual,
                                       const void *weight, void *o, int hidden, float eps,
                                       int bf16) {
    float squares[16] = {0};
    for (int i = 0; i < hidden; i += 16)
        for (int l = 0; l < 16; l++) {
            const float v = load_act(x, i + l, bf16) + (has_residual ? r[i + l] : 0.0f);
            r[i + l] = v;
            squares[l] += v * v;
        }
    float sum = 0.0f;
    for (int l = 0; l < 16; l++) sum += squares[l];
    const float inv = 1.0f / sqrtf(sum / (float)hidden + eps);
    for (int i = 0; i < hidden; i++)
        store_act(o, i, r[i] * inv * load_act(weight, i, bf16), bf16);
}

static inline void add_rms_norm_row(const uint16_t *x, float *r, int has_residual,
                                    const uint16_t *weight, uint16_t *o, int hidden, float eps) {
    add_rms_norm_row_as(x, r, has_residual, weight, o, hidden, eps, 1);
}

/* The constants of Cephes' expf, shared by the scalar exp_nonpositive and its vector forms
 * exp16 (AVX-512) and exp8 (AVX2): ln2 split in a high part exact in float and a low part. */
#define EXP_UNDERFLOW -87.0f /* below this expf is subnormal or 0: return 0 */
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693359375f
#define EXP_LN2_LO -2.12194440e-4f
#define EXP_P0 1.9875691500e-4f
#define EXP_P1 1.3981999507e-3f
#define EXP_P2 8.3334519073e-3f
#define EXP_P3 4.1665795894e-2f
#define EXP_P4 1.6666665459e-1f
#define EXP_P5 5.0000001201e-1f

/* The vector forms' shared middle: exp(r) for r = xc - n ln2 (ln2 in its two parts), by
 * exp_nonpositive's polynomial (below), in one vector width (MM: the intrinsics' prefix,
 * _mm512 or _mm256). exp16 and exp8 each keep their own rounding of n and scaling by 2^n. */
#define DEFINE_EXP_REDUCED(NAME, VEC, MM)                                                    \
    static inline VEC NAME(VEC xc, VEC n) {                                                  \
        VEC r = MM##_fnmadd_ps(n, MM##_set1_ps(EXP_LN2_HI), xc);                             \
        r = MM##_fnmadd_ps(n, MM##_set1_ps(EXP_LN2_LO), r);                                  \
        VEC p = MM##_set1_ps(EXP_P0);                                                        \
        p = MM##_fmadd_ps(p, r, MM##_set1_ps(EXP_P1));                                       \
        p = MM##_fmadd_ps(p, r, MM##_set1_ps(EXP_P2));                                       \
        p = MM##_fmadd_ps(p, r, MM##_set1_ps(EXP_P3));                                       \
        p = MM##_fmadd_ps(p, r, MM##_set1_ps(EXP_P4));                                       \
        p = MM##_fmadd_ps(p, r, MM##_set1_ps(EXP_P5));                                       \
        return MM##_fmadd_ps(MM##_mul_ps(p, r), r, MM##_add_ps(r, MM##_set1_ps(1.0f)));      \
    }

/* exp(x) for x <= 0 (attention scores minus their running max), within 2 ulp of expf. libm's
 * expf is a call per element (a third of the attention kernel's time at head_dim 64); this is
 * plain float and integer arithmetic, so a loop over it vectorises. Cephes' method:
 * x = n ln2 + r with |r| <= ln2/2, exp(r) by a degree-6 polynomial, 2^n built in the exponent
 * bits. */
static inline float exp_nonpositive(float x) {
    const float underflow = EXP_UNDERFLOW;
    const float xc = x < underflow ? underflow : x;
    /* Round x / ln2 to the nearest integer by adding and subtracting 1.5 * 2^23. */
    const float n = (xc * EXP_LOG2E + 12582912.0f) - 12582912.0f;
    float r = xc - n * EXP_LN2_HI;
    r = r - n * EXP_LN2_LO;
    float p = EXP_P0;
    p = p * r + EXP_P1;
    p = p * r + EXP_P2;
    p = p * r + EXP_P3;
    p = p * r + EXP_P4;
    p = p * r + EXP_P5;
    p = p * r * r + r + 1.0f;
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return x < underflow ? 0.0f : p * scale;
}

#ifdef __AVX512F__
#include <immintrin.h>

DEFINE_EXP_REDUCED(exp_reduced16, __m512, _mm512)

/* exp(x) for 16 lanes of x <= 0 (or -inf): exp_nonpositive's method, with the rounding and
 * the 2^n scaling done by roundscale and scalef. */
static inline __m512 exp16(__m512 x) {
    const __m512 underflow = _mm512_set1_ps(EXP_UNDERFLOW);
    const __mmask16 tiny = _mm512_cmp_ps_mask(x, underflow, _CMP_LT_OQ);
    const __m512 xc = _mm512_max_ps(x, underflow);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(EXP_LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 p = exp_reduced16(xc, n);
    return _mm512_maskz_mov_ps((__mmask16)~tiny, _mm512_scalef_ps(p, n));
}
#endif

#ifdef __AVX512F__
/* The 16 lane sums of v[0..15] as one vector: out[t] = sum of v[t]'s lanes. A transpose-and-add
 * tree (unpack within 128-bit lanes, then across them) costs 45 shuffles and adds for 16
 * sums, against 16 * 8 for a reduction per vector. Lanes never mix between vectors, so garbage
 * in one only reaches its own (ignored) sum. Shared by decode attention and the float32 GEMM. */
static inline __m512 reduce16(const __m512 v[16]) {
    __m512 pairs[8], quads[4];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: [t0, t1, t0, t1], t = 2i, 2i+1 */
        pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                                 _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per 128-bit lane: [t0, t1, t2, t3], t = 4i.. */
        const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
        quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    /* Sum the four 128-bit lanes of each quad, placing quad i in lane i. 0x88 picks lanes
     * (0, 2) of each operand, 0xDD lanes (1, 3). */
    const __m512 q01 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88),
                                     _mm512_shuffle_f32x4(quads[0], quads[1], 0xDD));
    const __m512 q23 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88),
                                     _mm512_shuffle_f32x4(quads[2], quads[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(q01, q23, 0x88),
                         _mm512_shuffle_f32x4(q01, q23, 0xDD));
}

/* 16 activations widened to float32 (bf16 is the top half of a float32: a shift). */
static inline __m512 load16_act(const void *p, int64_t i, int bf16) {
    if (bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i))),
            16));
    return _mm512_loadu_ps((const float *)p + i);
}
#endif

#if defined(__AVX2__) && !defined(__AVX512F__)
#include <immintrin.h>

/* reduce16's AVX2 form: the 8 lane sums of v[0..7] as one vector, out[t] = sum of v[t]'s lanes
 * (hadd pairs within 128-bit lanes twice, then the two halves). Used by the float32 GEMM built
 * for AVX2 + FMA. */
static inline __m256 reduce8(const __m256 v[8]) {
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    /* a = [t0 t1 t2 t3 | t0 t1 t2 t3] partial sums of the low and high halves; b for t4..t7 */
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

DEFINE_EXP_REDUCED(exp_reduced8, __m256, _mm256)

/* exp16's AVX2 form, for 8 lanes of x <= 0 (or -inf): the same reduction and polynomial, with
 * 2^n built in the exponent bits (n >= -126 once x is clamped at -87, so 2^n is normal). */
static inline __m256 exp8(__m256 x) {
    const __m256 underflow = _mm256_set1_ps(EXP_UNDERFLOW);
    const __m256 tiny = _mm256_cmp_ps(x, underflow, _CMP_LT_OQ);
    const __m256 xc = _mm256_max_ps(x, underflow);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(EXP_LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 p = exp_reduced8(xc, n);
    const __m256i bits =
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}
#endif

/* Whether silu_and_mul_row_as's AVX-512 loop runs for a type: bf16 needs AVX512-BF16 for its
 * rounding store, float32 AVX-512 alone. (Built for AVX2, float32 has a loop of its own.) */
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define SILU_VECTOR(bf16) 1
#elif defined(__AVX512F__)
#define SILU_VECTOR(bf16) (!(bf16))
#else
#define SILU_VECTOR(bf16) 0
#endif

/* One row of SwiGLU's gate: o[i] = silu(g[i]) * u[i] for the row's 2 * d values g = x[:d],
 * u = x[d:], rounded once to the activations' type. silu(g) = g * sigmoid(g), sigmoid from
 * exp(-|g|) (never overflows) and a reciprocal estimate refined by one Newton step (a vector
 * divide was a third of the time). The bf16 form is shared by the silu-and-mul kernel and the
 * AMX GEMM that applies it while packing its input rows, so both give the same bits. */
static inline void silu_and_mul_row_as(const void *x, void *o, int d, int bf16) {
    int i = 0;
#ifdef __AVX512F__
    if (SILU_VECTOR(bf16)) {
        const __m512 one = _mm512_set1_ps(1.0f), two = _mm512_set1_ps(2.0f);
        const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
        for (; i + 16 <= d; i += 16) {
            const __m512 g = load16_act(x, i, bf16), u = load16_act(x, d + i, bf16);
            const __m512 neg_abs =
                _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(g), sign));
            const __m512 e = exp16(neg_abs);
            const __m512 den = _mm512_add_ps(one, e);
            __m512 inv = _mm512_rcp14_ps(den);
            inv = _mm512_mul_ps(inv, _mm512_fnmadd_ps(den, inv, two));
            const __mmask16 negative = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
            const __m512 sigmoid = _mm512_mask_mul_ps(inv, negative, inv, e);
            const __m512 y = _mm512_mul_ps(_mm512_mul_ps(g, sigmoid), u);
#ifdef __AVX512BF16__
            if (bf16) {
                _mm256_storeu_si256((__m256i *)((uint16_t *)o + i),
                                    (__m256i)_mm512_cvtneps_pbh(y));
                continue;
            }
#endif
            _mm512_storeu_ps((float *)o + i, y);
        }
    }
#elif defined(__AVX2__) && defined(__FMA__)
    /* float32 only: AVX2 has no bf16 rounding store, and the engine picks float32 on such
     * CPUs. A true divide here: without rcp14 an estimate needs two Newton steps for the same
     * accuracy, and the loop is memory-bound at the sizes where it matters. gcc does not
     * vectorise the scalar loop below (its exp and select), which ran at a fifth of torch's
     * speed at 32-2048 rows. */
    if (!bf16) {
        const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
        const __m256 sign = _mm256_set1_ps(-0.0f);
        for (; i + 8 <= d; i += 8) {
            const __m256 g = _mm256_loadu_ps((const float *)x + i);
            const __m256 u = _mm256_loadu_ps((const float *)x + d + i);
            const __m256 e = exp8(_mm256_or_ps(g, sign)); /* exp(-|g|) */
            const __m256 num = _mm256_blendv_ps(one, e, _mm256_cmp_ps(g, zero, _CMP_LT_OQ));
            const __m256 sigmoid = _mm256_div_ps(num, _mm256_add_ps(one, e));
            _mm256_storeu_ps((float *)o + i, _mm256_mul_ps(_mm256_mul_ps(g, sigmoid), u));
        }
    }
#endif
    for (; i < d; i++) {
        const float g = load_act(x, i, bf16);
        const float e = exp_nonpositive(g < 0.0f ? g : -g);
        const float sigmoid = (g < 0.0f ? e : 1.0f) / (1.0f + e);
        store_act(o, i, g * sigmoid * load_act(x, d + i, bf16), bf16);
    }
}

static inline void silu_and_mul_row(const uint16_t *x, uint16_t *o, int d) {
    silu_and_mul_row_as(x, o, d, 1);
}

#endif
