/* Elementwise ops around kvfleet's matmuls, fused for the CPU path in bfloat16 or float32:
 * RMSNorm with its residual add, neox rotary embedding, and SwiGLU's silu-and-mul.
 *
 * Why C: torch runs each as several passes over the tokens (widen to float32, add, normalise,
 * scale, narrow; rotate halves, concatenate); on a 2048-token prefill step on two cores these two
 * took a fifth of the step. Each function here makes one pass: a row is read once, computed in
 * float32 and written once. SiLU-and-mul is the exception that proves the rule: torch's bf16
 * silu runs libm-style exp per element, 5 GB/s on a decode step's rows that sit in L2; with
 * exp_nonpositive vectorised it is bound by memory instead (4x faster at 128 rows).
 *
 * Semantics are those of the torch reference (kernels/reference.py), which is the specification;
 * results differ from it only by float32 summation order, contraction into FMAs, exp's
 * approximation (within 2 ulp) and where bf16 rounding happens.
 * Layouts: rows of `hidden` (or 2 * d) elements, last dimension contiguous, row strides given
 * in elements. bf16 values travel as uint16 (the top half of a float32). In float32 (the CPU
 * default where the CPU lacks AVX512-BF16) torch's passes cost the same again: on a 2-core
 * AVX-512 host the three took 12 s of a 95 s standard-workload run.
 *
 * Built with kernels/cpu/cpu_attention.c into one library by kernels/cpu/cpu_library.py.
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

/* Bytes per activation for io_dtype (DTYPE_BFLOAT16 or DTYPE_FLOAT32), 0 for any other code. */
static inline size_t act_size(int io_dtype) {
    return io_dtype == DTYPE_BFLOAT16 ? 2 : io_dtype == DTYPE_FLOAT32 ? 4 : 0;
}

/* residual = x + residual (or x when has_residual is 0), in float32 and in place;
 * out = residual / sqrt(mean(residual^2) + eps) * weight in io_dtype, as are x and weight.
 * hidden a multiple of LANES. */
int kvfleet_add_rms_norm(const void *x, int64_t x_stride, float *residual, int has_residual,
                         const void *weight, void *out, int64_t rows, int hidden, float eps,
                         int io_dtype, int num_threads) {
    const size_t elem = act_size(io_dtype);
    if (hidden <= 0 || hidden % LANES != 0 || !elem) return ERR_SHAPE;
#pragma omp parallel for schedule(static) num_threads(team(rows * hidden, num_threads))
    for (int64_t row = 0; row < rows; row++) {
        const char *xr = (const char *)x + row * x_stride * elem;
        char *o = (char *)out + row * hidden * elem;
        float *r = residual + row * hidden;
        if (elem == 2)
            add_rms_norm_row_as(xr, r, has_residual, weight, o, hidden, eps, 1);
        else
            add_rms_norm_row_as(xr, r, has_residual, weight, o, hidden, eps, 0);
    }
    return OK;
}

/* Rotate the first rot_dim elements of each head of one token in place (neox layout: pairs
 * (i, i + rot_dim / 2)) by cos/sin (in bf16, already rounded to bf16, as the reference rounds
 * them). */
static inline void rotate_heads(void *x, int heads, int head_dim, int half, const float *cos,
                                const float *sin, int bf16) {
    for (int h = 0; h < heads; h++)
        for (int i = 0; i < half; i++) {
            const int64_t i1 = (int64_t)h * head_dim + i, i2 = i1 + half;
            const float a = load_act(x, i1, bf16), b = load_act(x, i2, bf16);
            store_act(x, i1, a * cos[i] - b * sin[i], bf16);
            store_act(x, i2, b * cos[i] + a * sin[i], bf16);
        }
}

/* q [tokens, q_heads, head_dim] and k [tokens, k_heads, head_dim] (heads contiguous within a
 * token, token strides given in elements) rotated in place by cos_sin[positions[t]]: a float32
 * row of rot_dim / 2 cosines then rot_dim / 2 sines, one row per position below max_position. A
 * position outside the table is an error before anything is written. q, k, v and the caches
 * are io_dtype (DTYPE_BFLOAT16 or DTYPE_FLOAT32).
 * With k_cache non-NULL, each token's rotated K and its V (v: [tokens, k_heads, head_dim],
 * token stride v_stride) then go into the head-major paged cache at slots[t], the bytes
 * kvfleet_reshape_and_cache writes (a negative slot is skipped, one past the cache is an error
 * before anything is written): one call per layer instead of two, K copied while in L1. */
int kvfleet_rotary_and_cache(const int64_t *positions, int64_t tokens, void *q, int64_t q_stride,
                             int q_heads, void *k, int64_t k_stride, const void *v,
                             int64_t v_stride, int k_heads, int head_dim, int rot_dim,
                             const float *cos_sin, int64_t cos_sin_stride, int64_t max_position,
                             void *k_cache, void *v_cache, const int64_t *slots,
                             int64_t num_blocks, int block_size, int io_dtype, int num_threads) {
    const size_t elem = act_size(io_dtype);
    if (!elem || rot_dim <= 0 || rot_dim % 2 != 0 || rot_dim > head_dim || rot_dim > 1024)
        return ERR_SHAPE;
    if (k_cache && (!v_cache || !v || !slots || block_size <= 0)) return ERR_SHAPE;
    for (int64_t t = 0; t < tokens; t++)
        if (positions[t] < 0 || positions[t] >= max_position) return ERR_POSITION;
    const int64_t capacity = num_blocks * block_size;
    if (k_cache)
        for (int64_t t = 0; t < tokens; t++)
            if (slots[t] >= capacity) return ERR_SLOT;
    const int half = rot_dim / 2, bf16 = elem == 2;
    const size_t row = (size_t)head_dim * elem, plane = (size_t)capacity * row;
    const int64_t elems = tokens * (q_heads + k_heads) * rot_dim;
#pragma omp parallel for schedule(static) num_threads(team(elems, num_threads))
    for (int64_t t = 0; t < tokens; t++) {
        const float *cs = cos_sin + positions[t] * cos_sin_stride;
        float cos[512], sin[512];
        for (int i = 0; i < half; i++) {
            cos[i] = bf16 ? bf16_to_f32(f32_to_bf16(cs[i])) : cs[i];
            sin[i] = bf16 ? bf16_to_f32(f32_to_bf16(cs[half + i])) : cs[half + i];
        }
        char *qt = (char *)q + t * q_stride * elem, *kt = (char *)k + t * k_stride * elem;
        if (bf16) {
            rotate_heads(qt, q_heads, head_dim, half, cos, sin, 1);
            rotate_heads(kt, k_heads, head_dim, half, cos, sin, 1);
        } else {
            rotate_heads(qt, q_heads, head_dim, half, cos, sin, 0);
            rotate_heads(kt, k_heads, head_dim, half, cos, sin, 0);
        }
        if (k_cache && slots[t] >= 0)
            cache_token(kt, (const char *)v + t * v_stride * elem, (char *)k_cache,
                        (char *)v_cache, slots[t], k_heads, row, plane);
    }
    return OK;
}

/* The rotation alone. */
int kvfleet_rotary_neox(const int64_t *positions, int64_t tokens, void *q, int64_t q_stride,
                        int q_heads, void *k, int64_t k_stride, int k_heads, int head_dim,
                        int rot_dim, const float *cos_sin, int64_t cos_sin_stride,
                        int64_t max_position, int io_dtype, int num_threads) {
    return kvfleet_rotary_and_cache(positions, tokens, q, q_stride, q_heads, k, k_stride, NULL, 0,
                                    k_heads, head_dim, rot_dim, cos_sin, cos_sin_stride,
                                    max_position, NULL, NULL, NULL, 0, 0, io_dtype, num_threads);
}

/* out[r, i] = silu(x[r, i]) * x[r, d + i] for rows of 2 * d values (row stride x_stride
 * elements; out rows contiguous), rounded once to io_dtype (DTYPE_BFLOAT16 or DTYPE_FLOAT32).
 * silu(g) = g * sigmoid(g), with sigmoid built from e = exp(-|g|) <= 1 so the one exp never
 * overflows: 1 / (1 + e) for g >= 0, e / (1 + e) below. With AVX-512 the division is a
 * reciprocal estimate refined by one Newton step (2^-23 relative): a vector divide per 16
 * values was a third of the time. */
int kvfleet_silu_and_mul(const void *x, int64_t x_stride, void *out, int64_t rows, int d,
                         int io_dtype, int num_threads) {
    const size_t elem = act_size(io_dtype);
    if (d <= 0 || !elem) return ERR_SHAPE;
#pragma omp parallel for schedule(static) num_threads(team(rows * d, num_threads))
    for (int64_t row = 0; row < rows; row++) {
        const char *xr = (const char *)x + row * x_stride * elem;
        char *o = (char *)out + row * (int64_t)d * elem;
        if (elem == 2)
            silu_and_mul_row_as(xr, o, d, 1);
        else
            silu_and_mul_row_as(xr, o, d, 0);
    }
    return OK;
}

/* 1 when the library was built for AVX-512, else 0: what the float32 prefill-attention and GEMM
 * kernels need (their entry points answer ERR_NO_AVX512 without it). */
int kvfleet_avx512(void) {
#ifdef __AVX512F__
    return 1;
#else
    return 0;
#endif
}
