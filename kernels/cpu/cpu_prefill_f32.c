/* Causal prefill attention in float32 arithmetic on AVX-512 or AVX2 + FMA for kvfleet's CPU path: one
 * sequence's query tokens (the last q_len of its seq_len positions) against its K/V read in place
 * from the paged cache, float32 or bf16.
 *
 * Why: float32 is the CPU default where the CPU lacks AVX512-BF16, and there torch's SDPA flash
 * kernel ran at 0.065-0.1 TFLOP/s with head_dim 64 on a 2-core AVX-512 host, a quarter to a
 * third of that host's float32 GEMM rate: 7.9 s of an 85 s standard-workload run.
 *
 * As kernels/cpu/cpu_prefill.c does on AMX tiles, the computation is transposed so that no step
 * needs a horizontal reduction. The 16 lanes of a vector hold 16 rows, a row being one (query
 * token, query head) pair of a kv head's GQA group (row r: token r / G, head r % G), so the G
 * heads that share a K/V row use each of its loads together. A task is one kv head and a tile of
 * TILE rows:
 *   S^T [KEYS keys x TILE rows] = K (each element broadcast from the cache) x Q^T (times scale)
 *   online softmax per lane      (running max and sum; -inf where a key is past a row's position)
 *   O^T [D x TILE rows]          = O^T * correction + V^T (each element broadcast) x P^T
 * Everything stays float32. Results differ from SDPA's by summation order and exp's
 * approximation (within 2 ulp). The tile (its sizes, working memory and inner products) is
 * kernels/cpu/cpu_prefill_tile.h.
 *
 * Short queries against long contexts (a serving step's prompt chunk deep into a long prompt, a
 * suffix after a prefix-cache hit): a last tile of at most LANES rows runs one vector wide, and
 * where a call has fewer than 8 tasks a thread, each tile's keys are split into ranges run as
 * tasks of their own, their partial results merged (merge_parts). The bundled model's 4-token
 * chunk at 3,000 tokens of context was 3 tasks (one 32-row tile per kv head) on 2 threads; split,
 * it takes half the time (2.1x; 16 tokens 1.26x, 48 tokens 1.14x). Against SDPA, float32: 0.31 /
 * 0.81 / 2.16 ms a layer against 1.15 / 1.70 / 3.68 (`kvfleet bench cpu-kernels`).
 *
 * bf16 inputs (kvfleet_prefill_attention_bf16_vec): where the CPU has AVX-512 but no AMX, the
 * AMX kernel cannot run and torch's SDPA flash kernel took 4.4 ms a layer for a 512-token prompt
 * of the bundled model (a third of that prompt's TTFT on a 2-core AVX512-BF16 host). The same
 * tiles and online softmax take bf16, the output rounded to bf16 (nearest even) as written:
 *   with AVX512-BF16, both products run on vdpbf16ps, two bf16 products summed in float32 per
 *   lane: S^T from the query as (d, d+1) pairs against the key's pair read in place from the
 *   cache; O^T from the probabilities rounded to bf16 as (key, key+1) pairs against V, which
 *   is rearranged into key pairs once per call for all tiles (values_as_pairs). 1.32 ms a
 *   layer there for a 512-token prompt, 3.3x SDPA (`kvfleet bench cpu-kernels`).
 *   without it, each step's K and V rows are widened to float32 (exact) into the task's
 *   working memory and the float32 loops run.
 *
 * Layouts: query [q_len, num_heads, head_dim] float32 (or bf16) with token stride q_stride, heads
 * packed; out the same shape, token stride out_stride; k_cache/v_cache the head-major storage
 * [num_kv_heads, num_blocks, block_size, head_dim] of the same type; block_table int32 for this
 * sequence. head_dim a multiple of 16 up to MAX_HEAD_DIM, any block size. Query head h reads
 * kv head h / (num_heads / num_kv_heads).
 *
 * Built with the other CPU kernels by kernels/cpu/cpu_library.py, for AVX-512 or, on CPUs
 * without it, AVX2 + FMA (kvfleet_prefill_f32_lanes says which); with neither the entry points
 * answer ERR_NO_SIMD and the caller keeps SDPA.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_entry_points.h"
#include "cpu_math.h"
#include "cpu_prefill_tile.h"
#include "cpu_vec_f32.h"

enum { OK = 0, ERR_SHAPE = 1, ERR_NOMEM = 2, ERR_NO_SIMD = 3 };

#if PREFILL_SIMD
/* One call's inputs, shared by its tasks. query, out and the caches hold float32, or bf16 where
 * `bf16` is set; vt is the bf16 V as key pairs (AVX512-BF16 only, else NULL). */
typedef struct {
    const void *query, *k_cache, *v_cache;
    void *out;
    const uint32_t *vt;
    const int32_t *table;
    int64_t q_stride, out_stride, head_elems;
    size_t vt_head;
    int seq_len, q_len, group, D, block_size, bf16;
    float scale;
} Call;

/* One task: kv head kvh's rows r0 .. r0 + rows - 1 (of q_len * group) in a tile of nv vectors,
 * against keys [k_begin, k_end), k_begin a multiple of KEYS and visible to every row (at most
 * seq_len - q_len). Writes the normalised output where part is NULL, else O^T unnormalised and
 * each row's running max and sum into part ([D][TILE], then [2][TILE]) for merge_parts. */
static ALWAYS_INLINE void attend(Work *w, const Call *c, int kvh, int r0, int rows, int k_begin,
                                 int k_end, float *part, const int nv) {
    const int D = c->D, group = c->group, block_size = c->block_size, bf16 = c->bf16;
    const int tile = nv * LANES, first_pos = c->seq_len - c->q_len;
    const size_t elem = bf16 ? sizeof(uint16_t) : sizeof(float);
    const char *k_head = (const char *)c->k_cache + kvh * c->head_elems * elem;
    const char *v_head = (const char *)c->v_cache + kvh * c->head_elems * elem;
    const uint32_t *vt = c->vt ? c->vt + kvh * c->vt_head : NULL;
    const int32_t *table = c->table;
    int pos[TILE];
    for (int r = 0; r < tile; r++) {
        /* Padding rows repeat the last row's position and have Q = 0: their outputs are
         * computed like any other and never written. */
        const int row = r0 + (r < rows ? r : rows - 1);
        pos[r] = first_pos + row / group;
        const int64_t q = (int64_t)(row / group) * c->q_stride + (int64_t)(kvh * group + row % group) * D;
        if (bf16 && BF16_DOT) {
            const uint16_t *qb = (const uint16_t *)c->query + q;
            for (int d = 0; d < D; d += 2)
                w->qp[d / 2][r] = r < rows ? (uint32_t)qb[d] | (uint32_t)qb[d + 1] << 16 : 0;
        } else {
            for (int d = 0; d < D; d++)
                w->qt[d][r] = r < rows ? load_act(c->query, q + d, bf16) * c->scale : 0.0f;
        }
    }
    for (int d = 0; d < D; d++) memset(w->ot[d], 0, sizeof(float) * (size_t)tile);
    veci posv[VECS];
    vec m[VECS], l[VECS];
    for (int v = 0; v < nv; v++) {
        posv[v] = vloadi(pos + v * LANES);
        m[v] = vset1(-INFINITY);
        l[v] = vzero();
    }
    const int diagonal = pos[0]; /* keys up to here are visible to every row */

    for (int k0 = k_begin; k0 < k_end; k0 += KEYS) {
        const int n = k_end - k0 < KEYS ? k_end - k0 : KEYS;
        /* Scores come KEY_GROUP keys at a time: the tile's last step scores only the groups
         * its n keys reach. */
        const int scored = (n + KEY_GROUP - 1) / KEY_GROUP * KEY_GROUP;
        const float *krow[KEYS], *vrow[KEYS];
        const uint16_t *kraw[KEYS]; /* bf16 with AVX512-BF16: K rows in place */
        for (int j = 0; j < scored; j++) {
            /* Keys past k_end (never read in P . V) score a valid row, then are masked. */
            const int key = k0 + (j < n ? j : 0);
            const int64_t offset = ((int64_t)table[key / block_size] * block_size +
                                    key % block_size) * D;
            if (bf16) {
                if (BF16_DOT) {
                    kraw[j] = (const uint16_t *)k_head + offset;
                } else {
                    widen_row(w->kw[j], (const uint16_t *)k_head + offset, D);
                    krow[j] = w->kw[j];
                }
                if (!BF16_DOT) {
                    widen_row(w->vw[j], (const uint16_t *)v_head + offset, D);
                    vrow[j] = w->vw[j];
                }
            } else {
                krow[j] = (const float *)k_head + offset;
                vrow[j] = (const float *)v_head + offset;
            }
        }
#if BF16_DOT
        if (bf16)
            for (int j = 0; j < scored; j += KEY_GROUP) scores_bf16(w->p + j, kraw + j, w, D, c->scale, nv);
        else
#endif
            for (int j = 0; j < scored; j += KEY_GROUP) scores(w->p + j, krow + j, w, D, nv);

        vec step_max[VECS];
        for (int v = 0; v < nv; v++) step_max[v] = vset1(-INFINITY);
        const int masked = k0 + scored - 1 > diagonal;
        for (int j = 0; j < scored; j++)
            for (int v = 0; v < nv; v++) {
                vec s = vload(&w->p[j][v * LANES]);
                if (masked) s = mask_past(s, k0 + j, posv[v]);
                vstore(&w->p[j][v * LANES], s);
                step_max[v] = vmax(step_max[v], s);
            }
        /* Online softmax. k_begin is visible to every row, so m is finite from the first step
         * on and corr = exp(-inf) = 0 there, against an all-zero O^T. */
        vec corr[VECS];
        for (int v = 0; v < nv; v++) {
            const vec m_new = vmax(m[v], step_max[v]);
            corr[v] = vexp(vsub(m[v], m_new));
            l[v] = vmul(l[v], corr[v]);
            m[v] = m_new;
        }
        for (int j = 0; j < n; j++)
            for (int v = 0; v < nv; v++) {
                const vec e = vexp(vsub(vload(&w->p[j][v * LANES]), m[v]));
                vstore(&w->p[j][v * LANES], e);
                l[v] = vadd(l[v], e);
            }
#if !BF16_DOT
        (void)vt, (void)kraw;
#else
        if (bf16) {
            probability_pairs(w, n, nv);
            accumulate_bf16(w, vt + (size_t)(k0 / KEYS) * D * (KEYS / 2), n, corr, D, nv);
        } else
#endif
            accumulate(w, vrow, n, corr, D, nv);
    }

    if (part) {
        for (int d = 0; d < D; d++) memcpy(part + d * TILE, w->ot[d], sizeof(float) * (size_t)tile);
        for (int v = 0; v < nv; v++) {
            vstoreu(part + D * TILE + v * LANES, m[v]);
            vstoreu(part + (D + 1) * TILE + v * LANES, l[v]);
        }
        return;
    }
    float inv[TILE];
    for (int v = 0; v < nv; v++) vstoreu(inv + v * LANES, vdiv(vset1(1.0f), l[v]));
    for (int r = 0; r < rows; r++) {
        const int row = r0 + r;
        const int64_t o = (int64_t)(row / group) * c->out_stride + (int64_t)(kvh * group + row % group) * D;
        for (int d = 0; d < D; d++) store_act(c->out, o + d, w->ot[d][r] * inv[r], bf16);
    }
}

/* attend() on tiles of one vector (16 rows on AVX-512) or of VECS. */
static void attend_narrow(Work *w, const Call *c, int kvh, int r0, int rows, int k_begin,
                          int k_end, float *part) {
    attend(w, c, kvh, r0, rows, k_begin, k_end, part, 1);
}
#if VECS > 1
static void attend_wide(Work *w, const Call *c, int kvh, int r0, int rows, int k_begin,
                        int k_end, float *part) {
    attend(w, c, kvh, r0, rows, k_begin, k_end, part, VECS);
}
#else
#define attend_wide attend_narrow
#endif
#endif

/* The vector width this build's kernel runs at: 16 (AVX-512), 8 (AVX2 + FMA) or 0 (none). */
int kvfleet_prefill_f32_lanes(void) {
#if PREFILL_SIMD
    return LANES;
#else
    return 0;
#endif
}

#if PREFILL_SIMD
/* A call's tasks are (kv head, tile) pairs. A short query against a long context has few (a
 * 4-token chunk of a 3-kv-head model: 3, one tile per head), each streaming the whole context on
 * one thread: 2 threads ran two tasks one after the other, the third's thread idle. There each
 * tile's keys are split into ranges, tasks of their own, and the ranges' partial results merged
 * (merge_parts): at least TASKS_PER_THREAD tasks a thread where the keys allow ranges of
 * MIN_SPLIT_KEYS. The ranges follow from the shape and the thread count, so a result's bits
 * do too (the ranges' sums are added in another order), never the scheduling. */
enum { TASKS_PER_THREAD = 8, MIN_SPLIT_KEYS = 256, MAX_SPLITS = 16 };

static int key_splits(int tasks, int first_pos, int num_threads) {
    const int want = TASKS_PER_THREAD * (num_threads < 1 ? 1 : num_threads);
    if (tasks >= want) return 1;
    int splits = (want + tasks - 1) / tasks;
    if (splits > MAX_SPLITS) splits = MAX_SPLITS;
    if (splits > (first_pos + 1) / MIN_SPLIT_KEYS) splits = (first_pos + 1) / MIN_SPLIT_KEYS;
    return splits < 1 ? 1 : splits;
}

/* Where range s of `splits` starts: a multiple of KEYS within the keys every row sees
 * (0 .. first_pos), ranges at least MIN_SPLIT_KEYS - KEYS keys long. */
static int split_start(int s, int splits, int first_pos) {
    return (int)((int64_t)s * (first_pos + 1) / splits / KEYS * KEYS);
}

/* Rows r0 .. r0 + rows - 1 of kv head kvh from the partial results of its `splits` key ranges
 * (parts, (D + 2) x TILE floats each): each range's O^T and sum rescaled to the largest of the
 * ranges' maxima, summed, normalised. */
static void merge_parts(const Call *c, const float *parts, int splits, int kvh, int r0, int rows) {
    const int D = c->D, group = c->group;
    const size_t stride = (size_t)(D + 2) * TILE; /* one range's part */
    for (int r = 0; r < rows; r++) {
        float m = -INFINITY, l = 0.0f, weight[MAX_SPLITS];
        for (int s = 0; s < splits; s++) {
            const float ms = parts[s * stride + D * TILE + r];
            m = ms > m ? ms : m;
        }
        for (int s = 0; s < splits; s++) {
            weight[s] = expf(parts[s * stride + D * TILE + r] - m);
            l += parts[s * stride + (D + 1) * TILE + r] * weight[s];
        }
        const int row = r0 + r;
        const int64_t o = (int64_t)(row / group) * c->out_stride + (int64_t)(kvh * group + row % group) * D;
        for (int d = 0; d < D; d++) {
            float sum = 0.0f;
            for (int s = 0; s < splits; s++) sum += parts[s * stride + d * TILE + r] * weight[s];
            store_act(c->out, o + d, sum / l, c->bf16);
        }
    }
}
#endif

/* Both entry points (layouts in the header comment; bf16 names the element type of query, out
 * and the caches). */
static int prefill(const void *query, int64_t q_stride, void *out, int64_t out_stride,
                   const void *k_cache, const void *v_cache, const int32_t *block_table,
                   int seq_len, int q_len, int num_heads, int num_kv_heads, int head_dim,
                   int block_size, int64_t num_blocks, float scale, int num_threads, int bf16) {
#if !PREFILL_SIMD
    (void)query, (void)q_stride, (void)out, (void)out_stride, (void)k_cache, (void)v_cache;
    (void)block_table, (void)seq_len, (void)q_len, (void)num_heads, (void)num_kv_heads;
    (void)head_dim, (void)block_size, (void)num_blocks, (void)scale, (void)num_threads;
    (void)bf16;
    return ERR_NO_SIMD;
#else
    if (head_dim <= 0 || head_dim % 16 != 0 || head_dim > MAX_HEAD_DIM || block_size <= 0 ||
        num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || q_len <= 0 || q_len > seq_len)
        return ERR_SHAPE;
    const int group = num_heads / num_kv_heads, first_pos = seq_len - q_len;
    const int rows = q_len * group, tiles = (rows + TILE - 1) / TILE;
    const int splits = key_splits(num_kv_heads * tiles, first_pos, num_threads);
    const int tasks = num_kv_heads * tiles * splits;
    /* bf16 with AVX512-BF16: every kv head's V as key pairs, steps of KEYS keys. */
    const int steps = (seq_len + KEYS - 1) / KEYS;
    const size_t vt_head = (size_t)steps * head_dim * (KEYS / 2);
    Call call = {query, k_cache, v_cache, out, NULL, block_table, q_stride, out_stride,
                 num_blocks * block_size * head_dim, vt_head, seq_len, q_len, group, head_dim,
                 block_size, bf16, scale};
    uint32_t *vt = NULL;
    float *parts = NULL; /* each task's partial result where keys are split */
    if (bf16 && BF16_DOT) {
        vt = aligned_alloc(64, ((vt_head * num_kv_heads * sizeof(uint32_t) + 63) / 64) * 64);
        call.vt = vt;
    }
    if (splits > 1) parts = malloc((size_t)tasks * (head_dim + 2) * TILE * sizeof(float));
    if ((bf16 && BF16_DOT && !vt) || (splits > 1 && !parts)) {
        free(vt);
        free(parts);
        return ERR_NOMEM;
    }
    int status = OK;
#pragma omp parallel num_threads(num_threads < 1 ? 1 : num_threads)
    {
#if BF16_DOT
        if (vt) {
#pragma omp for schedule(static)
            for (int task = 0; task < num_kv_heads * steps; task++) {
                const int kvh = task / steps, step = task % steps;
                values_as_pairs(vt + kvh * vt_head + (size_t)step * head_dim * (KEYS / 2),
                                (const uint16_t *)v_cache + kvh * call.head_elems, block_table,
                                seq_len, step * KEYS, head_dim, block_size);
            }
        }
#endif
        /* the loop's implicit barrier: every V pair exists before any tile reads it */
        Work *w = aligned_alloc(64, sizeof(Work));
        if (!w) {
#pragma omp atomic write
            status = ERR_NOMEM;
        }
        /* Later tiles see more keys (causal): hand tasks out one at a time, longest first. A
         * last tile of at most LANES rows runs one vector wide: under LANES rows of padding. */
#pragma omp for schedule(dynamic, 1)
        for (int task = 0; task < tasks; task++) {
            if (!w) continue;
            const int tile = tiles - 1 - task / (num_kv_heads * splits);
            const int kvh = task / splits % num_kv_heads, s = task % splits;
            const int r0 = tile * TILE, n = rows - r0 < TILE ? rows - r0 : TILE;
            const int k_end = s + 1 < splits ? split_start(s + 1, splits, first_pos)
                                             : first_pos + (r0 + n - 1) / group + 1;
            float *part = parts ? parts + ((size_t)(tile * num_kv_heads + kvh) * splits + s) *
                                              (head_dim + 2) * TILE
                                : NULL;
            (n <= LANES ? attend_narrow : attend_wide)(
                w, &call, kvh, r0, n, split_start(s, splits, first_pos), k_end, part);
        }
        free(w);
        if (parts) {
#pragma omp for schedule(static)
            for (int pair = 0; pair < tiles * num_kv_heads; pair++) {
                const int tile = pair / num_kv_heads, r0 = tile * TILE;
                merge_parts(&call, parts + (size_t)pair * splits * (head_dim + 2) * TILE, splits,
                            pair % num_kv_heads, r0, rows - r0 < TILE ? rows - r0 : TILE);
            }
        }
    }
    free(vt);
    free(parts);
    return status;
#endif
}

int kvfleet_prefill_attention_f32(const float *query, int64_t q_stride, float *out,
                                  int64_t out_stride, const float *k_cache, const float *v_cache,
                                  const int32_t *block_table, int seq_len, int q_len,
                                  int num_heads, int num_kv_heads, int head_dim, int block_size,
                                  int64_t num_blocks, float scale, int num_threads) {
    return prefill(query, q_stride, out, out_stride, k_cache, v_cache, block_table, seq_len,
                   q_len, num_heads, num_kv_heads, head_dim, block_size, num_blocks, scale,
                   num_threads, 0);
}

int kvfleet_prefill_attention_bf16_vec(const uint16_t *query, int64_t q_stride, uint16_t *out,
                                          int64_t out_stride, const uint16_t *k_cache,
                                          const uint16_t *v_cache, const int32_t *block_table,
                                          int seq_len, int q_len, int num_heads,
                                          int num_kv_heads, int head_dim, int block_size,
                                          int64_t num_blocks, float scale, int num_threads) {
    return prefill(query, q_stride, out, out_stride, k_cache, v_cache, block_table, seq_len,
                   q_len, num_heads, num_kv_heads, head_dim, block_size, num_blocks, scale,
                   num_threads, 1);
}
