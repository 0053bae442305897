/* A step through a whole Llama-family decoder stack in one call.
 *
 * Why: per layer the model makes six kernel calls (RMSNorm + qkv, rotary + cache write,
 * attention, o, RMSNorm + gate/up, SiLU-and-mul + down), each behind Python checks, a tensor or
 * two and a ctypes call of up to 21 arguments. Here the same six kernels run in the same order
 * on the same inputs, so the results are the same bits as the per-op path on the same GEMM
 * kernel (tests/runtime/test_decode_step.py compares them), and Python makes one call a step.
 * On the 2-core host a bundled-model decode step (400-token contexts) went 26.6 -> 16.1 ms at
 * 1 sequence, 35.0 -> 23.0 at 8 and 69.1 -> 53.5 at 32 (medians, `kvfleet bench decode-step`,
 * docs/results/bench-decode-step.json). The Python and ctypes work alone measures ~4 ms a step
 * (kernels stubbed out: 3.2 ms, plus 3.6 us per ctypes call); the rest of the difference is not
 * attributed (the OpenMP wait policy did not change it).
 *
 * A step may carry prompt chunks after its decodes (a serving step that admits a new request):
 * every row goes through the same projections, and attention runs the decode kernel over the
 * decode rows, then the prefill kernel the per-op path calls over each chunk (`StepSeqs`). Op by
 * op, 1 / 8 / 32 decodes beside a 128-token chunk took 8.6 / 14.1 / 20.7 ms longer on the
 * bundled model (2-core AVX512-BF16 host, `kvfleet bench decode-step --prompt-tokens 128`,
 * docs/results/bench-decode-step-q4-chunk128-avx512bf16.json); serving at concurrency 32 puts a
 * chunk in a third of its steps.
 *
 * kvfleet_stack_step_bf16 takes steps of bf16 weights packed by cpu_gemm.pack and head-major
 * bf16 caches, on the bf16 GEMM engine gemm_kernel names (AMX, or AVX512-BF16 vectors without
 * AMX), up to the rows where the per-op path's projections run on that same engine
 * (cpu_gemm.max_rows()). kvfleet_stack_step_f32 is the float32 model's (the CPU default
 * without AVX512-BF16): plain float32 weights, float32 caches, and steps of the rows the per-op
 * path runs on cpu_gemm_f32 (cpu_gemm_f32.MIN_ROWS to MAX_ROWS), its kernels the per-op path's
 * float32 ones: RMSNorm, the GEMM, rotary + cache write, attention, SiLU-and-mul.
 * cpu_decode_step.py checks all that once per stack and per step, and everything else keeps the
 * per-op path. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_entry_points.h"

enum { OK = 0, ERR_SHAPE = 1, ERR_NOMEM = 2, ERR_TOKEN = 4 };
/* A failure is reported as ((layer * STAGES) + stage) * STATUS_RANGE + the kernel's status;
 * STAGE_ENDS (the embedding lookup, final norm and LM head of kvfleet_decode_logits_*) as
 * layer 0's. */
enum {
    STAGE_QKV = 1,
    STAGE_ROTARY_CACHE,
    STAGE_ATTENTION,
    STAGE_O,
    STAGE_GATE_UP,
    STAGE_DOWN,
    STAGE_ENDS
};
#define STAGES 8
#define STATUS_RANGE 16

enum { PROLOGUE_NONE = 0, PROLOGUE_RMS_NORM = 1, PROLOGUE_SILU_AND_MUL = 2 }; /* cpu_gemm.c's */

/* One layer's weights and its K/V caches: bf16 (norm weights bf16, projections packed by
 * cpu_gemm.pack) or float32 (norms plain; projections plain, or QuantWeight structs where the
 * stack says `quantized`), as the entry point called says. */
typedef struct {
    const void *input_norm, *qkv;
    const float *qkv_bias; /* NULL without q/k/v biases */
    const void *o, *post_norm, *gate_up, *down;
    void *k_cache, *v_cache; /* head-major [kv_heads, num_blocks, block_size, head_dim] */
} DecodeLayer;

/* What stays fixed from step to step (cpu_decode_step.py builds it once). */
typedef struct {
    const DecodeLayer *layers;
    int32_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, rot_dim;
    int32_t block_size;
    int64_t num_blocks;
    const float *cos_sin; /* rows of rot_dim / 2 cosines then sines, float32 */
    int64_t cos_sin_stride, max_position;
    float eps, scale;
    /* float32 only: every projection a QuantWeight (cpu_gemm_quant.c). Steps of up to
     * quant_max_rows rows run its in-register GEMM; larger ones dequantize each weight into
     * `scratch` (the largest projection's size) and run the float32 GEMM, as the per-op path
     * does (cpu_decode_step.py sets quant_max_rows from each step's kernel policy). */
    int32_t quantized;
    int64_t quant_max_rows;
    float *scratch;
} DecodeStack;

/* A step's sequences in LlamaModel's batch order: the first num_decodes have one row each (rows
 * 0 .. num_decodes - 1); sequence i after them is a prompt chunk, rows query_start[i] ..
 * query_start[i + 1] - 1 (AttentionMetadata's query_start_loc). A decode-only step has
 * num_seqs == num_decodes == m and may leave query_start NULL. */
typedef struct {
    int32_t num_seqs, num_decodes;
    const int32_t *query_start;
    int32_t prefill_amx; /* bf16 chunks on the AMX prefill kernel, else on the vector one */
} StepSeqs;

/* A float32 step's projection: the plain weight's GEMM or, for a quantized one, its in-register
 * GEMM or the float32 GEMM on the weight dequantized into `scratch`, as the per-op path
 * (dispatch.Kernels.linear) runs them. */
static int project_f32(int quantized, int64_t quant_max_rows, float *scratch, const float *x,
                       int64_t x_stride, const void *w, const float *bias, float *out,
                       int64_t out_stride, int64_t m, int64_t n, int64_t k, int num_threads) {
    if (!quantized)
        return kvfleet_linear_f32(x, x_stride, (const float *)w, bias, out, out_stride, m, n, k,
                                  num_threads);
    if (m <= quant_max_rows)
        return kvfleet_linear_quant(x, x_stride, (const QuantWeight *)w, bias, out, out_stride, m,
                                    n, k, num_threads);
    const int status = kvfleet_dequantize((const QuantWeight *)w, scratch, n, k, num_threads);
    if (status != OK) return status;
    return kvfleet_linear_f32(x, x_stride, scratch, bias, out, out_stride, m, n, k, num_threads);
}

/* A step's activations, one block each: each stays under the mmap threshold the process sets
 * (runtime/engine/cpu_allocator.py, 32 MiB), so a 2048-row step reuses freed heap memory. One
 * block of all of a float32 step's (55 MB at 2048 rows of the bundled model) would be mapped
 * fresh and faulted in on every call: 0.7% of such a step. */
typedef struct {
    void *blocks[5];
    int count;
} Buffers;

static void *take(Buffers *b, size_t bytes) {
    return b->blocks[b->count++] = malloc(bytes);
}

static void release(Buffers *b) {
    for (int i = 0; i < b->count; i++) free(b->blocks[i]);
}

#define FAIL(stage, call)                                                                  \
    do {                                                                                   \
        const int status_ = (call);                                                        \
        if (status_ != OK) {                                                               \
            release(&buffers);                                                             \
            return ((layer * STAGES) + (stage)) * STATUS_RANGE + status_;                  \
        }                                                                                  \
    } while (0)

/* One layer's rotary + cache write, then attention: the decode kernel over the decode rows and
 * the prefill kernel over each prompt chunk, the calls the per-op path makes in both dtypes (the
 * activations' and the caches', elem bytes each). q, k and v are column ranges of the qkv rows.
 * Returns OK, or stage * STATUS_RANGE + the failing kernel's status. */
static int rotate_cache_attend(const DecodeStack *stack, const DecodeLayer *w, char *qkv,
                               char *attn, int dtype, size_t elem, int64_t m,
                               const int64_t *positions, const int64_t *slots,
                               const int32_t *block_tables, int64_t table_stride,
                               const int32_t *seq_lens, const StepSeqs *seqs, int allow_amx,
                               int num_threads) {
    const int64_t d = stack->head_dim;
    const int64_t q_size = stack->num_heads * d, kv_size = stack->num_kv_heads * d;
    const int64_t qkv_n = q_size + 2 * kv_size;
    int status = kvfleet_rotary_and_cache(
        positions, m, qkv, qkv_n, stack->num_heads, qkv + q_size * elem, qkv_n,
        qkv + (q_size + kv_size) * elem, qkv_n, stack->num_kv_heads, (int)d, stack->rot_dim,
        stack->cos_sin, stack->cos_sin_stride, stack->max_position, w->k_cache, w->v_cache, slots,
        stack->num_blocks, stack->block_size, dtype, num_threads);
    if (status != OK) return STAGE_ROTARY_CACHE * STATUS_RANGE + status;
    if (seqs->num_decodes > 0)
        status = kvfleet_decode_attention(qkv, qkv_n, attn, q_size, dtype, w->k_cache, w->v_cache,
                                          dtype, block_tables, table_stride, seq_lens,
                                          seqs->num_decodes, stack->num_heads,
                                          stack->num_kv_heads, (int)d, stack->block_size,
                                          stack->num_blocks, stack->scale, num_threads,
                                          allow_amx);
    for (int32_t i = seqs->num_decodes; i < seqs->num_seqs && status == OK; i++) {
        const int32_t row = seqs->query_start[i], q_len = seqs->query_start[i + 1] - row;
        const char *query = qkv + row * qkv_n * elem;
        char *out = attn + row * q_size * elem;
        const int32_t *table = block_tables + i * table_stride;
        if (dtype == DTYPE_FLOAT32)
            status = kvfleet_prefill_attention_f32(
                (const float *)query, qkv_n, (float *)out, q_size, w->k_cache, w->v_cache, table,
                seq_lens[i], q_len, stack->num_heads, stack->num_kv_heads, (int)d,
                stack->block_size, stack->num_blocks, stack->scale, num_threads);
        else
            status = (seqs->prefill_amx ? kvfleet_prefill_attention_bf16
                                        : kvfleet_prefill_attention_bf16_vec)(
                (const uint16_t *)query, qkv_n, (uint16_t *)out, q_size, w->k_cache, w->v_cache,
                table, seq_lens[i], q_len, stack->num_heads, stack->num_kv_heads, (int)d,
                stack->block_size, stack->num_blocks, stack->scale, num_threads);
    }
    return status == OK ? OK : STAGE_ATTENTION * STATUS_RANGE + status;
}

/* The layer's share of a failure code from rotate_cache_attend. */
#define FAIL_ATTEND(call)                                                                  \
    do {                                                                                   \
        const int failed_ = (call);                                                        \
        if (failed_ != OK) {                                                               \
            release(&buffers);                                                             \
            return layer * STAGES * STATUS_RANGE + failed_;                                \
        }                                                                                  \
    } while (0)

/* A step of m rows (seqs says which sequences they belong to): hidden [m, hidden] bf16 holds
 * their embeddings and becomes the last layer's output; residual [m, hidden] float32 (contents
 * ignored) becomes the residual stream beside it, as LlamaModel.forward's loop leaves them.
 * positions and slots [m] int64; per sequence, block tables int32 rows table_stride apart and
 * seq_lens int32 (this step's tokens included). */
static int step_bf16(const DecodeStack *stack, uint16_t *hidden, float *residual, int64_t m,
                     const int64_t *positions, const int64_t *slots, const int32_t *block_tables,
                     int64_t table_stride, const int32_t *seq_lens, const StepSeqs *seqs,
                     int allow_amx, int num_threads, int gemm_kernel) {
    const int64_t h = stack->hidden, d = stack->head_dim;
    const int64_t q_size = stack->num_heads * d, kv_size = stack->num_kv_heads * d;
    const int64_t qkv_n = q_size + 2 * kv_size, gate_up_n = 2 * (int64_t)stack->intermediate;
    Buffers buffers = {{NULL}, 0};
    const size_t column = (size_t)m * sizeof(uint16_t); /* a column of m rows, in bytes */
    uint16_t *qkv = take(&buffers, column * qkv_n), *attn = take(&buffers, column * q_size);
    uint16_t *gate_up = take(&buffers, column * gate_up_n);
    if (!(qkv && attn && gate_up)) {
        release(&buffers);
        return ERR_NOMEM;
    }

    for (int layer = 0; layer < stack->num_layers; layer++) {
        const DecodeLayer *w = &stack->layers[layer];
        /* The first layer starts the residual stream from the embeddings. */
        FAIL(STAGE_QKV, kvfleet_linear_bf16(hidden, h, PROLOGUE_RMS_NORM, residual, layer > 0,
                                            w->input_norm, stack->eps, w->qkv, w->qkv_bias, qkv,
                                            qkv_n, m, qkv_n, h, gemm_kernel, num_threads));
        FAIL_ATTEND(rotate_cache_attend(stack, w, (char *)qkv, (char *)attn, DTYPE_BFLOAT16,
                                        sizeof(uint16_t), m, positions, slots, block_tables,
                                        table_stride, seq_lens, seqs, allow_amx, num_threads));
        FAIL(STAGE_O, kvfleet_linear_bf16(attn, q_size, PROLOGUE_NONE, NULL, 0, NULL, 0.0f, w->o,
                                          NULL, hidden, h, m, h, q_size, gemm_kernel,
                                          num_threads));
        FAIL(STAGE_GATE_UP,
             kvfleet_linear_bf16(hidden, h, PROLOGUE_RMS_NORM, residual, 1, w->post_norm,
                                 stack->eps, w->gate_up, NULL, gate_up, gate_up_n, m, gate_up_n,
                                 h, gemm_kernel, num_threads));
        FAIL(STAGE_DOWN, kvfleet_linear_bf16(gate_up, gate_up_n, PROLOGUE_SILU_AND_MUL, NULL, 0,
                                             NULL, 0.0f, w->down, NULL, hidden, h, m, h,
                                             stack->intermediate, gemm_kernel, num_threads));
    }
    release(&buffers);
    return OK;
}

/* The float32 step: the same arguments, hidden [m, hidden] float32. The normalised rows and
 * SwiGLU's product get buffers of their own, where the bf16 step's GEMM takes both as prologues
 * of its packing. */
static int step_f32(const DecodeStack *stack, float *hidden, float *residual, int64_t m,
                    const int64_t *positions, const int64_t *slots, const int32_t *block_tables,
                    int64_t table_stride, const int32_t *seq_lens, const StepSeqs *seqs,
                    int allow_amx, int num_threads) {
    const int64_t h = stack->hidden, d = stack->head_dim, inter = stack->intermediate;
    const int64_t q_size = stack->num_heads * d, kv_size = stack->num_kv_heads * d;
    const int64_t qkv_n = q_size + 2 * kv_size, gate_up_n = 2 * inter;
    Buffers buffers = {{NULL}, 0};
    const size_t column = (size_t)m * sizeof(float); /* a column of m rows, in bytes */
    float *normed = take(&buffers, column * h), *qkv = take(&buffers, column * qkv_n);
    float *attn = take(&buffers, column * q_size), *gate_up = take(&buffers, column * gate_up_n);
    float *act = take(&buffers, column * inter);
    if (!(normed && qkv && attn && gate_up && act)) {
        release(&buffers);
        return ERR_NOMEM;
    }
    const float eps = stack->eps;
/* This step's projection through weight w (the stack's kind of weights). */
#define PROJECT(x, x_stride, w, bias, out, out_stride, n, k)                                    \
    project_f32(stack->quantized, stack->quant_max_rows, stack->scratch, x, x_stride, w, bias,   \
                out, out_stride, m, n, k, num_threads)

    for (int layer = 0; layer < stack->num_layers; layer++) {
        const DecodeLayer *w = &stack->layers[layer];
        /* The first layer starts the residual stream from the embeddings. */
        FAIL(STAGE_QKV, kvfleet_add_rms_norm(hidden, h, residual, layer > 0, w->input_norm, normed,
                                             m, (int)h, eps, DTYPE_FLOAT32, num_threads));
        FAIL(STAGE_QKV, PROJECT(normed, h, w->qkv, w->qkv_bias, qkv, qkv_n, qkv_n, h));
        FAIL_ATTEND(rotate_cache_attend(stack, w, (char *)qkv, (char *)attn, DTYPE_FLOAT32,
                                        sizeof(float), m, positions, slots, block_tables,
                                        table_stride, seq_lens, seqs, allow_amx, num_threads));
        FAIL(STAGE_O, PROJECT(attn, q_size, w->o, NULL, hidden, h, h, q_size));
        FAIL(STAGE_GATE_UP, kvfleet_add_rms_norm(hidden, h, residual, 1, w->post_norm, normed, m,
                                                 (int)h, eps, DTYPE_FLOAT32, num_threads));
        FAIL(STAGE_GATE_UP,
             PROJECT(normed, h, w->gate_up, NULL, gate_up, gate_up_n, gate_up_n, h));
        FAIL(STAGE_DOWN, kvfleet_silu_and_mul(gate_up, gate_up_n, act, m, (int)inter,
                                              DTYPE_FLOAT32, num_threads));
        FAIL(STAGE_DOWN, PROJECT(act, inter, w->down, NULL, hidden, h, h, inter));
    }
    release(&buffers);
    return OK;
}
#undef PROJECT

/* The step functions' exported form: num_seqs sequences, the first num_decodes of one row each,
 * the rest prompt chunks starting at query_start's rows (NULL for a decode-only step), bf16
 * chunks on the AMX prefill kernel where prefill_amx is set. */
int kvfleet_stack_step_bf16(const DecodeStack *stack, uint16_t *hidden, float *residual,
                            int64_t m, const int64_t *positions, const int64_t *slots,
                            const int32_t *block_tables, int64_t table_stride,
                            const int32_t *seq_lens, int32_t num_seqs, int32_t num_decodes,
                            const int32_t *query_start, int prefill_amx, int allow_amx,
                            int num_threads, int gemm_kernel) {
    const StepSeqs seqs = {num_seqs, num_decodes, query_start, prefill_amx};
    if (num_decodes < num_seqs && !query_start) return STAGE_ATTENTION * STATUS_RANGE + ERR_SHAPE;
    return step_bf16(stack, hidden, residual, m, positions, slots, block_tables, table_stride,
                     seq_lens, &seqs, allow_amx, num_threads, gemm_kernel);
}

int kvfleet_stack_step_f32(const DecodeStack *stack, float *hidden, float *residual, int64_t m,
                           const int64_t *positions, const int64_t *slots,
                           const int32_t *block_tables, int64_t table_stride,
                           const int32_t *seq_lens, int32_t num_seqs, int32_t num_decodes,
                           const int32_t *query_start, int allow_amx, int num_threads) {
    const StepSeqs seqs = {num_seqs, num_decodes, query_start, 0};
    if (num_decodes < num_seqs && !query_start) return STAGE_ATTENTION * STATUS_RANGE + ERR_SHAPE;
    return step_f32(stack, hidden, residual, m, positions, slots, block_tables, table_stride,
                    seq_lens, &seqs, allow_amx, num_threads);
}

/* What a step runs besides the decoder stack, for the one call from token ids to logits: the
 * embedding table it starts from, the final norm and the LM head it ends with. */
typedef struct {
    const void *embed; /* [vocab, hidden] in the model's dtype */
    int64_t vocab;
    const void *norm;    /* [hidden], the model's dtype */
    const void *lm_head; /* bf16: packed by cpu_gemm.pack; float32: plain [lm_head_rows, hidden]
                          * or, with lm_head_quantized, a QuantWeight */
    int64_t lm_head_rows;
    int32_t lm_head_quantized;
    float *lm_head_scratch; /* a quantized head's dequantized form, for steps past the stack's
                             * quant_max_rows */
} DecodeEnds;

#define ENDS_FAILED(status) ((STAGE_ENDS * STATUS_RANGE) + (status))
enum { WIDEN_MIN_ELEMS = 1 << 16 }; /* below this one thread widens the bf16 logits */

/* m sequences' next-token logits (float32 [m, lm_head_rows]) from their token ids: the
 * embedding rows, the stack's step, the final RMSNorm and the LM head, each the kernel the
 * per-op path calls (LlamaModel.forward, then compute_logits), so the same bits; with `argmax`
 * (else NULL) each row's argmax too, by the kernel greedy sampling calls. Why one call:
 * after a step's kernels the Python and torch calls around them run from cold caches, ~1 ms a
 * step on the 2-core host for the dozen the two-call path makes (cpu_decode_logits.py). The
 * other arguments are kvfleet_stack_step_*'s; gemm_kernel is unused in float32. */
static int decode_logits(const DecodeStack *stack, const DecodeEnds *ends, int dtype,
                         const int64_t *ids, int64_t m, const int64_t *positions,
                         const int64_t *slots, const int32_t *block_tables,
                         int64_t table_stride, const int32_t *seq_lens, float *logits,
                         int64_t *argmax, int allow_amx, int num_threads, int gemm_kernel) {
    const int bf16 = dtype == DTYPE_BFLOAT16;
    const size_t elem = bf16 ? sizeof(uint16_t) : sizeof(float);
    const int64_t h = stack->hidden, n = ends->lm_head_rows;
    for (int64_t i = 0; i < m; i++)
        if (ids[i] < 0 || ids[i] >= ends->vocab) return ENDS_FAILED(ERR_TOKEN);
    /* hidden and its normalised copy in the model's dtype, the float32 residual, and bf16's
     * logits as the GEMM writes them before they widen. */
    const size_t rows_bytes = (size_t)m * h * elem;
    char *buffers = malloc(2 * rows_bytes + (size_t)m * h * sizeof(float) +
                           (bf16 ? (size_t)m * n * sizeof(uint16_t) : 0));
    if (!buffers) return ERR_NOMEM;
    char *hidden = buffers, *normed = hidden + rows_bytes;
    float *residual = (float *)(normed + rows_bytes);
    uint16_t *logits_bf16 = (uint16_t *)(residual + m * h);
    for (int64_t i = 0; i < m; i++)
        memcpy(hidden + i * h * elem, (const char *)ends->embed + ids[i] * h * elem, h * elem);

    const StepSeqs decodes = {(int32_t)m, (int32_t)m, NULL, 0};
    int status = bf16 ? step_bf16(stack, (uint16_t *)hidden, residual, m, positions, slots,
                                  block_tables, table_stride, seq_lens, &decodes, allow_amx,
                                  num_threads, gemm_kernel)
                      : step_f32(stack, (float *)hidden, residual, m, positions, slots,
                                 block_tables, table_stride, seq_lens, &decodes, allow_amx,
                                 num_threads);
    if (status == OK) {
        status = kvfleet_add_rms_norm(hidden, h, residual, 1, ends->norm, normed, m, (int)h,
                                      stack->eps, dtype, num_threads);
        if (status == OK && bf16)
            status = kvfleet_linear_bf16((const uint16_t *)normed, h, PROLOGUE_NONE, NULL, 0,
                                         NULL, 0.0f, ends->lm_head, NULL, logits_bf16, n, m, n,
                                         h, gemm_kernel, num_threads);
        else if (status == OK)
            status = project_f32(ends->lm_head_quantized, stack->quant_max_rows,
                                 ends->lm_head_scratch, (const float *)normed, h, ends->lm_head,
                                 NULL, logits, n, m, n, h, num_threads);
        if (status != OK) status = ENDS_FAILED(status);
    }
    if (status == OK && bf16) {
        /* compute_logits' .float(): bf16 widens exactly, by its bits. */
        const int64_t total = m * n;
        const int team = total < WIDEN_MIN_ELEMS || num_threads < 1 ? 1 : num_threads;
#pragma omp parallel for schedule(static) num_threads(team)
        for (int64_t i = 0; i < total; i++) {
            const uint32_t bits = (uint32_t)logits_bf16[i] << 16;
            memcpy(&logits[i], &bits, sizeof bits);
        }
    }
    if (status == OK && argmax) {
        status = kvfleet_argmax_f32(logits, n, m, n, argmax, num_threads);
        if (status != OK) status = ENDS_FAILED(status);
    }
    free(buffers);
    return status;
}

/* A decode-only step_bf16 from token ids (ids [m] int64) to float32 logits, and with
 * argmax ([m] int64, else NULL) each row's argmax. */
int kvfleet_decode_logits_bf16(const DecodeStack *stack, const DecodeEnds *ends,
                               const int64_t *ids, int64_t m, const int64_t *positions,
                               const int64_t *slots, const int32_t *block_tables,
                               int64_t table_stride, const int32_t *seq_lens, float *logits,
                               int64_t *argmax, int allow_amx, int num_threads,
                               int gemm_kernel) {
    return decode_logits(stack, ends, DTYPE_BFLOAT16, ids, m, positions, slots, block_tables,
                         table_stride, seq_lens, logits, argmax, allow_amx, num_threads,
                         gemm_kernel);
}

/* A decode-only step_f32 from token ids to float32 logits (and argmaxes). */
int kvfleet_decode_logits_f32(const DecodeStack *stack, const DecodeEnds *ends,
                              const int64_t *ids, int64_t m, const int64_t *positions,
                              const int64_t *slots, const int32_t *block_tables,
                              int64_t table_stride, const int32_t *seq_lens, float *logits,
                              int64_t *argmax, int allow_amx, int num_threads) {
    return decode_logits(stack, ends, DTYPE_FLOAT32, ids, m, positions, slots, block_tables,
                         table_stride, seq_lens, logits, argmax, allow_amx, num_threads, 0);
}
