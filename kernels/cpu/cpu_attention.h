/* What the files of paged decode attention share: the driver (cpu_attention.c: tasks, splits,
 * OpenMP, the exported entry point) and its three paths, one file per instruction set, each
 * compiling to nothing where the build lacks that set:
 *   cpu_attention_f32.c   the portable float32 widening path (every cache dtype; AVX2 / AVX-512
 *                         vector forms where the build has them)
 *   cpu_attention_bf16.c  the AVX512-BF16 dot path (bf16 caches)
 *   cpu_attention_amx.c   the AMX tile path (bf16 caches, head_dim 64)
 * Each path's hot loop stays in its own file with every helper it inlines; only the per-task
 * calls cross files. Those functions are hidden, so the shared object exports the kvfleet_* ABI
 * alone. Layouts and the entry point's contract: cpu_attention.c's header comment. */
#ifndef KVFLEET_CPU_ATTENTION_H
#define KVFLEET_CPU_ATTENTION_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "cpu_amx.h"
#include "cpu_entry_points.h"
#include "cpu_math.h"

/* Functions one attention file defines and another calls: out of the library's exports. */
#define ATTENTION_INTERNAL __attribute__((visibility("hidden")))

#define LANES 16 /* floats per portable inner loop; head_dim is a multiple of it */

enum {
    OK = 0,
    ERR_SHAPE = 1, /* head_dim, block_size, head counts or dtype outside what the paths handle */
    ERR_NOMEM = 2, /* per-thread scratch could not be allocated */
};

/* block_exp's whole vectors may write up to SCORE_PAD scores past a block (cpu_attention_f32.c). */
#define SCORE_PAD 16

/* Per-thread working memory, sized for one task's queries (`group` below): a GQA group, times
 * the rows a float32-path task shares its K/V reads among (cpu_attention.c). */
typedef struct {
    float *q;      /* [group, D]  the group's queries, pre-multiplied by scale */
    float *acc;    /* [group, D]  unnormalised output */
    float *kf;     /* [block_size, D]  one K block widened to float32 (bf16, fp8 caches) */
    float *vf;     /* [block_size, D]  one V block widened to float32 (bf16, fp8 caches) */
    float *score;  /* [block_size + SCORE_PAD]  one head's scores, then probabilities, for one
                    * block (block_exp's whole vectors may run past the block) */
    float *m;      /* [group]  running max of the scores */
    float *l;      /* [group, block_size]  running sums of exp(score - m), one per block slot */
    float *p;      /* [group, 32]  probabilities of two 16-row pieces per head (bf16 dot path) */
    uint16_t *qb;  /* [group, D]  the group's queries rounded to bf16, unscaled (bf16 dot path) */
    float *qio;    /* [group, D]  a bf16 query widened (bf16 I/O) */
    float *oio;    /* [group, D]  the output before it is rounded to bf16 (bf16 I/O) */
} Scratch;

/* Where a task's result for one head goes: `out` normalised (the whole context was the
 * task's), or, for one split of a long context, `part` [D + 2]: the unnormalised accumulator,
 * then the running max and sum, for combine_splits. Returns the destination of the D values
 * and sets *inv to what they are multiplied by. */
static inline float *head_result(float *out, float *part, int g, int D, float m, float l,
                                 float *inv) {
    if (part) {
        float *dst = part + (size_t)g * (D + 2);
        dst[D] = m;
        dst[D + 1] = l;
        *inv = 1.0f;
        return dst;
    }
    /* len == 0 (no context) leaves l = 0: write zeros rather than 0/0. */
    *inv = l > 0.0f ? 1.0f / l : 0.0f;
    return out + (size_t)g * D;
}

/* The float32 widening path (cpu_attention_f32.c), for every build. One task: all `group` query
 * heads that share kv head `kvh`, for `rows` rows that read the same block table (row r's queries
 * at query + r * q_row, its keys [start, ends[r]), start a multiple of the block size); results
 * as head_result says, row r's at out + r * out_row (`part`: one row only). */
ATTENTION_INTERNAL void attend_group_f32(Scratch *s, const float *query, int64_t q_row,
                                         float *out, int64_t out_row, float *part,
                                         const void *k_cache, const void *v_cache, int dtype,
                                         const int32_t *table, int start, const int *ends,
                                         int rows, int kvh, int group, int head_dim,
                                         int block_size, int64_t num_blocks, float scale);

#ifdef __AVX512BF16__
/* The bf16 dot path (cpu_attention_bf16.c): bf16 caches, block_size a multiple of 16, head_dim a
 * multiple of 32; the same task and results as attend_group_f32 for one row. */
#define HAVE_BF16_DOT 1

ATTENTION_INTERNAL void attend_group_bf16(Scratch *s, const float *query, float *out, float *part,
                                          const uint16_t *k_cache, const uint16_t *v_cache,
                                          const int32_t *table, int start, int end, int kvh,
                                          int group, int head_dim, int block_size,
                                          int64_t num_blocks, float scale);

/* The maximum of v's lanes, in every lane (stays in vector registers: a scalar max, exp and
 * broadcast per head and chunk was a serial chain as long as the dot products). Used by the
 * bf16 dot and AMX paths. */
static inline __m512 broadcast_max(__m512 v) {
    v = _mm512_max_ps(v, _mm512_shuffle_f32x4(v, v, 0x4E));
    v = _mm512_max_ps(v, _mm512_shuffle_f32x4(v, v, 0xB1));
    v = _mm512_max_ps(v, _mm512_permute_ps(v, 0x4E));
    return _mm512_max_ps(v, _mm512_permute_ps(v, 0xB1));
}
#endif

#ifdef HAVE_AMX
/* The AMX path (cpu_attention_amx.c): bf16 caches, head_dim AMX_HEAD_DIM, blocks of a multiple
 * of 16 tokens, GQA groups of up to 16 heads, whole contexts (no splits). Each thread allocates
 * its AmxScratch (64-byte aligned) and configures its tiles before the first call. */
#define AMX_HEAD_DIM 64

typedef struct {
    uint16_t qt[2 * 16 * 16 * 2]; /* Q^T as two B tiles (dims 0-31, 32-63) */
    float s[32 * 16];             /* S^T of 32 keys */
    uint16_t p[16 * 32];          /* P: one row of 32 bf16 probabilities per head */
    uint16_t vt[4 * 16 * 16 * 2]; /* V of 32 keys as four B tiles (16 dims each) */
    float o[16 * AMX_HEAD_DIM];   /* O when it leaves the tiles */
} AmxScratch;

ATTENTION_INTERNAL void attend_group_amx(AmxScratch *w, const float *query, float *out,
                                         const uint16_t *k_cache, const uint16_t *v_cache,
                                         const int32_t *table, int len, int kvh, int group,
                                         int block_size, int64_t num_blocks, float scale);
#endif

#endif
