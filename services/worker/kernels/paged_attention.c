/* Paged attention for CPUs over one packed step: every sequence's new query
 * rows (a prefill chunk, or one decode token) attend causally to their context,
 * reading K/V in place through the sequence's block table (no gather, no
 * padding). The new tokens' K/V are already in the pool when this runs.
 *
 * Layout (one layer of the worker's pool, see kv_cache.py):
 *   q, out        [num_rows, num_heads, head_dim]          contiguous, the step's packed rows
 *   key, value    [num_slots, num_kv_heads, head_dim]      contiguous
 *   block_tables  [num_seqs, max_blocks]                   int64, slot = block * block_size + offset
 *   starts        [num_seqs]                               int64, the sequence's first packed row
 *   num_new       [num_seqs]                               int64, its rows
 *   context_lens  [num_seqs]                               int64, its context, new rows included
 * head_dim must be a multiple of 16 and heads / kv_heads at most MAX_GROUP
 * (cpu_kernels.py checks both and falls back to SDPA otherwise).
 *
 * A task is one (sequence, tile of up to TILE rows, KV head): the tile's rows
 * times the query heads that share the KV head are scored against the keys any
 * of them sees, each against its own causal (and sliding-window) range; scores,
 * softmax and sums are float32, and only the output is rounded to the cache
 * dtype, as SDPA rounds it. Each K and V row loaded serves every query of the tile.
 *
 * Written with the vector helpers of simd.h; cpu_kernels.py builds with
 * -march=native and -fopenmp. The OpenMP runtime is torch's own (same soname),
 * so the kernel runs on torch's thread team. */
#include "simd.h"

#define MAX_GROUP 16
#define TILE 16     /* query rows per prefill task */
#define KEY_BLOCK 128 /* keys converted to float32 at a time */
/* Tiles of at most this many rows (a decode with a speculative draft, a prompt's
 * last few rows) run on the vdpbf16ps row paths where they exist: one row per
 * task, or a few rows together (attend_rows_dp) where they make at least
 * ROWS_DP_QUERIES queries. One sequence over 560 keys, the bundled model's 30
 * layers (9 query heads, 3 KV heads), 2 threads, Zen 4: 9 rows took 2.7 ms
 * together against 4.0 one per task, 5 rows 2.0 against 2.5, 4 rows 1.8
 * against 2.1; 3 rows 1.75 either way, and 2 rows 1.5 together against 1.3.
 * Against a tile (attend_tile), one row per task was faster up to 12 rows, a
 * full tile of 16 rows faster as a tile (and 1.4 times in a 400-token prefill). */
#define ROWS_AS_DECODES 12
#define ROWS_DP_QUERIES 12

/* The first key a query at `position` sees: 0, or the start of its sliding window. */
INLINE int64_t first_key(int64_t position, int64_t window) {
    return window > 0 && position + 1 > window ? position + 1 - window : 0;
}

/* Softmax of n scores in place (n >= 1). `scores` has room for n rounded up to
 * whole vectors; the lanes past n are overwritten. */
INLINE void softmax(float *scores, int64_t n) {
    const i32x16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const f32x16 zero = {0};
    f32x16 top = zero + scores[0];
    for (int64_t i = 0; i < n; i += LANES) {
        const f32x16 v = select16(lane < (int32_t)(n - i), load16(scores, i, 0), top);
        top = select16(v > top, v, top);
    }
    float max = top[0];
    for (int i = 1; i < LANES; i++) max = top[i] > max ? top[i] : max;
    f32x16 total = zero;
    for (int64_t i = 0; i < n; i += LANES) {
        const f32x16 v = select16(lane < (int32_t)(n - i), exp16(load16(scores, i, 0) - max), zero);
        store16(v, scores, i, 0);
        total += v;
    }
    const float inverse = 1.0f / sum16(total);
    for (int64_t i = 0; i < n; i += LANES) store16(load16(scores, i, 0) * inverse, scores, i, 0);
}

/* Queries [q0, q0 + count) of a tile take their share of one block of m keys
 * (float32, [m][head_dim]) into their sums; count and chunks constant when inlined. */
INLINE void accumulate_values(f32x16 *acc, const float *weights, int64_t weight_stride, const float *values,
                              int64_t m, int64_t q0, int64_t count, int64_t chunks) {
    f32x16 a[count][chunks];
    for (int64_t i = 0; i < count; i++)
        for (int64_t c = 0; c < chunks; c++) a[i][c] = acc[(q0 + i) * chunks + c];
    for (int64_t j = 0; j < m; j++) {
        const f32x16 *v = (const f32x16 *)(values + j * chunks * LANES);
        for (int64_t i = 0; i < count; i++) {
            const float w = weights[j * weight_stride + q0 + i];
            for (int64_t c = 0; c < chunks; c++) a[i][c] += w * v[c];
        }
    }
    for (int64_t i = 0; i < count; i++)
        for (int64_t c = 0; c < chunks; c++) acc[(q0 + i) * chunks + c] = a[i][c];
}

/* Keys [start, start + m) of the sequence, K or V of head h, as float32 [m][head_dim].
 * Rows of the next block are prefetched while this one converts: blocks lie
 * anywhere in the pool, so the hardware prefetcher cannot run ahead across them. */
INLINE void load_keys(const void *cache, const int64_t *table, int64_t start, int64_t m, int64_t h,
                      int64_t num_kv_heads, int64_t block_size, int64_t chunks, float *dst, int bf16) {
    const int64_t row_bytes = chunks * LANES * (bf16 ? 2 : 4);
    for (int64_t p = start; p < start + m;) {
        const int64_t offset = p % block_size, count = MIN(block_size - offset, start + m - p);
        const int64_t row = (table[p / block_size] * block_size + offset) * num_kv_heads + h;
        const int64_t ahead = MIN(block_size, start + m - (p + count)); /* rows of the next block we use */
        if (ahead > 0) {
            const char *next = (const char *)cache + (table[(p + count) / block_size] * block_size * num_kv_heads + h) * row_bytes;
            for (int64_t j = 0; j < ahead; j++)
                for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(next + j * num_kv_heads * row_bytes + b);
        }
        for (int64_t j = 0; j < count; j++, p++)
            for (int64_t c = 0; c < chunks; c++) {
                const f32x16 v = load16(cache, (row + j * num_kv_heads) * chunks * LANES + c * LANES, bf16);
                memcpy(dst + ((p - start) * chunks + c) * LANES, &v, sizeof v);
            }
    }
}

/* The sums of 16 vectors as one vector: lane i = the sum of v[i]. A tree of
 * shuffles and adds that halves the width at each level (45 operations where
 * 16 horizontal sums take about 150); its lanes come out in bit-reversed order. */
INLINE f32x16 sum16x16(const f32x16 *v) {
    f32x16 w[8], x[4], y[2];
    for (int i = 0; i < 8; i++)
        w[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++)
        x[i] = __builtin_shufflevector(w[2 * i], w[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
               __builtin_shufflevector(w[2 * i], w[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++)
        y[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
               __builtin_shufflevector(x[2 * i], x[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    const f32x16 z = __builtin_shufflevector(y[0], y[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
                     __builtin_shufflevector(y[0], y[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
    return __builtin_shufflevector(z, z, 0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15);
}

/* Decode (one query row at position pos0): the `group` query heads of KV head
 * h. Keys come in blocks converted to float32; each head scores 16 keys at a
 * time with one reduction tree for the 16 dot products, and sums the values in
 * registers. Inlined with a constant `chunks` for the common head sizes. */
INLINE void attend_row(const void *q, const void *key, const void *value, const int64_t *table, void *out,
                       int64_t row0, int64_t pos0, int64_t h, int64_t num_heads, int64_t num_kv_heads,
                       int64_t block_size, int64_t group, int64_t chunks, float scale, int64_t window,
                       float *scratch, int bf16) {
    const int64_t head_dim = chunks * LANES, q_index = (row0 * num_heads + h * group) * head_dim;
    const int64_t first = first_key(pos0, window), n = pos0 + 1 - first;
    const int64_t stride = (n + LANES - 1) / LANES * LANES;
    f32x16 *qv = (f32x16 *)scratch, *acc = qv + group * chunks;
    float *scores = (float *)(acc + group * chunks), *block = scores + group * stride;

    for (int64_t c = 0; c < group * chunks; c++) qv[c] = load16(q, q_index + c * LANES, bf16) * scale;
    for (int64_t start = first; start <= pos0; start += KEY_BLOCK) {
        const int64_t m = MIN(KEY_BLOCK, pos0 + 1 - start);
        load_keys(key, table, start, m, h, num_kv_heads, block_size, chunks, block, bf16);
        for (int64_t j0 = 0; j0 < m; j0 += LANES) {
            const int64_t count = MIN(LANES, m - j0);
            for (int64_t g = 0; g < group; g++) {
                f32x16 dots[LANES];
                for (int64_t j = 0; j < LANES; j++) {
                    dots[j] = qv[0] * 0.0f;
                    if (j >= count) continue;
                    const f32x16 *k = (const f32x16 *)(block + (j0 + j) * head_dim);
                    for (int64_t c = 0; c < chunks; c++) dots[j] += qv[g * chunks + c] * k[c];
                }
                const f32x16 sums = sum16x16(dots);
                memcpy(scores + g * stride + (start - first) + j0, &sums, (size_t)count * sizeof(float));
            }
        }
    }
    for (int64_t g = 0; g < group; g++) softmax(scores + g * stride, n);
    for (int64_t c = 0; c < group * chunks; c++) acc[c] = qv[0] * 0.0f;
    for (int64_t start = first; start <= pos0; start += KEY_BLOCK) {
        const int64_t m = MIN(KEY_BLOCK, pos0 + 1 - start);
        load_keys(value, table, start, m, h, num_kv_heads, block_size, chunks, block, bf16);
        for (int64_t g = 0; g < group; g++) {
            const float *w = scores + g * stride + (start - first);
            f32x16 a[chunks], b[chunks]; /* two partial sums: consecutive keys do not wait on each other */
            for (int64_t c = 0; c < chunks; c++) a[c] = acc[g * chunks + c], b[c] = qv[0] * 0.0f;
            int64_t j = 0;
            for (; j + 2 <= m; j += 2) {
                const f32x16 *v0 = (const f32x16 *)(block + j * head_dim), *v1 = v0 + chunks;
                for (int64_t c = 0; c < chunks; c++) a[c] += w[j] * v0[c], b[c] += w[j + 1] * v1[c];
            }
            if (j < m)
                for (int64_t c = 0; c < chunks; c++) a[c] += w[j] * ((const f32x16 *)(block + j * head_dim))[c];
            for (int64_t c = 0; c < chunks; c++) acc[g * chunks + c] = a[c] + b[c];
        }
    }
    for (int64_t c = 0; c < group * chunks; c++) store16(acc[c], out, q_index + c * LANES, bf16);
}

typedef void (*rows_dp_fn)(const uint16_t *q, const uint16_t *key, const uint16_t *value, const int64_t *table,
                           uint16_t *out, int64_t row0, int64_t rows, int64_t pos0, int64_t h, int64_t num_heads,
                           int64_t num_kv_heads, int64_t block_size, int64_t group, float scale, int64_t window,
                           float *scratch);
typedef void (*row_dp_fn)(const uint16_t *q, const uint16_t *key, const uint16_t *value, const int64_t *table,
                          uint16_t *out, int64_t row0, int64_t pos0, int64_t h, int64_t num_heads,
                          int64_t num_kv_heads, int64_t block_size, int64_t group, float scale, int64_t window,
                          float *scratch);

#if defined(__AVX512BF16__)
#include <immintrin.h>
/* Element offsets in K and V of head h's rows for the sequence's keys
 * [start, start + m), through its block table. */
INLINE void key_rows(const int64_t *table, int64_t start, int64_t m, int64_t h, int64_t num_kv_heads,
                     int64_t block_size, int64_t head_dim, int64_t *rows) {
    for (int64_t i = 0, b = start / block_size, o = start % block_size; i < m; i++) {
        rows[i] = ((table[b] * block_size + o) * num_kv_heads + h) * head_dim;
        if (++o == block_size) o = 0, b++;
    }
}

/* Both cache lines (or more) of one bfloat16 row of head_dim values, into L2. */
INLINE void prefetch_row(const uint16_t *row, int64_t head_dim) {
    for (int64_t b = 0; b < head_dim * 2; b += 64) __builtin_prefetch((const char *)row + b, 0, 1);
}

/* The weighted sums of the value rows (bfloat16, converted once per row in
 * registers) for `count` queries: acc[i] = sum over keys j < n of
 * weights[i * query_stride + j * key_stride] * V[j], float32. */
INLINE void sum_values(const uint16_t *value, const int64_t *rows, const float *weights, int64_t query_stride,
                       int64_t key_stride, int64_t n, int64_t count, int64_t chunks, f32x16 acc[4][8]) {
    /* Fixed sizes (count <= 4, chunks <= 8), used up to count x chunks: with the
     * loops unrolled they live in registers, where a variable-length array would not. */
    f32x16 v[8];
#pragma GCC unroll 4
    for (int64_t i = 0; i < count; i++)
#pragma GCC unroll 8
        for (int64_t c = 0; c < chunks; c++) acc[i][c] = (f32x16)_mm512_setzero_ps();
    for (int64_t j = 0; j < n; j++) {
#pragma GCC unroll 8
        for (int64_t c = 0; c < chunks; c++) v[c] = load16(value, rows[j] + c * LANES, 1);
#pragma GCC unroll 4
        for (int64_t i = 0; i < count; i++) {
            const float w = weights[i * query_stride + j * key_stride];
#pragma GCC unroll 8
            for (int64_t c = 0; c < chunks; c++) acc[i][c] += w * v[c];
        }
    }
}

/* Decode rows of a bfloat16 pool on a CPU with AVX512_BF16, head_dim a
 * multiple of 32: the same math as attend_row, with fewer instructions per key.
 * Scores come straight from the bfloat16 rows (vdpbf16ps: exact products
 * summed in float32, the query unscaled and the scale applied to the sums), 16
 * keys at a time with one reduction tree; each value row is converted once in
 * registers and serves every query head of the group. Each key's row offset
 * is worked out once for both K and V. Decode attention reads the whole
 * context from memory every step, and blocks lie anywhere in the pool, so
 * rows are prefetched well ahead: keys two groups of 16 ahead, and each
 * group's values while its keys are scored (without either, 32 decodes over
 * 250-token contexts took 20 ms per step instead of 12 on a Zen 5 VM). The
 * prefetches go into L2 and are spread over the group's heads, a few rows at
 * a time: issued 16 rows at once into L1 they stalled the loop, and the same
 * 32 decodes took 18.7 ms per step instead of 11.3 on a Zen 4 VM. */
INLINE void attend_row_dp(const uint16_t *q, const uint16_t *key, const uint16_t *value, const int64_t *table,
                          uint16_t *out, int64_t row0, int64_t pos0, int64_t h, int64_t num_heads,
                          int64_t num_kv_heads, int64_t block_size, int64_t group, int64_t chunks, float scale,
                          int64_t window, float *scratch) {
    const int64_t head_dim = chunks * LANES, pairs = chunks / 2, q_index = (row0 * num_heads + h * group) * head_dim;
    const int64_t first = first_key(pos0, window), n = pos0 + 1 - first;
    const int64_t stride = (n + LANES - 1) / LANES * LANES;
    float *scores = scratch;                           /* [group][stride] */
    int64_t *rows = (int64_t *)(scores + group * stride); /* [stride]: each key's element offset in K and V */

    key_rows(table, first, n, h, num_kv_heads, block_size, head_dim, rows);
    for (int64_t i = n; i < stride; i++) rows[i] = rows[n - 1];
    for (int64_t j = 0; j < MIN(2 * LANES, n); j++) prefetch_row(key + rows[j], head_dim);
    for (int64_t j0 = 0; j0 < n; j0 += LANES) {
        const int64_t count = MIN(LANES, n - j0);
        for (int64_t g = 0; g < group; g++) {
            /* This head's share of the prefetches (a few keys' rows, not all
             * 16 at once): keys two groups ahead, and this group's values. */
            for (int64_t j = j0 + g * LANES / group; j < MIN(j0 + (g + 1) * LANES / group, n); j++) {
                if (j + 2 * LANES < n) prefetch_row(key + rows[j + 2 * LANES], head_dim);
                prefetch_row(value + rows[j], head_dim);
            }
            __m512bh qb[4]; /* pairs <= 4 */
            for (int64_t c = 0; c < pairs; c++)
                qb[c] = (__m512bh)_mm512_loadu_si512(q + q_index + g * head_dim + c * 2 * LANES);
            f32x16 dots[LANES];
            for (int64_t j = 0; j < LANES; j++) {
                __m512 d = _mm512_setzero_ps();
                for (int64_t c = 0; c < pairs; c++)
                    d = _mm512_dpbf16_ps(d, qb[c], (__m512bh)_mm512_loadu_si512(key + rows[j0 + j] + c * 2 * LANES));
                dots[j] = (f32x16)d;
            }
            const f32x16 sums = sum16x16(dots) * scale;
            memcpy(scores + g * stride + j0, &sums, (size_t)count * sizeof(float));
        }
    }
    for (int64_t g = 0; g < group; g++) softmax(scores + g * stride, n);
    /* Value sums in registers, for up to 4 heads at a time (2 of head_dim over
     * 64), so that each value row is converted once for as many heads as fit. */
    const int64_t most = chunks <= 4 ? 4 : 2;
    for (int64_t g = 0, count; g < group; g += count) {
        count = MIN(most, group - g);
        f32x16 acc[4][8];
        const float *weights = scores + g * stride;
        switch (count) { /* constant counts, so that each call unrolls */
            case 4: sum_values(value, rows, weights, stride, 1, n, 4, chunks, acc); break;
            case 3: sum_values(value, rows, weights, stride, 1, n, 3, chunks, acc); break;
            case 2: sum_values(value, rows, weights, stride, 1, n, 2, chunks, acc); break;
            default: sum_values(value, rows, weights, stride, 1, n, 1, chunks, acc);
        }
        for (int64_t i = 0; i < count; i++)
#pragma GCC unroll 8
            for (int64_t c = 0; c < chunks; c++) store16(acc[i][c], out, q_index + (g + i) * head_dim + c * LANES, 1);
    }
}

/* One function per head size, so that each gets its own registers (inlined
 * into the task loop, the sums spill to memory). */
#define ROW_DP_ARGS                                                                                            \
    const uint16_t *q, const uint16_t *key, const uint16_t *value, const int64_t *table, uint16_t *out,       \
        int64_t row0, int64_t pos0, int64_t h, int64_t num_heads, int64_t num_kv_heads, int64_t block_size,  \
        int64_t group, float scale, int64_t window, float *scratch
#define ROW_DP(CHUNKS)                                                                                         \
    static __attribute__((noinline)) void attend_row_dp_##CHUNKS(ROW_DP_ARGS) {                                \
        attend_row_dp(q, key, value, table, out, row0, pos0, h, num_heads, num_kv_heads, block_size, group,   \
                      CHUNKS, scale, window, scratch);                                                         \
    }
ROW_DP(2)
ROW_DP(4)
ROW_DP(6)
ROW_DP(8)
#undef ROW_DP
#undef ROW_DP_ARGS
#define HAVE_ROW_DP 1
#else
#define HAVE_ROW_DP 0
#endif

/* Scores of `count` keys (float32 rows of `block`, from row j on) against every
 * query vector of a tile: up to 4 keys times 4 query vectors of independent
 * sums, so the FMAs are not waiting on one another. */
INLINE void score_vectors(const f32x16 *qt, int64_t vectors, int64_t v0, int64_t nv, const float *block,
                          int64_t head_dim, int64_t j, int64_t count, f32x16 *scores) {
    f32x16 a[count][nv];
    for (int64_t k = 0; k < count; k++)
        for (int64_t v = 0; v < nv; v++) a[k][v] = qt[0] * 0.0f;
    for (int64_t d = 0; d < head_dim; d++) {
        const f32x16 *qd = qt + d * vectors + v0;
        for (int64_t k = 0; k < count; k++) {
            const float key = block[(j + k) * head_dim + d];
            for (int64_t v = 0; v < nv; v++) a[k][v] += qd[v] * key;
        }
    }
    for (int64_t k = 0; k < count; k++)
        for (int64_t v = 0; v < nv; v++) scores[(j + k) * vectors + v0 + v] = a[k][v];
}

INLINE void score_keys(const f32x16 *qt, int64_t vectors, const float *block, int64_t head_dim, int64_t j,
                       int64_t count, f32x16 *scores) {
    int64_t v0 = 0;
    for (; v0 + 4 <= vectors; v0 += 4) score_vectors(qt, vectors, v0, 4, block, head_dim, j, count, scores);
    switch (vectors - v0) {
        case 3: score_vectors(qt, vectors, v0, 3, block, head_dim, j, count, scores); break;
        case 2: score_vectors(qt, vectors, v0, 2, block, head_dim, j, count, scores); break;
        case 1: score_vectors(qt, vectors, v0, 1, block, head_dim, j, count, scores); break;
    }
}

#if HAVE_ROW_DP
/* The queries of rows [row0, ...) times the `group` query heads of KV head h
 * (`queries` in all) as bfloat16 pairs across `vectors` vectors: lane i of
 * qp[p][v] holds query 16 v + i's elements 2 p and 2 p + 1; lanes past the
 * queries hold zeros. */
INLINE void pack_query_pairs(const uint16_t *q, int64_t row0, int64_t queries, int64_t vectors, int64_t h,
                             int64_t num_heads, int64_t group, int64_t head_dim, int32_t *qp) {
    const int64_t pairs = head_dim / 2;
    memset(qp, 0, sizeof(int32_t) * (size_t)(pairs * vectors * LANES));
    for (int64_t i = 0; i < queries; i++) {
        const int64_t index = ((row0 + i / group) * num_heads + h * group + i % group) * head_dim;
        for (int64_t p = 0; p < pairs; p++)
            memcpy(qp + (p * vectors + i / LANES) * LANES + i % LANES, q + index + 2 * p, sizeof(int32_t));
    }
}

/* Scores of `count` keys (bfloat16 rows of the cache, at element offsets
 * `rows`) against query vectors [v0, v0 + nv) of a tile whose queries are
 * stored as bfloat16 pairs (`qp`: [pairs][vectors], lane i of vector v holds
 * query 16 v + i's elements 2 p and 2 p + 1). Each key's pair broadcast to
 * every lane makes one vdpbf16ps per pair and vector: half the instructions of
 * float32 FMAs, and no conversion of the keys. */
INLINE void score_pairs(const __m512bh *qp, int64_t vectors, int64_t v0, int64_t nv, const uint16_t *key,
                        const int64_t *rows, int64_t pairs, int64_t count, float scale, f32x16 *scores) {
    __m512 a[count][nv];
    for (int64_t k = 0; k < count; k++)
        for (int64_t v = 0; v < nv; v++) a[k][v] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        for (int64_t k = 0; k < count; k++) {
            int32_t pair;
            memcpy(&pair, key + rows[k] + 2 * p, sizeof pair);
            const __m512bh kb = (__m512bh)_mm512_set1_epi32(pair);
            for (int64_t v = 0; v < nv; v++) a[k][v] = _mm512_dpbf16_ps(a[k][v], qp[p * vectors + v0 + v], kb);
        }
    }
    for (int64_t k = 0; k < count; k++)
        for (int64_t v = 0; v < nv; v++) scores[k * vectors + v0 + v] = (f32x16)a[k][v] * scale;
}

INLINE void score_key_pairs(const __m512bh *qp, int64_t vectors, const uint16_t *key, const int64_t *rows,
                            int64_t pairs, int64_t count, float scale, f32x16 *scores) {
    int64_t v0 = 0;
    for (; v0 + 4 <= vectors; v0 += 4) score_pairs(qp, vectors, v0, 4, key, rows, pairs, count, scale, scores);
    switch (vectors - v0) {
        case 3: score_pairs(qp, vectors, v0, 3, key, rows, pairs, count, scale, scores); break;
        case 2: score_pairs(qp, vectors, v0, 2, key, rows, pairs, count, scale, scores); break;
        case 1: score_pairs(qp, vectors, v0, 1, key, rows, pairs, count, scale, scores); break;
    }
}

/* A tile's scores from a bfloat16 cache on vdpbf16ps: st[j][v] for keys
 * [first, last] (see attend_tile). The queries are taken unscaled, as pairs,
 * and the scale is applied to the sums. */
INLINE void score_tile_dp(const uint16_t *q, const uint16_t *key, const int64_t *table, int64_t row0, int64_t first,
                          int64_t last, int64_t h, int64_t num_heads, int64_t num_kv_heads, int64_t block_size,
                          int64_t group, int64_t head_dim, int64_t queries, int64_t vectors, float scale, int32_t *qp,
                          f32x16 *st) {
    const int64_t pairs = head_dim / 2;
    pack_query_pairs(q, row0, queries, vectors, h, num_heads, group, head_dim, qp);
    int64_t rows[KEY_BLOCK];
    for (int64_t start = first; start <= last; start += KEY_BLOCK) {
        const int64_t m = MIN(KEY_BLOCK, last + 1 - start);
        key_rows(table, start, m, h, num_kv_heads, block_size, head_dim, rows);
        f32x16 *scores = st + (start - first) * vectors;
        int64_t j = 0;
        for (; j + 4 <= m; j += 4)
            score_key_pairs((const __m512bh *)qp, vectors, key, rows + j, pairs, 4, scale, scores + j * vectors);
        for (; j < m; j++)
            score_key_pairs((const __m512bh *)qp, vectors, key, rows + j, pairs, 1, scale, scores + j * vectors);
    }
}
#endif

#if HAVE_ROW_DP
/* The running maxima `top` (lane i: query i) taken over keys [from, to), each
 * query's only where lo <= key <= hi. */
INLINE __m512 masked_top(const f32x16 *st, int64_t from, int64_t to, i32x16 lo, i32x16 hi, __m512 top) {
    for (int64_t j = from; j < to; j++) {
        const i32x16 in = ((int32_t)j >= lo) & ((int32_t)j <= hi);
        top = (__m512)select16(in & (st[j] > (f32x16)top), st[j], (f32x16)top);
    }
    return top;
}

/* A few rows of one sequence (a decode and its draft) on vdpbf16ps, every key
 * read once for all of them: rows [row0, row0 + rows) at positions pos0,
 * pos0 + 1, ..., times the `group` query heads of KV head h, at most 16
 * queries, one per lane. Scores take score_pairs's layout (each key's pairs
 * broadcast against the queries' pairs) for 8 keys at a time, and the softmax
 * runs for every query at once, each over its own causal range. */
INLINE void attend_rows_dp(const uint16_t *q, const uint16_t *key, const uint16_t *value, const int64_t *table,
                           uint16_t *out, int64_t row0, int64_t rows, int64_t pos0, int64_t h, int64_t num_heads,
                           int64_t num_kv_heads, int64_t block_size, int64_t group, int64_t chunks, float scale,
                           int64_t window, float *scratch) {
    const int64_t head_dim = chunks * LANES, pairs = head_dim / 2, queries = rows * group;
    const int64_t last = pos0 + rows - 1, first = first_key(pos0, window), n = last + 1 - first;
    const int64_t padded = (n + 7) / 8 * 8;
    int32_t *qp = (int32_t *)scratch;              /* [pairs][16]: the queries' bfloat16 pairs */
    f32x16 *st = (f32x16 *)(qp + pairs * LANES);   /* [padded]: scores, then weights; lane i = query i */
    int64_t *krows = (int64_t *)(st + padded);     /* [padded]: each key's element offset in K and V */

    pack_query_pairs(q, row0, queries, 1, h, num_heads, group, head_dim, qp);
    key_rows(table, first, n, h, num_kv_heads, block_size, head_dim, krows);
    for (int64_t j = n; j < padded; j++) krows[j] = krows[n - 1];
    for (int64_t j = 0; j < MIN(4 * 8, n); j++) prefetch_row(key + krows[j], head_dim);
    for (int64_t j0 = 0; j0 < n; j0 += 8) {
        for (int64_t j = j0; j < MIN(j0 + 8, n); j++) {
            if (j + 4 * 8 < n) prefetch_row(key + krows[j + 4 * 8], head_dim);
            prefetch_row(value + krows[j], head_dim);
        }
        __m512 a[8];
#pragma GCC unroll 8
        for (int64_t k = 0; k < 8; k++) a[k] = _mm512_setzero_ps();
        for (int64_t p = 0; p < pairs; p++) {
            const __m512bh qv = (__m512bh)_mm512_load_si512(qp + p * LANES);
#pragma GCC unroll 8
            for (int64_t k = 0; k < 8; k++) {
                int32_t pair;
                memcpy(&pair, key + krows[j0 + k] + 2 * p, sizeof pair);
                a[k] = _mm512_dpbf16_ps(a[k], qv, (__m512bh)_mm512_set1_epi32(pair));
            }
        }
#pragma GCC unroll 8
        for (int64_t k = 0; k < 8; k++) st[j0 + k] = (f32x16)a[k] * scale;
    }
    /* Each query's keys, relative to first (lanes past the queries take the
     * last one's). All of them see keys [shared_lo, shared_hi]: the softmax
     * masks only the keys before and after. */
    i32x16 lo, hi;
    for (int64_t i = 0; i < LANES; i++) {
        const int64_t r = MIN(i, queries - 1) / group;
        lo[i] = (int32_t)(first_key(pos0 + r, window) - first);
        hi[i] = (int32_t)(pos0 + r - first);
    }
    const int64_t shared_lo = first_key(last, window) - first, shared_hi = pos0 - first;
    const __m512 zero = _mm512_setzero_ps();
    __m512 tops[4] = {zero - 3.0e38f, zero - 3.0e38f, zero - 3.0e38f, zero - 3.0e38f}; /* independent maxima */
    int64_t j = shared_lo;
    for (; j + 4 <= shared_hi + 1; j += 4)
        for (int64_t k = 0; k < 4; k++) tops[k] = _mm512_max_ps(tops[k], (__m512)st[j + k]);
    tops[0] = masked_top(st, 0, shared_lo, lo, hi, tops[0]);
    tops[0] = masked_top(st, j, n, lo, hi, tops[0]); /* the shared keys left over, and the keys after them */
    const f32x16 top = (f32x16)_mm512_max_ps(_mm512_max_ps(tops[0], tops[1]), _mm512_max_ps(tops[2], tops[3]));
    f32x16 total = (f32x16)zero;
    for (j = 0; j < n; j++) {
        const f32x16 e = exp16(st[j] - top);
        const i32x16 in = ((int32_t)j >= lo) & ((int32_t)j <= hi);
        st[j] = j >= shared_lo && j <= shared_hi ? e : select16(in, e, (f32x16)zero);
        total += st[j];
    }
    const f32x16 inverse = 1.0f / total;
    /* Value sums, 4 queries at a time (the last pass may sum lanes past the queries). */
    for (int64_t i0 = 0; i0 < queries; i0 += 4) {
        f32x16 acc[4][8];
        sum_values(value, krows, (const float *)st + i0, 1, LANES, n, 4, chunks, acc);
        for (int64_t i = i0; i < MIN(i0 + 4, queries); i++) {
            const int64_t index = ((row0 + i / group) * num_heads + h * group + i % group) * head_dim;
#pragma GCC unroll 8
            for (int64_t c = 0; c < chunks; c++) store16(acc[i - i0][c] * inverse[i], out, index + c * LANES, 1);
        }
    }
}

#define ROWS_DP(CHUNKS)                                                                                         \
    static __attribute__((noinline)) void attend_rows_dp_##CHUNKS(                                              \
        const uint16_t *q, const uint16_t *key, const uint16_t *value, const int64_t *table, uint16_t *out,    \
        int64_t row0, int64_t rows, int64_t pos0, int64_t h, int64_t num_heads, int64_t num_kv_heads,          \
        int64_t block_size, int64_t group, float scale, int64_t window, float *scratch) {                      \
        attend_rows_dp(q, key, value, table, out, row0, rows, pos0, h, num_heads, num_kv_heads, block_size,   \
                       group, CHUNKS, scale, window, scratch);                                                 \
    }
ROWS_DP(2)
ROWS_DP(4)
ROWS_DP(6)
ROWS_DP(8)
#undef ROWS_DP
#endif

/* A prefill tile: `rows` query rows from packed row `row0` on, at positions
 * pos0, pos0 + 1, ..., times the `group` query heads of KV head h. The tile's
 * queries lie across vector lanes (query i in lane i % 16 of vector i / 16),
 * so scores are broadcast FMAs with no horizontal sums, and the softmax runs
 * for 16 queries at once; the value sums stay in registers over a block of keys. */
INLINE void attend_tile(const void *q, const void *key, const void *value, const int64_t *table, void *out,
                        int64_t row0, int64_t rows, int64_t pos0, int64_t h, int64_t num_heads, int64_t num_kv_heads,
                        int64_t block_size, int64_t group, int64_t chunks, float scale, int64_t window,
                        float *scratch, int bf16) {
    const int64_t head_dim = chunks * LANES, queries = rows * group, vectors = (queries + LANES - 1) / LANES;
    const int64_t last = pos0 + rows - 1, first = first_key(pos0, window);
    const int64_t n = last + 1 - first;
    f32x16 *qt = (f32x16 *)scratch;          /* [head_dim][vectors]: the tile's queries, transposed */
    f32x16 *acc = qt + head_dim * vectors;   /* [vectors * 16][chunks]: the value sums */
    f32x16 *st = acc + vectors * LANES * chunks; /* [n][vectors]: scores, then weights */
    float *block = (float *)(st + n * vectors);  /* [KEY_BLOCK][head_dim]: keys or values as float32 */
    float *weights = (float *)st;
    i32x16 lo[vectors], hi[vectors]; /* each query's keys, relative to first */

    for (int64_t i = 0; i < vectors * LANES; i++) {
        const int64_t r = i / group, row_hi = pos0 + r - first;
        lo[i / LANES][i % LANES] = i < queries ? (int32_t)(first_key(pos0 + r, window) - first) : 0;
        hi[i / LANES][i % LANES] = i < queries ? (int32_t)row_hi : 0; /* padding lanes: key 0 alone */
    }
#if HAVE_ROW_DP
    if (bf16)
        score_tile_dp(q, key, table, row0, first, last, h, num_heads, num_kv_heads, block_size, group, head_dim,
                      queries, vectors, scale, (int32_t *)qt, st);
    else
#endif
    {
        memset(qt, 0, sizeof(f32x16) * (size_t)(head_dim * vectors));
        for (int64_t i = 0; i < queries; i++) {
            const int64_t index = ((row0 + i / group) * num_heads + h * group + i % group) * head_dim;
            for (int64_t c = 0; c < chunks; c++) {
                const f32x16 v = load16(q, index + c * LANES, bf16) * scale;
                for (int64_t l = 0; l < LANES; l++)
                    ((float *)qt)[((c * LANES + l) * vectors + i / LANES) * LANES + i % LANES] = v[l];
            }
        }
        /* Scores: st[j][v] = sum over d of qt[d][v] * key[j][d]. */
        for (int64_t start = first; start <= last; start += KEY_BLOCK) {
            const int64_t m = MIN(KEY_BLOCK, last + 1 - start);
            load_keys(key, table, start, m, h, num_kv_heads, block_size, chunks, block, bf16);
            f32x16 *scores = st + (start - first) * vectors;
            int64_t j = 0;
            for (; j + 4 <= m; j += 4) score_keys(qt, vectors, block, head_dim, j, 4, scores);
            for (; j < m; j++) score_keys(qt, vectors, block, head_dim, j, 1, scores);
        }
    }
    /* Softmax over each query's own keys, 16 queries at a time; the rest weigh 0. */
    f32x16 inverse[vectors];
    const f32x16 zero = {0}; /* (qt may hold bfloat16 pairs, not floats) */
    for (int64_t v = 0; v < vectors; v++) {
        f32x16 top = zero - 3.0e38f, total = zero;
        for (int64_t j = 0; j < n; j++) {
            const i32x16 in = ((int32_t)j >= lo[v]) & ((int32_t)j <= hi[v]);
            top = select16(in & (st[j * vectors + v] > top), st[j * vectors + v], top);
        }
        for (int64_t j = 0; j < n; j++) {
            const i32x16 in = ((int32_t)j >= lo[v]) & ((int32_t)j <= hi[v]);
            const f32x16 e = select16(in, exp16(st[j * vectors + v] - top), zero);
            st[j * vectors + v] = e;
            total += e;
        }
        inverse[v] = 1.0f / total;
    }
    /* Values: acc[i] = sum over j of weight[j][i] * value[j], group_size queries at a time. */
    memset(acc, 0, sizeof(f32x16) * (size_t)(vectors * LANES * chunks));
    const int64_t group_size = chunks <= 4 ? 4 : chunks <= 8 ? 2 : 1; /* 16 vector registers of sums */
    for (int64_t start = first; start <= last; start += KEY_BLOCK) {
        const int64_t m = MIN(KEY_BLOCK, last + 1 - start);
        load_keys(value, table, start, m, h, num_kv_heads, block_size, chunks, block, bf16);
        const float *w = weights + (start - first) * vectors * LANES;
        int64_t i = 0;
        if (group_size == 4)
            for (; i + 4 <= queries; i += 4) accumulate_values(acc, w, vectors * LANES, block, m, i, 4, chunks);
        if (group_size == 2)
            for (; i + 2 <= queries; i += 2) accumulate_values(acc, w, vectors * LANES, block, m, i, 2, chunks);
        for (; i < queries; i++) accumulate_values(acc, w, vectors * LANES, block, m, i, 1, chunks);
    }
    for (int64_t i = 0; i < queries; i++) {
        const int64_t r = i / group, index = ((row0 + r) * num_heads + h * group + i % group) * head_dim;
        const float norm = inverse[i / LANES][i % LANES];
        for (int64_t c = 0; c < chunks; c++) store16(acc[i * chunks + c] * norm, out, index + c * LANES, bf16);
    }
}

/* Rows per task for a sequence with `rows` new rows: a tile of TILE rows; or,
 * where the vdpbf16ps row paths run them (have_dp, at most ROWS_AS_DECODES
 * rows), as few tasks as hold the queries (rows times group) in 16 lanes
 * each, evenly (9 rows of 3 heads: 5 and 4), or one row per task below
 * ROWS_DP_QUERIES queries. */
INLINE int64_t task_rows(int64_t rows, int64_t group, int have_dp) {
    if (!have_dp || rows > ROWS_AS_DECODES) return TILE;
    if (rows * group < ROWS_DP_QUERIES) return 1;
    const int64_t most = LANES / group, tasks = (rows + most - 1) / most;
    return (rows + tasks - 1) / tasks;
}

INLINE int paged_attention(const void *q, const void *key, const void *value, const int64_t *block_tables,
                           const int64_t *starts, const int64_t *num_new, const int64_t *context_lens, void *out,
                           int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                           int64_t max_blocks, int64_t block_size, float scale, int64_t window, int bf16) {
    const int64_t group = num_heads / num_kv_heads, chunks = head_dim / LANES;
    /* Decode rows on vdpbf16ps, one at a time and a few together, for the head sizes it has. */
    row_dp_fn row_dp = NULL;
    rows_dp_fn rows_dp = NULL;
#if HAVE_ROW_DP
    if (bf16) switch (chunks) {
            case 2: row_dp = attend_row_dp_2, rows_dp = attend_rows_dp_2; break;
            case 4: row_dp = attend_row_dp_4, rows_dp = attend_rows_dp_4; break;
            case 6: row_dp = attend_row_dp_6, rows_dp = attend_rows_dp_6; break;
            case 8: row_dp = attend_row_dp_8, rows_dp = attend_rows_dp_8; break;
        }
#endif
    /* Tiles of each sequence's rows, numbered across the step: tile t is row
     * tile_rows[t] of sequence tile_seqs[t] (see task_rows). */
#define SEQ_TILE(s) task_rows(num_new[s], group, row_dp != NULL)
    int64_t num_tiles = 0, longest = 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        num_tiles += (num_new[s] + SEQ_TILE(s) - 1) / SEQ_TILE(s);
        longest = context_lens[s] > longest ? context_lens[s] : longest;
    }
    int64_t *tile_seqs = malloc(sizeof(int64_t) * (size_t)(2 * num_tiles + 1)), *tile_rows = tile_seqs + num_tiles;
    if (tile_seqs == NULL) return -1;
    for (int64_t s = 0, t = 0; s < num_seqs; s++)
        for (int64_t r = 0; r < num_new[s]; r += SEQ_TILE(s), t++) tile_seqs[t] = s, tile_rows[t] = r;
    /* Per thread, enough for either path: a tile's queries (padded to whole
     * vectors), their sums and scores, and a block of keys as float32. */
    const int64_t lanes = (TILE * group + LANES - 1) / LANES * LANES;
    const int64_t padded = (longest + LANES - 1) / LANES * LANES;
    const size_t scratch_floats = (size_t)(lanes * (2 * head_dim + padded) + KEY_BLOCK * head_dim + 2 * padded);
    int failed = 0;
#pragma omp parallel
    {
        float *scratch = aligned_alloc(64, sizeof(float) * scratch_floats);
        if (scratch == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < num_tiles * num_kv_heads; task++) {
            if (scratch == NULL) continue;
            /* Head-major: the rows of a sequence that follow each other share their K/V in cache. */
            const int64_t h = task / num_tiles, t = task % num_tiles, s = tile_seqs[t], r = tile_rows[t];
            const int64_t rows = MIN(SEQ_TILE(s), num_new[s] - r), pos0 = context_lens[s] - num_new[s] + r;
            const int64_t *table = block_tables + s * max_blocks;
#define ATTEND(CHUNKS)                                                                                      \
    if (rows == 1)                                                                                            \
        attend_row(q, key, value, table, out, starts[s] + r, pos0, h, num_heads, num_kv_heads, block_size,    \
                   group, CHUNKS, scale, window, scratch, bf16);                                              \
    else                                                                                                      \
        attend_tile(q, key, value, table, out, starts[s] + r, rows, pos0, h, num_heads, num_kv_heads,         \
                    block_size, group, CHUNKS, scale, window, scratch, bf16)
            if (row_dp != NULL && num_new[s] <= ROWS_AS_DECODES) {
                if (rows == 1)
                    row_dp(q, key, value, table, out, starts[s] + r, pos0, h, num_heads, num_kv_heads, block_size,
                           group, scale, window, scratch);
                else
                    rows_dp(q, key, value, table, out, starts[s] + r, rows, pos0, h, num_heads, num_kv_heads,
                            block_size, group, scale, window, scratch);
                continue;
            }
            switch (chunks) {
                case 4: ATTEND(4); break; /* head_dim 64 */
                case 8: ATTEND(8); break; /* head_dim 128 */
                default: ATTEND(chunks);
            }
#undef ATTEND
        }
        free(scratch);
    }
    free(tile_seqs);
    return failed ? -1 : 0;
#undef SEQ_TILE
}

#define ENTRY_POINT(NAME, BF16)                                                                                 \
    int NAME(const void *q, const void *key, const void *value, const int64_t *block_tables, const int64_t *starts, \
             const int64_t *num_new, const int64_t *context_lens, void *out, int64_t num_seqs, int64_t num_heads,   \
             int64_t num_kv_heads, int64_t head_dim, int64_t max_blocks, int64_t block_size, float scale,          \
             int64_t window) {                                                                                  \
        return paged_attention(q, key, value, block_tables, starts, num_new, context_lens, out, num_seqs,         \
                               num_heads, num_kv_heads, head_dim, max_blocks, block_size, scale, window, BF16);  \
    }

ENTRY_POINT(paged_attention_f32, 0)
ENTRY_POINT(paged_attention_bf16, 1)
