/* Paged decode attention for CPUs: one new query token per sequence, reading
 * K/V in place through the sequence's block table (no gather, no padding).
 *
 * Layout (one layer of the worker's pool, see kv_cache.py):
 *   q, out        [num_seqs, num_heads, head_dim]          contiguous
 *   key, value    [num_slots, num_kv_heads, head_dim]      contiguous
 *   block_tables  [num_seqs, max_blocks]                   int64, slot = block * block_size + offset
 *   context_lens  [num_seqs]                               int64, the new token included
 * head_dim must be a multiple of 16 and heads / kv_heads at most MAX_GROUP
 * (cpu_kernels.py checks both and falls back to SDPA otherwise).
 *
 * Each (sequence, KV head) is one task: the query heads that share the KV head
 * are scored against every key of the context (or of the sliding window), the
 * scores go through a float32 softmax, and the values are summed in float32.
 * Only the output is rounded to the cache dtype, as SDPA rounds it.
 *
 * Written with GCC vector extensions (16 float lanes), which the compiler maps
 * onto the CPU it builds for: cpu_kernels.py builds with -march=native and
 * -fopenmp. The OpenMP runtime is torch's own (same soname), so the kernel runs
 * on torch's thread team. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))
#define MIN(a, b) ((a) < (b) ? (a) : (b))
#define LANES 16
#define MAX_GROUP 16

typedef float f32x16 __attribute__((vector_size(64)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));

/* 16 elements of a float32 or bfloat16 array, from element `index` on, as float32. */
INLINE f32x16 load16(const void *base, int64_t index, int bf16) {
    if (bf16) {
        u16x16 half;
        memcpy(&half, (const uint16_t *)base + index, sizeof half);
        return (f32x16)(__builtin_convertvector(half, u32x16) << 16);
    }
    f32x16 v;
    memcpy(&v, (const float *)base + index, sizeof v);
    return v;
}

INLINE void store16(f32x16 v, void *base, int64_t index, int bf16) {
    if (bf16) {
        const u32x16 bits = (u32x16)v;
        const u32x16 rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16; /* to nearest even */
        const u16x16 half = __builtin_convertvector(rounded, u16x16);
        memcpy((uint16_t *)base + index, &half, sizeof half);
    } else {
        memcpy((float *)base + index, &v, sizeof v);
    }
}

INLINE float sum16(f32x16 v) {
    const f32x8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                    __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    const f32x4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

/* e^x for x <= 0 (scores minus their maximum): Cephes' expf polynomial after
 * range reduction, about 1e-7 relative error. */
INLINE f32x16 exp16(f32x16 x) {
    const i32x16 low = x < -87.0f; /* all ones where true */
    x = (f32x16)(((i32x16)x & ~low) | ((i32x16)(x * 0.0f - 87.0f) & low));
    const f32x16 round = x * 0.0f + 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    const f32x16 k = (x * 1.44269504088896341f + round) - round;
    const f32x16 r = x - k * 0.693359375f + k * 2.12194440e-4f;
    f32x16 p = r * 0.0f + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const i32x16 exponent = (__builtin_convertvector(k, i32x16) + 127) << 23;
    return p * (f32x16)exponent;
}

/* Softmax of n scores in place; the buffer is padded to whole vectors. */
INLINE void softmax(float *scores, int64_t n) {
    float top = scores[0];
    for (int64_t i = 1; i < n; i++) top = scores[i] > top ? scores[i] : top;
    f32x16 total = {0};
    for (int64_t i = 0; i < n; i += LANES) {
        f32x16 v;
        memcpy(&v, scores + i, sizeof v);
        v = exp16(v - top);
        for (int64_t j = n - i; j < LANES; j++) v[j] = 0.0f; /* the padding past n */
        memcpy(scores + i, &v, sizeof v);
        total += v;
    }
    const float inverse = 1.0f / sum16(total);
    for (int64_t i = 0; i < n; i++) scores[i] *= inverse;
}

/* One (sequence, KV head): `group` query heads over the keys [first, len).
 * Inlined with a constant `chunks` for the common head sizes, so that one
 * key's chunks stay in registers while every query head of the group reads them. */
INLINE void attend(const void *q, const void *key, const void *value, const int64_t *table, void *out,
                   int64_t q_index, int64_t h, int64_t first, int64_t len, int64_t num_kv_heads,
                   int64_t block_size, int64_t group, int64_t chunks, float scale, float *scratch, int bf16) {
    const int64_t n = len - first, stride = (n + LANES - 1) / LANES * LANES, head_dim = chunks * LANES;
    f32x16 *qv = (f32x16 *)scratch, *acc = qv + group * chunks;
    float *scores = (float *)(acc + group * chunks);

    for (int64_t c = 0; c < group * chunks; c++) qv[c] = load16(q, q_index + c * LANES, bf16) * scale;
    /* Keys block by block: p runs over [first, len), slot = block * block_size + offset. */
    for (int64_t p = first; p < len;) {
        const int64_t offset = p % block_size, count = MIN(block_size - offset, len - p);
        const int64_t row = (table[p / block_size] * block_size + offset) * num_kv_heads + h;
        for (int64_t j = 0; j < count; j++, p++) {
            f32x16 k[chunks];
            for (int64_t c = 0; c < chunks; c++) k[c] = load16(key, (row + j * num_kv_heads) * head_dim + c * LANES, bf16);
            for (int64_t g = 0; g < group; g++) {
                f32x16 dot = qv[g * chunks] * k[0];
                for (int64_t c = 1; c < chunks; c++) dot += qv[g * chunks + c] * k[c];
                scores[g * stride + (p - first)] = sum16(dot);
            }
        }
    }
    for (int64_t g = 0; g < group; g++) softmax(scores + g * stride, n);
    for (int64_t c = 0; c < group * chunks; c++) acc[c] = qv[0] * 0.0f;
    for (int64_t p = first; p < len;) {
        const int64_t offset = p % block_size, count = MIN(block_size - offset, len - p);
        const int64_t row = (table[p / block_size] * block_size + offset) * num_kv_heads + h;
        for (int64_t j = 0; j < count; j++, p++) {
            f32x16 v[chunks];
            for (int64_t c = 0; c < chunks; c++) v[c] = load16(value, (row + j * num_kv_heads) * head_dim + c * LANES, bf16);
            for (int64_t g = 0; g < group; g++) {
                const float weight = scores[g * stride + (p - first)];
                for (int64_t c = 0; c < chunks; c++) acc[g * chunks + c] += weight * v[c];
            }
        }
    }
    for (int64_t c = 0; c < group * chunks; c++) store16(acc[c], out, q_index + c * LANES, bf16);
}

INLINE int paged_decode(const void *q, const void *key, const void *value, const int64_t *block_tables,
                        const int64_t *context_lens, void *out, int64_t num_seqs, int64_t num_heads,
                        int64_t num_kv_heads, int64_t head_dim, int64_t max_blocks, int64_t block_size,
                        float scale, int64_t window, int bf16) {
    const int64_t group = num_heads / num_kv_heads, chunks = head_dim / LANES;
    int64_t longest = 0;
    for (int64_t s = 0; s < num_seqs; s++) longest = context_lens[s] > longest ? context_lens[s] : longest;
    const int64_t padded = (longest + LANES - 1) / LANES * LANES;
    int failed = 0;
#pragma omp parallel
    {
        /* Per thread: the group's queries and sums, one row of scores per query head. */
        float *scratch = aligned_alloc(64, sizeof(float) * (size_t)(group * (2 * head_dim + padded)));
        if (scratch == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < num_seqs * num_kv_heads; task++) {
            if (scratch == NULL) continue;
            const int64_t s = task / num_kv_heads, h = task % num_kv_heads, len = context_lens[s];
            const int64_t first = (window > 0 && len > window) ? len - window : 0;
            const int64_t *table = block_tables + s * max_blocks;
            const int64_t q_index = (s * num_heads + h * group) * head_dim;
#define ATTEND(CHUNKS) \
    attend(q, key, value, table, out, q_index, h, first, len, num_kv_heads, block_size, group, CHUNKS, scale, scratch, bf16)
            switch (chunks) {
                case 4: ATTEND(4); break; /* head_dim 64 */
                case 8: ATTEND(8); break; /* head_dim 128 */
                default: ATTEND(chunks);
            }
#undef ATTEND
        }
        free(scratch);
    }
    return failed ? -1 : 0;
}

#define ENTRY_POINT(NAME, BF16)                                                                              \
    int NAME(const void *q, const void *key, const void *value, const int64_t *block_tables,                 \
             const int64_t *context_lens, void *out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, \
             int64_t head_dim, int64_t max_blocks, int64_t block_size, float scale, int64_t window) {        \
        return paged_decode(q, key, value, block_tables, context_lens, out, num_seqs, num_heads, num_kv_heads, \
                            head_dim, max_blocks, block_size, scale, window, BF16);                          \
    }

ENTRY_POINT(paged_decode_f32, 0)
ENTRY_POINT(paged_decode_bf16, 1)
