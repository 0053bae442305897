/* Prototypes of the exported kernels that cpu_decode_step.c chains. The files defining them
 * include this header too, so the compiler checks every caller against the one definition
 * (cpu_library.SIGNATURES is the Python side's copy of the same ABI). */
#ifndef KVFLEET_CPU_ENTRY_POINTS_H
#define KVFLEET_CPU_ENTRY_POINTS_H

#include <stdint.h>

/* Element types of activations and caches across the ABI (cpu_attention.py's _DTYPES). */
enum { DTYPE_FLOAT32 = 0, DTYPE_BFLOAT16 = 1, DTYPE_FP8_E4M3 = 2, DTYPE_FP8_E5M2 = 3 };

/* cpu_gemm.c */
int kvfleet_linear_bf16(const uint16_t *x, int64_t x_stride, int prologue, float *residual,
                        int has_residual, const uint16_t *norm_weight, float eps,
                        const uint16_t *packed, const float *bias, uint16_t *out,
                        int64_t out_stride, int64_t m, int64_t n, int64_t k, int kernel,
                        int num_threads);

/* cpu_gemm_f32.c */
int kvfleet_linear_f32(const float *x, int64_t x_stride, const float *w, const float *bias,
                       float *out, int64_t out_stride, int64_t m, int64_t n, int64_t k,
                       int num_threads);

/* cpu_gemm_quant.c: a weight in kernels/quant_weight.py's layout (int4: 16 bytes per 32 weights;
 * int8: 32 values) repacked into column blocks of kvfleet_quant_block() (the C file's layout),
 * float32 scales and offsets (or NULL) per group. */
enum { QUANT_INT4 = 0, QUANT_INT8 = 1 };
typedef struct {
    const uint8_t *q;
    const float *scales, *offsets;
    int32_t format, group, block;
} QuantWeight;
int kvfleet_linear_quant(const float *x, int64_t x_stride, const QuantWeight *w,
                         const float *bias, float *out, int64_t out_stride, int64_t m, int64_t n,
                         int64_t k, int num_threads);
int kvfleet_dequantize(const QuantWeight *w, float *out, int64_t n, int64_t k, int num_threads);
/* The columns per block of this build's kernel (0: none), and 1 where its dot is AVX-512 VNNI's
 * vpdpwssd (cpu_gemm_quant.max_rows picks its row limit by it). */
int kvfleet_quant_block(void);
int kvfleet_quant_fused_dot(void);

/* cpu_elementwise.c */
int kvfleet_add_rms_norm(const void *x, int64_t x_stride, float *residual, int has_residual,
                         const void *weight, void *out, int64_t rows, int hidden, float eps,
                         int io_dtype, int num_threads);
int kvfleet_silu_and_mul(const void *x, int64_t x_stride, void *out, int64_t rows, int d,
                         int io_dtype, int num_threads);
int kvfleet_rotary_and_cache(const int64_t *positions, int64_t tokens, void *q, int64_t q_stride,
                             int q_heads, void *k, int64_t k_stride, const void *v,
                             int64_t v_stride, int k_heads, int head_dim, int rot_dim,
                             const float *cos_sin, int64_t cos_sin_stride, int64_t max_position,
                             void *k_cache, void *v_cache, const int64_t *slots,
                             int64_t num_blocks, int block_size, int io_dtype, int num_threads);

/* cpu_argmax.c */
int kvfleet_argmax_f32(const float *x, int64_t x_stride, int64_t rows, int64_t cols,
                       int64_t *out, int num_threads);

/* cpu_attention.c */
int kvfleet_decode_attention(const void *query_io, int64_t q_stride, void *out_io,
                             int64_t out_stride, int io_dtype, const void *k_cache,
                             const void *v_cache, int dtype, const int32_t *block_tables,
                             int64_t table_stride, const int32_t *seq_lens, int num_seqs,
                             int num_heads, int num_kv_heads, int head_dim, int block_size,
                             int64_t num_blocks, float scale, int num_threads, int allow_amx);

/* cpu_prefill.c, cpu_prefill_f32.c */
int kvfleet_prefill_attention_bf16(const uint16_t *query, int64_t q_stride, uint16_t *out,
                                   int64_t out_stride, const uint16_t *k_cache,
                                   const uint16_t *v_cache, const int32_t *block_table,
                                   int seq_len, int q_len, int num_heads, int num_kv_heads,
                                   int head_dim, int block_size, int64_t num_blocks, float scale,
                                   int num_threads);
int kvfleet_prefill_attention_bf16_vec(const uint16_t *query, int64_t q_stride, uint16_t *out,
                                       int64_t out_stride, const uint16_t *k_cache,
                                       const uint16_t *v_cache, const int32_t *block_table,
                                       int seq_len, int q_len, int num_heads, int num_kv_heads,
                                       int head_dim, int block_size, int64_t num_blocks,
                                       float scale, int num_threads);
int kvfleet_prefill_attention_f32(const float *query, int64_t q_stride, float *out,
                                  int64_t out_stride, const float *k_cache, const float *v_cache,
                                  const int32_t *block_table, int seq_len, int q_len,
                                  int num_heads, int num_kv_heads, int head_dim, int block_size,
                                  int64_t num_blocks, float scale, int num_threads);

#endif
