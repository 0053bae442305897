/* Elementwise ops around kvfleet's matmuls, fused for the CPU path in bfloat16: RMSNorm with
 * its residual add, neox rotary embedding, and SwiGLU's silu-and-mul.
 *
 * Why C: torch runs each as several passes over the tokens (widen to float32, add, normalise,
 * scale, narrow; rotate halves, concatenate); on a 2048-token prefill step on two cores these two
 * took a fifth of the step. Each function here makes one pass: a row is read once, computed in
 * float32 and written once. SiLU-and-mul is the exception that proves the rule: torch's bf16
 * silu runs libm-style exp per element, 5 GB/s on a decode step's rows that sit in L2; with
 * exp_nonpositive vectorised it is bound by memory instead (4x faster at 128 rows).
 *
 * Semantics are those of the torch reference (kernels/reference.py), which is the specification;
 * results differ from it only by float32 summation order and where bf16 rounding happens.
 * Layouts: rows of `hidden` (or 2 * d) elements, last dimension contiguous, row strides given
 * in elements. bf16 values travel as uint16 (the top half of a float32).
 *
 * Built with kernels/cpu_attention.c into one library by kernels/cpu_library.py.
 */

#include <math.h>
#include <stdint.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "cpu_cache.h"
#include "cpu_entry_points.h"
#include "cpu_math.h"

#define LANES 16

/* Below this many elements a call runs on the calling thread: waking the OpenMP team costs
 * more than the work (a decode step's 32 rows of 576). */
#define PARALLEL_MIN_ELEMS 65536

enum { OK = 0, ERR_SHAPE = 1, ERR_POSITION = 2, ERR_SLOT = 3 };

static inline int team(int64_t elems, int num_threads) {
    return elems < PARALLEL_MIN_ELEMS || num_threads < 1 ? 1 : num_threads;
}

/* residual = x + residual (or x when has_residual is 0), in float32 and in place;
 * out = bf16(residual / sqrt(mean(residual^2) + eps) * weight). hidden a multiple of LANES. */
int kvfleet_add_rms_norm_bf16(const uint16_t *x, int64_t x_stride, float *residual,
                              int has_residual, const uint16_t *weight, uint16_t *out,
                              int64_t rows, int hidden, float eps, int num_threads) {
    if (hidden <= 0 || hidden % LANES != 0) return ERR_SHAPE;
#pragma omp parallel for schedule(static) num_threads(team(rows * hidden, num_threads))
    for (int64_t row = 0; row < rows; row++)
        add_rms_norm_row(x + row * x_stride, residual + row * hidden, has_residual, weight,
                         out + row * hidden, hidden, eps);
    return OK;
}

/* Rotate the first rot_dim elements of each head of one token in place (neox layout: pairs
 * (i, i + rot_dim / 2)) by cos/sin already rounded to bf16, as the reference rounds them. */
static inline void rotate_heads(uint16_t *x, int heads, int head_dim, int half,
                                const float *cos, const float *sin) {
    for (int h = 0; h < heads; h++) {
        uint16_t *x1 = x + (int64_t)h * head_dim, *x2 = x1 + half;
        for (int i = 0; i < half; i++) {
            const float a = bf16_to_f32(x1[i]), b = bf16_to_f32(x2[i]);
            x1[i] = f32_to_bf16(a * cos[i] - b * sin[i]);
            x2[i] = f32_to_bf16(b * cos[i] + a * sin[i]);
        }
    }
}

/* q [tokens, q_heads, head_dim] and k [tokens, k_heads, head_dim] (heads contiguous within a
 * token, token strides given) rotated in place by cos_sin[positions[t]]: a float32 row of
 * rot_dim / 2 cosines then rot_dim / 2 sines, one row per position below max_position. A
 * position outside the table is an error before anything is written.
 * With k_cache non-NULL, each token's rotated K and its V (v: [tokens, k_heads, head_dim],
 * token stride v_stride) then go into the bf16 head-major paged cache at slots[t], the bytes
 * kvfleet_reshape_and_cache writes (a negative slot is skipped, one past the cache is an error
 * before anything is written): one call per layer instead of two, K copied while in L1. */
int kvfleet_rotary_and_cache_bf16(const int64_t *positions, int64_t tokens, uint16_t *q,
                                  int64_t q_stride, int q_heads, uint16_t *k, int64_t k_stride,
                                  const uint16_t *v, int64_t v_stride, int k_heads,
                                  int head_dim, int rot_dim, const float *cos_sin,
                                  int64_t cos_sin_stride, int64_t max_position,
                                  uint16_t *k_cache, uint16_t *v_cache, const int64_t *slots,
                                  int64_t num_blocks, int block_size, int num_threads) {
    if (rot_dim <= 0 || rot_dim % 2 != 0 || rot_dim > head_dim || rot_dim > 1024)
        return ERR_SHAPE;
    if (k_cache && (!v_cache || !v || !slots || block_size <= 0)) return ERR_SHAPE;
    for (int64_t t = 0; t < tokens; t++)
        if (positions[t] < 0 || positions[t] >= max_position) return ERR_POSITION;
    const int64_t capacity = num_blocks * block_size;
    if (k_cache)
        for (int64_t t = 0; t < tokens; t++)
            if (slots[t] >= capacity) return ERR_SLOT;
    const int half = rot_dim / 2;
    const size_t row = (size_t)head_dim * sizeof(uint16_t), plane = (size_t)capacity * row;
    const int64_t elems = tokens * (q_heads + k_heads) * rot_dim;
#pragma omp parallel for schedule(static) num_threads(team(elems, num_threads))
    for (int64_t t = 0; t < tokens; t++) {
        const float *cs = cos_sin + positions[t] * cos_sin_stride;
        float cos[512], sin[512];
        for (int i = 0; i < half; i++) {
            cos[i] = bf16_to_f32(f32_to_bf16(cs[i]));
            sin[i] = bf16_to_f32(f32_to_bf16(cs[half + i]));
        }
        rotate_heads(q + t * q_stride, q_heads, head_dim, half, cos, sin);
        rotate_heads(k + t * k_stride, k_heads, head_dim, half, cos, sin);
        if (k_cache && slots[t] >= 0)
            cache_token((const char *)(k + t * k_stride), (const char *)(v + t * v_stride),
                        (char *)k_cache, (char *)v_cache, slots[t], k_heads, row, plane);
    }
    return OK;
}

/* The rotation alone. */
int kvfleet_rotary_neox_bf16(const int64_t *positions, int64_t tokens, uint16_t *q,
                             int64_t q_stride, int q_heads, uint16_t *k, int64_t k_stride,
                             int k_heads, int head_dim, int rot_dim, const float *cos_sin,
                             int64_t cos_sin_stride, int64_t max_position, int num_threads) {
    return kvfleet_rotary_and_cache_bf16(positions, tokens, q, q_stride, q_heads, k, k_stride,
                                         NULL, 0, k_heads, head_dim, rot_dim, cos_sin,
                                         cos_sin_stride, max_position, NULL, NULL, NULL, 0, 0,
                                         num_threads);
}

/* out[r, i] = bf16(silu(x[r, i]) * x[r, d + i]) for rows of 2 * d bf16 values (row stride
 * x_stride elements; out rows contiguous). silu(g) = g * sigmoid(g), with sigmoid built from
 * e = exp(-|g|) <= 1 so the one exp never overflows: 1 / (1 + e) for g >= 0, e / (1 + e) below.
 * With AVX-512 the division is a reciprocal estimate refined by one Newton step (2^-23
 * relative, below bf16's rounding): a vector divide per 16 values was a third of the time. */
int kvfleet_silu_and_mul_bf16(const uint16_t *x, int64_t x_stride, uint16_t *out, int64_t rows,
                              int d, int num_threads) {
    if (d <= 0) return ERR_SHAPE;
#pragma omp parallel for schedule(static) num_threads(team(rows * d, num_threads))
    for (int64_t row = 0; row < rows; row++)
        silu_and_mul_row(x + row * x_stride, out + row * (int64_t)d, d);
    return OK;
}
