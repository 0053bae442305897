/* Paged decode attention for kvfleet's CPU path: one query token per sequence against its
 * paged K/V context, read in place from the head-major cache.
 *
 * Why C: the torch reference gathers every sequence's blocks into a padded [kv_heads, seqs,
 * max_ctx, D] copy and runs tiny batched matmuls; on CPU that costs several times the bytes
 * the step must read. Here each (sequence, kv head) pair is one task that walks its block table,
 * reads each K/V block once for all query heads of its GQA group, and keeps an online softmax
 * (running max, running sum, float32 accumulator) so nothing is padded or materialised; a
 * context past SPLIT_KEYS keys is several tasks, combined at the end (see SPLIT_KEYS), and the
 * rows a verify step gives one sequence share their tasks (see MAX_SHARED_ROWS).
 *
 * Layout (see kernels/reference.py, allocate_kv_cache(head_major=True)):
 *   k_cache, v_cache  [num_kv_heads, num_blocks, block_size, head_dim], contiguous,
 *                     float32 or bfloat16 (bf16 stored as uint16: the top half of a float32),
 *                     or fp8 e4m3fn / e5m2 (one byte each, widened to float32 per block)
 *   query, out        [num_seqs, num_heads, head_dim], heads packed within a sequence's row,
 *                     rows q_stride / out_stride elements apart; float32, or bf16 (io_dtype
 *                     1) so a bf16 model's q needs no float32 copy and its output no cast:
 *                     each task widens its group's queries (exact) and rounds its outputs to
 *                     nearest even, the bits torch's .to() gives
 *   block_tables      int32, row s at block_tables + s * table_stride
 *   seq_lens          int32 [num_seqs]
 * Query head h reads kv head h / (num_heads / num_kv_heads), as in the reference.
 *
 * Three paths by what the CPU offers, one file each, documented there: AMX tiles (bf16,
 * head_dim 64; cpu_attention_amx.c), AVX512-BF16 dot products (bf16; cpu_attention_bf16.c), and
 * the portable float32 widening path (every dtype; cpu_attention_f32.c). This file is the
 * driver: it checks the shapes, cuts contexts into tasks, runs them on OpenMP threads with
 * per-thread scratch, picks each task's path and combines split contexts; cpu_attention.h holds
 * what the files share.
 *
 * Built by kernels/cpu/cpu_library.py: gcc -O3 -march=native -fopenmp -shared -fPIC.
 */

#include "cpu_attention.h"

#define MAX_HEAD_DIM 256
#define MAX_BLOCK_SIZE 256

/* A thread's Scratch (cpu_attention.h) in one allocation, freed through s->q. */
static int scratch_alloc(Scratch *s, int group, int head_dim, int block_size) {
    const size_t gd = (size_t)group * head_dim, bd = (size_t)block_size * head_dim;
    /* + p (group * 32), qb (group * D bf16 = group * D / 2 floats, rounded up), qio, oio. */
    const size_t floats = 2 * gd + 2 * bd + block_size + SCORE_PAD + group +
                          (size_t)group * block_size + (size_t)group * 32 + (gd + 1) / 2 + 2 * gd;
    /* Zeroed: rows of kf past a short last block are read (and their results ignored). */
    float *base = calloc(floats, sizeof(float));
    if (!base) return ERR_NOMEM;
    s->q = base;
    s->acc = s->q + gd;
    s->kf = s->acc + gd;
    s->vf = s->kf + bd;
    s->score = s->vf + bd;
    s->m = s->score + block_size + SCORE_PAD;
    s->l = s->m + group;
    s->p = s->l + (size_t)group * block_size;
    s->qb = (uint16_t *)(s->p + (size_t)group * 32);
    s->qio = s->p + (size_t)group * 32 + (gd + 1) / 2;
    s->oio = s->qio + gd;
    return OK;
}

/* Contexts longer than SPLIT_KEYS keys are cut into ranges of SPLIT_KEYS, one task each, and
 * their partial results combined after (flash-decoding). Why: a decode step of one sequence has
 * one task per KV head (3 for the bundled model), so on 2 threads one of them idled a third of
 * the time, and a long context's task ran on one core's share of memory bandwidth. The cut
 * depends on a sequence's own length only, never on the batch, so a sequence's output does not
 * depend on what else is in the step; contexts up to SPLIT_KEYS keep one task and the same
 * bits as before. A multiple of 32 keys, as the bf16 path takes its pieces in pairs. The AMX
 * path keeps whole contexts (no AMX host to measure it on yet).
 * Measured (2-core Zen 4, bf16 caches, GQA 9/3, head_dim 64, medians of 60 alternating calls
 * against the same code without splits): one sequence 55.6 -> 52.0 us at 2048 keys, 111.7 ->
 * 101.2 at 4096, 213.8 -> 182.3 at 8000 (in another run 20% less at 2048-4096); 2 and 8
 * sequences within +-2%. 512 keys gained up to 16% at 1024 keys alone but cost 3-6% at 4. */
#define SPLIT_KEYS 1024

/* A task's output rows rounded to bf16 (round to nearest even, the bits torch's .to() gives). */
static void store_bf16(uint16_t *dst, const float *src, size_t n) {
    for (size_t i = 0; i < n; i++) dst[i] = f32_to_bf16(src[i]);
}

static int splits_of(int len, int block_size, int whole) {
    if (whole || len <= SPLIT_KEYS || SPLIT_KEYS % block_size) return 1;
    return (len + SPLIT_KEYS - 1) / SPLIT_KEYS;
}

/* The unit whose tasks include `task`: first_task[unit] <= task < first_task[unit + 1]. */
static int unit_of_task(const int *first_task, int units, int task) {
    int lo = 0, hi = units - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (first_task[mid] <= task) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

/* Rows that share a task. A verify step (speculative decoding) gives one sequence a row per
 * token it checks, over the same blocks: each row read every K/V block again, so a 5-row step's
 * attention read the context five times. On the float32 path consecutive rows whose tables agree
 * on every block they read, each context one split long, are one unit of at most
 * MAX_SHARED_ROWS rows, whose tasks read each block once for all of them; a row's bits are the
 * same as alone (attend_group_f32). Units are cut again where fewer than two tasks a thread
 * would be left (one sequence's 5 rows and 3 kv heads: 3 tasks on 2 threads idled one of them
 * half the time). */
#define MAX_SHARED_ROWS 16

static int shares_table(const int32_t *a, const int32_t *b, int len, int block_size) {
    const size_t blocks = (size_t)((len + block_size - 1) / block_size);
    return memcmp(a, b, blocks * sizeof(int32_t)) == 0;
}

/* unit_row[0..units] (returns units): each unit's first row, then num_seqs. */
static int cut_units(int *unit_row, const int32_t *block_tables, int64_t table_stride,
                     const int32_t *seq_lens, int num_seqs, int block_size, int share,
                     int units_wanted) {
    int units = 0;
    for (int row = 0; row < num_seqs; row++) {
        const int first = units ? unit_row[units - 1] : 0;
        const int joins = share && units && row - first < MAX_SHARED_ROWS &&
                          splits_of(seq_lens[row], block_size, 0) == 1 &&
                          splits_of(seq_lens[first], block_size, 0) == 1 &&
                          shares_table(block_tables + (size_t)first * table_stride,
                                       block_tables + (size_t)row * table_stride, seq_lens[row],
                                       block_size);
        if (!joins) unit_row[units++] = row;
    }
    unit_row[units] = num_seqs;
    if (units == num_seqs || units >= units_wanted) return units;
    /* Too few units to keep the threads busy: cut each into up to `pieces` near-equal ones. */
    const int pieces = (units_wanted + units - 1) / units;
    int total = 0;
    int *fresh = malloc(((size_t)num_seqs + 1) * sizeof(int));
    if (!fresh) return units; /* uncut: slower, the same results */
    for (int u = 0; u < units; u++) {
        const int row = unit_row[u], rows = unit_row[u + 1] - row;
        const int n = rows < pieces ? rows : pieces;
        for (int i = 0; i < n; i++) fresh[total++] = row + rows * i / n;
    }
    fresh[total] = num_seqs;
    memcpy(unit_row, fresh, ((size_t)total + 1) * sizeof(int));
    free(fresh);
    return total;
}

/* One (sequence, kv head) pair's output from its `splits` partial results (head_result's
 * layout, split after split): each split's accumulator and sum rescaled to the largest max. */
static void combine_splits(const float *parts, int splits, int group, int D, float *out) {
    const size_t stride = (size_t)group * (D + 2);
    for (int g = 0; g < group; g++) {
        const float *first = parts + (size_t)g * (D + 2);
        float m = -INFINITY, l = 0.0f;
        for (int i = 0; i < splits; i++)
            m = first[i * stride + D] > m ? first[i * stride + D] : m;
        for (int d = 0; d < D; d++) out[(size_t)g * D + d] = 0.0f;
        for (int i = 0; i < splits; i++) {
            const float *part = first + i * stride;
            /* A split whose scores were all -inf (m = -inf) adds nothing. */
            const float w = m == -INFINITY ? 0.0f : exp_nonpositive(part[D] - m);
            l += w * part[D + 1];
            for (int d = 0; d < D; d++) out[(size_t)g * D + d] += w * part[d];
        }
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        for (int d = 0; d < D; d++) out[(size_t)g * D + d] *= inv;
    }
}

/* Entry point (see the header comment for layouts). Returns OK, ERR_SHAPE or ERR_NOMEM; on an
 * error `out` is left partly unwritten and the caller must not use it. */
int kvfleet_decode_attention(const void *query_io, int64_t q_stride, void *out_io,
                             int64_t out_stride, int io_dtype, const void *k_cache,
                             const void *v_cache, int dtype, const int32_t *block_tables,
                             int64_t table_stride, const int32_t *seq_lens, int num_seqs,
                             int num_heads, int num_kv_heads, int head_dim, int block_size,
                             int64_t num_blocks, float scale, int num_threads, int allow_amx) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || head_dim <= 0 ||
        head_dim % LANES != 0 || head_dim > MAX_HEAD_DIM || block_size <= 0 ||
        block_size > MAX_BLOCK_SIZE || dtype < DTYPE_FLOAT32 || dtype > DTYPE_FP8_E5M2 ||
        (io_dtype != DTYPE_FLOAT32 && io_dtype != DTYPE_BFLOAT16) || num_seqs < 0)
        return ERR_SHAPE;
    const int group = num_heads / num_kv_heads;
#ifdef HAVE_AMX
    const int use_amx = allow_amx && dtype == DTYPE_BFLOAT16 && block_size % 16 == 0 &&
                        head_dim == AMX_HEAD_DIM && group <= 16 && amx_permitted();
#else
    (void)allow_amx;
    const int use_amx = 0;
#endif
#ifdef HAVE_BF16_DOT
    const int dot_path = dtype == DTYPE_BFLOAT16 && block_size % 16 == 0 && head_dim % 32 == 0;
#else
    const int dot_path = 0;
#endif
    if (num_threads < 1) num_threads = 1;
    /* Tasks: per unit of rows (one sequence's rows of a verify step on the float32 path, else a
     * row), per kv head, per split (the AMX path takes whole contexts). */
    int *first_task = malloc(((size_t)num_seqs + 1) * sizeof(int));
    int *unit_row = malloc(((size_t)num_seqs + 1) * sizeof(int));
    if (!first_task || !unit_row) {
        free(first_task);
        free(unit_row);
        return ERR_NOMEM;
    }
    /* Two tasks a thread at least, where rows allow: (2 * threads) / kv heads units. */
    const int units_wanted = (2 * num_threads + num_kv_heads - 1) / num_kv_heads;
    const int units = cut_units(unit_row, block_tables, table_stride, seq_lens, num_seqs,
                                block_size, !use_amx && !dot_path, units_wanted);
    first_task[0] = 0;
    int any_split = 0, most_rows = 1;
    for (int u = 0; u < units; u++) {
        const int rows = unit_row[u + 1] - unit_row[u];
        const int n = rows > 1 ? 1 : splits_of(seq_lens[unit_row[u]], block_size, use_amx);
        any_split |= n > 1;
        most_rows = rows > most_rows ? rows : most_rows;
        first_task[u + 1] = first_task[u] + n * num_kv_heads;
    }
    const int tasks = first_task[units];
    const size_t part_floats = (size_t)group * (head_dim + 2);
    float *parts = any_split ? malloc((size_t)tasks * part_floats * sizeof(float)) : NULL;
    if (any_split && !parts) {
        free(first_task);
        free(unit_row);
        return ERR_NOMEM;
    }
    if (num_threads > tasks) num_threads = tasks > 0 ? tasks : 1;
    int status = OK;

#pragma omp parallel num_threads(num_threads)
    {
        Scratch s;
        int mine = scratch_alloc(&s, group * most_rows, head_dim, block_size);
#ifdef HAVE_AMX
        AmxScratch *amx = NULL;
        if (mine == OK && use_amx) {
            amx = aligned_alloc(64, (sizeof(AmxScratch) + 63) / 64 * 64);
            if (amx) configure_tiles();
            else mine = ERR_NOMEM;
        }
#endif
        if (mine != OK) {
#pragma omp atomic write
            status = mine;
        }
        /* Ragged lengths make tasks uneven: hand them out one at a time. */
#pragma omp for schedule(dynamic, 1)
        for (int task = 0; task < tasks; task++) {
            if (mine != OK) continue;
            const int unit = unit_of_task(first_task, units, task);
            const int seq = unit_row[unit], rows = unit_row[unit + 1] - seq;
            const int splits = (first_task[unit + 1] - first_task[unit]) / num_kv_heads;
            const int kvh = (task - first_task[unit]) / splits;
            const int split = (task - first_task[unit]) % splits;
            const int len = seq_lens[seq], start = split * SPLIT_KEYS;
            int ends[MAX_SHARED_ROWS];
            ends[0] = splits == 1 ? len : (len - start < SPLIT_KEYS ? len : start + SPLIT_KEYS);
            for (int r = 1; r < rows; r++) ends[r] = seq_lens[seq + r];
            float *part = splits > 1 ? parts + (size_t)task * part_floats : NULL;
            const size_t head0 = (size_t)kvh * group * head_dim, gd = (size_t)group * head_dim;
            const float *query;
            float *out;
            int64_t q_row = q_stride, out_row = out_stride;
            if (io_dtype == DTYPE_BFLOAT16) {
                for (int r = 0; r < rows; r++) {
                    const uint16_t *qb = (const uint16_t *)query_io + (seq + r) * q_stride + head0;
                    for (size_t i = 0; i < gd; i++) s.qio[r * gd + i] = bf16_to_f32(qb[i]);
                }
                query = s.qio;
                out = s.oio;
                q_row = out_row = (int64_t)gd;
            } else {
                query = (const float *)query_io + seq * q_stride + head0;
                out = (float *)out_io + seq * out_stride + head0;
            }
            const int32_t *table = block_tables + (size_t)seq * table_stride;
#ifdef HAVE_AMX
            if (amx)
                attend_group_amx(amx, query, out, k_cache, v_cache, table, len, kvh, group,
                                 block_size, num_blocks, scale);
            else
#endif
#ifdef HAVE_BF16_DOT
            if (dot_path)
                attend_group_bf16(&s, query, out, part, k_cache, v_cache, table, start, ends[0],
                                  kvh, group, head_dim, block_size, num_blocks, scale);
            else
#endif
                attend_group_f32(&s, query, q_row, out, out_row, part, k_cache, v_cache, dtype,
                                 table, start, ends, rows, kvh, group, head_dim, block_size,
                                 num_blocks, scale);
            if (io_dtype == DTYPE_BFLOAT16 && !part)
                for (int r = 0; r < rows; r++)
                    store_bf16((uint16_t *)out_io + (seq + r) * out_stride + head0,
                               s.oio + r * gd, gd);
        }
        /* (The loop's barrier:) every split's part is written. */
        if (any_split) {
#pragma omp for schedule(dynamic, 1)
            for (int pair = 0; pair < units * num_kv_heads; pair++) {
                const int unit = pair / num_kv_heads, kvh = pair % num_kv_heads;
                const int splits = (first_task[unit + 1] - first_task[unit]) / num_kv_heads;
                if (splits == 1 || mine != OK || status != OK) continue;
                const int seq = unit_row[unit]; /* a split context is a unit of one row */
                const size_t head0 = (size_t)kvh * group * head_dim, gd = (size_t)group * head_dim;
                const float *own = parts + (size_t)(first_task[unit] + kvh * splits) * part_floats;
                if (io_dtype == DTYPE_BFLOAT16) {
                    combine_splits(own, splits, group, head_dim, s.oio);
                    store_bf16((uint16_t *)out_io + seq * out_stride + head0, s.oio, gd);
                } else {
                    combine_splits(own, splits, group, head_dim,
                                   (float *)out_io + seq * out_stride + head0);
                }
            }
        }
#ifdef HAVE_AMX
        if (amx) {
            _tile_release();
            free(amx);
        }
#endif
        if (mine == OK) free(s.q);
    }
    free(parts);
    free(first_task);
    free(unit_row);
    return status;
}

/* Which attention path this build uses for bf16 caches: 1 the AVX512-BF16 dot path, 0 the
 * widening path. Lets the tests check that a machine with AVX512-BF16 really runs it. */
int kvfleet_cpu_attention_bf16_dot(void) {
#ifdef HAVE_BF16_DOT
    return 1;
#else
    return 0;
#endif
}

/* Whether bf16 caches with head_dim 64 (blocks of a multiple of 16) take the AMX path here: the
 * build targets AMX and the process got the tiles. */
int kvfleet_cpu_attention_amx(void) {
#ifdef HAVE_AMX
    return amx_permitted();
#else
    return 0;
#endif
}
