/* The float32 widening path of paged decode attention (cpu_attention.h lists the files): every
 * cache dtype, float32 read in place, bf16 and fp8 widened a block at a time into float32
 * scratch. It is the path of every build: portable C, with AVX2 + FMA or AVX-512 vector forms of
 * its inner loops where the build has them. A file of its own because its hot loop
 * (attend_group_f32 with the static helpers below, in the same translation unit so gcc inlines
 * them) shares nothing with the AVX512-BF16 and AMX paths but the scratch and head_result.
 *
 * Vectorisation: inner loops run over LANES consecutive floats with independent accumulators,
 * a shape gcc -O3 vectorises without -ffast-math (a plain float sum reduction would stay
 * scalar, since reassociating it changes the result). head_dim must be a multiple of LANES.
 */

#include "cpu_attention.h"

static size_t dtype_size(int dtype) {
    return dtype == DTYPE_FLOAT32 ? 4 : dtype == DTYPE_BFLOAT16 ? 2 : 1;
}

/* n fp8 values → float32. With AVX-512, through IEEE half precision: e5m2 is a half's top
 * byte; e4m3fn's exponent and mantissa bits, moved into a half's fields as they stand, are read
 * with the half's exponent bias (15) instead of 7, and one multiply by 2^8 corrects it, for
 * subnormals too (they land on half subnormals, which vcvtph2ps converts exactly at full speed;
 * the same trick through float32's fields hit float32 subnormals, whose microcode assists made
 * the kernel 3x slower, and a 256-entry table lookup was as slow). NaN/inf encodings come out
 * as large finite numbers: writes saturate, so the cache never holds them. n is a multiple of
 * 16 (head_dim is). */
static void widen_fp8(float *restrict dst, const uint8_t *restrict src, int n, int dtype) {
    const int e4m3 = dtype == DTYPE_FP8_E4M3;
#ifdef __AVX512F__
    const __m256i sign = _mm256_set1_epi16((short)0x8000), low7 = _mm256_set1_epi16(0x7F);
    const __m512 rebias = _mm512_set1_ps(e4m3 ? 256.0f : 1.0f);
    for (int i = 0; i < n; i += 16) {
        const __m256i x = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(src + i)));
        const __m256i h =
            e4m3 ? _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi16(x, 8), sign),
                                   _mm256_slli_epi16(_mm256_and_si256(x, low7), 7))
                 : _mm256_slli_epi16(x, 8);
        _mm512_storeu_ps(dst + i, _mm512_mul_ps(_mm512_cvtph_ps(h), rebias));
    }
#else
    for (int i = 0; i < n; i++) { /* the formats' definitions, one value at a time */
        const int x = src[i];
        const int e = e4m3 ? (x >> 3) & 0xF : (x >> 2) & 0x1F, m = e4m3 ? x & 7 : x & 3;
        const int bias = e4m3 ? 7 : 15, mbits = e4m3 ? 3 : 2;
        const float mag = e ? ldexpf(1.0f + (float)m / (float)(1 << mbits), e - bias)
                            : ldexpf((float)m, 1 - bias - mbits);
        dst[i] = (x & 0x80) ? -mag : mag;
    }
#endif
}

/* n bf16 values → float32 (n is a multiple of LANES; vectorises to widen + shift). */
static void widen_bf16(float *restrict dst, const uint16_t *restrict src, int n) {
    for (int i = 0; i < n; i++) dst[i] = bf16_to_f32(src[i]);
}

/* The sum of LANES floats. gcc keeps a lane-by-lane loop scalar (16 dependent adds, the
 * dot's main cost at head_dim 64); with AVX-512 this is four shuffle + add steps. */
static inline float hsum(const float acc[LANES]) {
#ifdef __AVX512F__
    return _mm512_reduce_add_ps(_mm512_loadu_ps(acc));
#else
    float sum = 0.0f;
    for (int l = 0; l < LANES; l++) sum += acc[l];
    return sum;
#endif
}

/* a · b over d floats, d a multiple of LANES. */
static inline float dot(const float *restrict a, const float *restrict b, int d) {
    float acc[LANES] = {0};
    for (int i = 0; i < d; i += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += a[i + l] * b[i + l];
    return hsum(acc);
}

/* score[0..W) = q · k[t] for W rows of k (row stride d, d a multiple of W): the W keys'
 * partial sums stay in vectors and one transpose-and-add tree (REDUCE) sums them all, where
 * per key `dot` ends in a serial chain of scalar adds (on AVX2 that chain took half of a decode
 * step's attention). One body for both vector widths. */
#define DEFINE_SCORE_KEYS(W, VEC, MM, REDUCE)                                                  \
    static inline void score_keys(float *score, const float *restrict q,                      \
                                  const float *restrict k, int d) {                            \
        VEC v[W];                                                                              \
        for (int t = 0; t < W; t++) v[t] = MM##_setzero_ps();                                  \
        for (int i = 0; i < d; i += W) {                                                       \
            const VEC qi = MM##_loadu_ps(q + i);                                               \
            for (int t = 0; t < W; t++)                                                        \
                v[t] = MM##_fmadd_ps(qi, MM##_loadu_ps(k + (size_t)t * d + i), v[t]);          \
        }                                                                                      \
        MM##_storeu_ps(score, REDUCE(v));                                                      \
    }
#ifdef __AVX512F__
#define SCORE_KEYS 16
DEFINE_SCORE_KEYS(16, __m512, _mm512, reduce16)
#elif defined(__AVX2__) && defined(__FMA__)
#define SCORE_KEYS 8
DEFINE_SCORE_KEYS(8, __m256, _mm256, reduce8)
#endif

/* score[t] = q · k[t] for the n valid rows of a block of block_size rows (row stride d). */
static inline void block_scores(float *score, const float *restrict q, const float *restrict k,
                                int n, int block_size, int d) {
#ifdef SCORE_KEYS
    if (block_size % SCORE_KEYS == 0) {
        /* Whole groups of SCORE_KEYS rows: they lie inside the block even past row n. */
        for (int t = 0; t < n; t += SCORE_KEYS) score_keys(score + t, q, k + (size_t)t * d, d);
        return;
    }
#else
    (void)block_size;
#endif
    for (int t = 0; t < n; t++) score[t] = dot(q, k + (size_t)t * d, d);
}

/* The largest of score[0..n). A scalar max over the block is a serial chain of compares, as
 * slow as the dots; max is exact, so the vector forms give the scalar's result. */
static inline float block_max(const float *score, int n) {
#ifdef __AVX512F__
    __m512 m = _mm512_set1_ps(-INFINITY);
    for (int t = 0; t < n; t += 16) {
        const __mmask16 valid = n - t >= 16 ? 0xFFFF : (__mmask16)((1u << (n - t)) - 1);
        m = _mm512_max_ps(m, _mm512_mask_loadu_ps(m, valid, score + t));
    }
    return _mm512_reduce_max_ps(m);
#else
    float m = -INFINITY;
    int t = 0;
#ifdef SCORE_KEYS
    if (n >= 8) {
        __m256 v = _mm256_loadu_ps(score);
        for (t = 8; t + 8 <= n; t += 8) v = _mm256_max_ps(v, _mm256_loadu_ps(score + t));
        float lanes[8];
        _mm256_storeu_ps(lanes, v);
        for (int l = 0; l < 8; l++)
            if (lanes[l] > m) m = lanes[l];
    }
#endif
    for (; t < n; t++)
        if (score[t] > m) m = score[t];
    return m;
#endif
}

/* score[t] = exp(score[t] - m) for t < n; whole vectors may write up to SCORE_PAD entries past
 * n (the scratch has room; those entries are never read). exp16 gives exp_nonpositive's bits;
 * exp8 may differ from it in the last place, so an AVX2 build differs from a scalar one there. */
static inline void block_exp(float *score, int n, float m) {
#ifdef __AVX512F__
    const __m512 mv = _mm512_set1_ps(m);
    for (int t = 0; t < n; t += 16)
        _mm512_storeu_ps(score + t, exp16(_mm512_sub_ps(_mm512_loadu_ps(score + t), mv)));
#elif defined(SCORE_KEYS)
    const __m256 mv = _mm256_set1_ps(m);
    for (int t = 0; t < n; t += 8)
        _mm256_storeu_ps(score + t, exp8(_mm256_sub_ps(_mm256_loadu_ps(score + t), mv)));
#else
    for (int t = 0; t < n; t++) score[t] = exp_nonpositive(score[t] - m);
#endif
}

/* acc[0:d] = acc * corr + sum_t p[t] * v[t, 0:d], for n rows of v (row stride d). NV vectors of
 * W floats (64 floats: four on AVX-512, eight on AVX2) stay in registers across the n rows:
 * NV independent FMA chains, where one or two would leave each row waiting on the FMA's
 * 4-cycle latency (on AVX2 that wait was a third of a decode step's attention). Starts at float
 * i and returns how far it covered; the caller's portable loop does the rest, with the same
 * operations per element (gcc contracts its multiply-add into the same FMA), so the bits do
 * not depend on which loop a slice took. One body for both vector widths. */
#define DEFINE_PV_SLICES(NAME, NV, W, VEC, MM)                                                  \
    static inline int NAME(float *restrict acc, float corr, const float *restrict p,           \
                           const float *restrict v, int n, int d, int i) {                      \
        const VEC c = MM##_set1_ps(corr);                                                       \
        for (; i + NV * W <= d; i += NV * W) {                                                  \
            VEC a[NV];                                                                          \
            for (int j = 0; j < NV; j++) a[j] = MM##_mul_ps(MM##_loadu_ps(acc + i + j * W), c); \
            for (int t = 0; t < n; t++) {                                                       \
                const VEC pt = MM##_set1_ps(p[t]);                                              \
                const float *row = v + (size_t)t * d + i;                                       \
                for (int j = 0; j < NV; j++)                                                    \
                    a[j] = MM##_fmadd_ps(pt, MM##_loadu_ps(row + j * W), a[j]);                 \
            }                                                                                   \
            for (int j = 0; j < NV; j++) MM##_storeu_ps(acc + i + j * W, a[j]);                 \
        }                                                                                       \
        return i;                                                                               \
    }
#ifdef __AVX512F__
DEFINE_PV_SLICES(pv_slices, 4, 16, __m512, _mm512)
#elif defined(SCORE_KEYS)
DEFINE_PV_SLICES(pv_slices, 8, 8, __m256, _mm256)
/* What is left of d past the 64-float slices (head_dim 80, 96, 112, ...), LANES floats at a
 * time. The portable loop's vector form on AVX2 hung on gcc's numbering of its temporaries:
 * half its lanes vectorised in one build, none in another of the same source (16 scalar FMAs a
 * row); this form is the same two FMAs a row in every build. */
DEFINE_PV_SLICES(pv_lanes, 2, 8, __m256, _mm256)
#else
static inline int pv_slices(float *acc, float corr, const float *p, const float *v, int n, int d,
                            int i) {
    (void)acc, (void)corr, (void)p, (void)v, (void)n, (void)d;
    return i;
}
#endif

static inline void accumulate_pv(float *restrict acc, float corr, const float *restrict p,
                                 const float *restrict v, int n, int d) {
    int i = pv_slices(acc, corr, p, v, n, d, 0);
#if defined(SCORE_KEYS) && !defined(__AVX512F__)
    i = pv_lanes(acc, corr, p, v, n, d, i);
#endif
    for (; i < d; i += LANES) {
        float a[LANES];
        for (int l = 0; l < LANES; l++) a[l] = acc[i + l] * corr;
        for (int t = 0; t < n; t++) {
            const float pt = p[t];
            const float *row = v + (size_t)t * d + i;
            for (int l = 0; l < LANES; l++) a[l] += pt * row[l];
        }
        for (int l = 0; l < LANES; l++) acc[i + l] = a[l];
    }
}

/* One task: all `group` query heads that share kv head `kvh`, for `rows` query rows that read
 * the same block table (one row, or a verify step's rows of one sequence: cpu_attention.c), row
 * r's queries at query + r * q_row and its keys [start, ends[r]) (start a multiple of the block
 * size); results as head_result says, row r's at out + r * out_row (part: one row only). Each
 * query's arithmetic is the same whatever else the task holds: a row computed beside others has
 * the bits it has alone, while the rows share every K/V block read. */
void attend_group_f32(Scratch *s, const float *query, int64_t q_row, float *out, int64_t out_row,
                      float *part, const void *k_cache, const void *v_cache, int dtype,
                      const int32_t *table, int start, const int *ends, int rows, int kvh,
                      int group, int head_dim, int block_size, int64_t num_blocks, float scale) {
    const int D = head_dim, queries = rows * group;
    const size_t block_elems = (size_t)block_size * D;
    const size_t block_bytes = block_elems * dtype_size(dtype);

    int end = 0;
    for (int r = 0; r < rows; r++) end = ends[r] > end ? ends[r] : end;
    for (int j = 0; j < queries; j++) {
        const float *qj = query + (j / group) * q_row + (size_t)(j % group) * D;
        for (int i = 0; i < D; i++) s->q[(size_t)j * D + i] = qj[i] * scale;
        memset(s->acc + (size_t)j * D, 0, sizeof(float) * D);
        s->m[j] = -INFINITY;
    }
    memset(s->l, 0, sizeof(float) * (size_t)queries * block_size);

    const int nblocks = (end + block_size - 1) / block_size;
    for (int b = start / block_size; b < nblocks; b++) {
        const int n = (b == nblocks - 1) ? end - b * block_size : block_size; /* valid rows */
        const size_t offset = ((size_t)kvh * num_blocks + (size_t)table[b]) * block_elems;
        /* Blocks are scattered in memory, so the hardware prefetcher cannot run ahead across
         * them: while this block is computed, the next block's K and V lines are asked into L1
         * and the two after it into L2 (locality 1: prefetcht2), a slice of their lines before
         * each head's work. A core holds few outstanding L1 misses: all of the next block's
         * lines asked at once stalled on that queue before any computing started, and went no
         * further ahead; L2's queue is deeper. 96 sequences of 300-700 tokens, float32 cache,
         * Zen 4 (AVX-512 build), in turns: 123-130 -> 82-84 ms a step with shuffled blocks,
         * 96-104 -> 75 ms with consecutive ones. (The bf16 dot path keeps to L1: L2 prefetches
         * there ran slower with shuffled blocks, 72 -> 93 ms, though faster with consecutive
         * ones, 62 -> 47 ms.) The last line of a slice may be asked twice, which costs nothing. */
        const float *k, *v;
        if (dtype == DTYPE_BFLOAT16) {
            widen_bf16(s->kf, (const uint16_t *)k_cache + offset, n * D);
            widen_bf16(s->vf, (const uint16_t *)v_cache + offset, n * D);
            k = s->kf;
            v = s->vf;
        } else if (dtype == DTYPE_FP8_E4M3 || dtype == DTYPE_FP8_E5M2) {
            widen_fp8(s->kf, (const uint8_t *)k_cache + offset, n * D, dtype);
            widen_fp8(s->vf, (const uint8_t *)v_cache + offset, n * D, dtype);
            k = s->kf;
            v = s->vf;
        } else {
            k = (const float *)k_cache + offset;
            v = (const float *)v_cache + offset;
        }

        /* K and V blocks now sit in L1: every query of the task reuses them. */
        for (int j = 0; j < queries; j++) {
            /* A shorter row's keys end here or before: its query skips what lies past them. */
            const int left = ends[j / group] - b * block_size, nj = left < n ? left : n;
            if (nj <= 0) continue;
            const size_t lo = block_bytes * j / queries / 64 * 64;
            const size_t hi = block_bytes * (j + 1) / queries;
            for (int ahead = 1; ahead <= 3 && b + ahead < nblocks; ahead++) {
                const size_t at =
                    ((size_t)kvh * num_blocks + (size_t)table[b + ahead]) * block_bytes;
                const char *ka = (const char *)k_cache + at, *va = (const char *)v_cache + at;
                for (size_t line = lo; line < hi; line += 64) {
                    if (ahead == 1) { /* the locality must be a constant: a call per level */
                        __builtin_prefetch(ka + line);
                        __builtin_prefetch(va + line);
                    } else {
                        __builtin_prefetch(ka + line, 0, 1);
                        __builtin_prefetch(va + line, 0, 1);
                    }
                }
            }
            const float *qj = s->q + (size_t)j * D;
            block_scores(s->score, qj, k, nj, block_size, D);
            const float bmax = block_max(s->score, nj);
            /* Online softmax: rescale what was accumulated under the old max. The first block
             * has m = -inf, so corr = exp(-inf) = 0 against an all-zero accumulator. Most
             * blocks leave the max where it was, and exp_nonpositive(0) is exactly 1: the
             * test skips a serial chain of ~40 cycles a head (15% of the kernel) for the same
             * bits. */
            const float m_new = s->m[j] > bmax ? s->m[j] : bmax;
            const float corr = m_new == s->m[j] ? 1.0f : exp_nonpositive(s->m[j] - m_new);
            block_exp(s->score, nj, m_new);
            /* The softmax denominator is kept per block slot and summed once at the end: a
             * running scalar sum would be a serial chain of adds. */
            float *lj = s->l + (size_t)j * block_size;
            for (int t = 0; t < block_size; t++) lj[t] = lj[t] * corr + (t < nj ? s->score[t] : 0.0f);
            s->m[j] = m_new;
            accumulate_pv(s->acc + (size_t)j * D, corr, s->score, v, nj, D);
        }
    }

    for (int j = 0; j < queries; j++) {
        float l = 0.0f, inv;
        for (int t = 0; t < block_size; t++) l += s->l[(size_t)j * block_size + t];
        float *row_out = out + (j / group) * out_row;
        float *dst = head_result(row_out, part, j % group, D, s->m[j], l, &inv);
        for (int i = 0; i < D; i++) dst[i] = s->acc[(size_t)j * D + i] * inv;
    }
}

