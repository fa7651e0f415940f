/* bfloat16 linear layers: y = x @ W.T + bias + residual, float32 sums.
 *
 * The weight is packed once into column blocks of 16 outputs, each holding its
 * inputs in pairs: block b, pair p is one 64-byte vector of 16 outputs times
 * inputs 2p and 2p + 1, the operand layout of vdpbf16ps. Sums are float32 over
 * the whole input and round to bfloat16 once, after the bias and residual adds.
 * Threads take 48-output column strips in any order (dynamic schedule), every
 * strip all rows: a strip's weights are read from memory once per call, and a
 * thread that falls behind leaves the remaining strips to the others (one
 * preempted mid-strip still holds them up at the end of the call).
 *
 * Two builds of the same entry points, by what the compiler targets:
 *
 * - AVX512_BF16 (Zen 4 and later, Cooper Lake): a tile of up to 8 rows times 3
 *   blocks (48 outputs) keeps 24 float32 sums in registers, broadcasts each
 *   row's pair of inputs from memory and reads each weight vector once per 8
 *   rows on vdpbf16ps. While a strip's second tile of rows runs from cache, it
 *   prefetches into L2 the strip its thread most likely takes next (threads
 *   move through the strips about together): at 32 rows the bundled model's
 *   linears, weights read from memory, 29 -> 25 ms per decode step on a Zen 4.
 * - AVX2 with FMA and F16C and no AVX-512 (Zen 2/3, Haswell to Comet Lake),
 *   where oneDNN only emulates bfloat16: each 32-byte half of a pair vector
 *   holds 8 outputs times two inputs, and widening them to float32 is a shift
 *   (the even input) or a mask (the odd one). The rows are widened to float32
 *   once per call; a tile of up to 5 rows times one block keeps 10 sums in
 *   registers. Half the bytes of a float32 weight, which bounds a decode step.
 *   This build also has a 4-bit kernel (linear_q4, below) for steps of a few
 *   rows.
 *
 * Both builds also have grouped_linear_bf16: one call for the experts of a
 * mixture-of-experts layer, each expert's rows against its own weight.
 *
 * Elsewhere none is built; cpu_kernels.py then finds no `linear_bf16` in the
 * library and the backend keeps oneDNN or plain matmuls. */
#include <omp.h>

#include "simd.h"

#if defined(__AVX512BF16__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__))
#define BLOCK 16 /* outputs per column block: one pair vector of the packed weight */
#define STRIP 3  /* column blocks per scheduled strip */

/* weight [n, k] (n a multiple of BLOCK, k even) -> packed [n / BLOCK][k / 2][BLOCK][2]. */
void pack_linear_bf16(const uint16_t *weight, int64_t n, int64_t k, uint16_t *packed) {
#pragma omp parallel for
    for (int64_t b = 0; b < n / BLOCK; b++)
        for (int64_t p = 0; p < k / 2; p++)
            for (int64_t j = 0; j < BLOCK; j++) {
                uint16_t *dst = packed + ((b * (k / 2) + p) * BLOCK + j) * 2;
                dst[0] = weight[(b * BLOCK + j) * k + 2 * p];
                dst[1] = weight[(b * BLOCK + j) * k + 2 * p + 1];
            }
}

/* The groups of rows that have any (grouped_linear_bf16's work list), or NULL
 * when out of memory. */
static int64_t *groups_with_rows(const int64_t *offsets, int64_t groups, int64_t *count) {
    int64_t *active = malloc((size_t)(groups > 0 ? groups : 1) * sizeof(int64_t));
    *count = 0;
    if (active == NULL) return NULL;
    for (int64_t g = 0; g < groups; g++)
        if (offsets[g + 1] > offsets[g]) active[(*count)++] = g;
    return active;
}

#endif

#if defined(__AVX512BF16__)
#include <immintrin.h>

#define TILE_ROWS 8  /* rows per tile */
#define PREFETCH 32  /* input pairs ahead that a strip's first tile prefetches */

INLINE __m512 widen(const uint16_t *bf16) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)bf16)), 16));
}

/* rows x blocks outputs at out (row stride n): x rows from x (row stride k),
 * weights from the packed blocks at w (block stride k * BLOCK). The first
 * tile of a strip prefetches the weights ahead: they come from memory, later
 * tiles find them in cache. `next_blocks` blocks from `next` (the second tile's
 * share: the strip after) are prefetched into L2 along the way. */
INLINE void tile(const uint16_t *x, const uint16_t *w, const uint16_t *bias, const uint16_t *residual, uint16_t *out,
                 int64_t n, int64_t k, int rows, int blocks, int prefetch, const uint16_t *next, int next_blocks) {
    __m512 sum[TILE_ROWS][STRIP];
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < blocks; j++) sum[i][j] = _mm512_setzero_ps();
    const int64_t pairs = k / 2, block_stride = k * BLOCK;
    for (int64_t p = 0; p < pairs; p++) {
        __m512bh wv[STRIP];
        for (int j = 0; j < blocks; j++) {
            wv[j] = (__m512bh)_mm512_loadu_si512(w + j * block_stride + p * 2 * BLOCK);
            if (prefetch) _mm_prefetch((const char *)(w + j * block_stride + (p + PREFETCH) * 2 * BLOCK), _MM_HINT_T0);
        }
        for (int j = 0; j < next_blocks; j++)
            _mm_prefetch((const char *)(next + j * block_stride + p * 2 * BLOCK), _MM_HINT_T1);
        for (int i = 0; i < rows; i++) {
            int32_t pair;
            memcpy(&pair, x + i * k + 2 * p, sizeof pair);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
            for (int j = 0; j < blocks; j++) sum[i][j] = _mm512_dpbf16_ps(sum[i][j], xv, wv[j]);
        }
    }
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < blocks; j++) {
            __m512 v = sum[i][j];
            if (bias != NULL) v = _mm512_add_ps(v, widen(bias + j * BLOCK));
            if (residual != NULL) v = _mm512_add_ps(v, widen(residual + i * n + j * BLOCK));
            _mm256_storeu_si256((__m256i *)(out + i * n + j * BLOCK), (__m256i)_mm512_cvtneps_pbh(v));
        }
}

/* Strip s of out [m, n] (up to STRIP blocks from block s * STRIP), every row
 * of x: the tiles of linear_bf16 and grouped_linear_bf16. `next` (NULL or
 * next_blocks blocks) is the strip this thread likely takes next. */
INLINE void strip_rows(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, const uint16_t *residual,
                       uint16_t *out, int64_t m, int64_t n, int64_t k, int64_t s, const uint16_t *next,
                       int next_blocks) {
    const int64_t blocks = n / BLOCK, b = s * STRIP, col = b * BLOCK;
    const int nb = (int)MIN(STRIP, blocks - b);
    const uint16_t *w = packed + b * k * BLOCK, *strip_bias = bias == NULL ? NULL : bias + col;
    for (int64_t r = 0; r < m; r += TILE_ROWS) {
        const int rows = (int)MIN(TILE_ROWS, m - r);
        const uint16_t *tile_residual = residual == NULL ? NULL : residual + r * n + col;
        /* Constant row and block counts, so each case compiles to its own unrolled tile. */
#define TILE(ROWS, BLOCKS) tile(x + r * k, w, strip_bias, tile_residual, out + r * n + col, n, k, ROWS, BLOCKS, r == 0, \
                                next, r == TILE_ROWS ? next_blocks : 0)
#define BLOCKS_OF(ROWS)                            \
    switch (nb) {                                  \
        case 3: TILE(ROWS, 3); break;              \
        case 2: TILE(ROWS, 2); break;              \
        default: TILE(ROWS, 1);                    \
    }
        switch (rows) {
            case 8: BLOCKS_OF(8); break;
            case 7: BLOCKS_OF(7); break;
            case 6: BLOCKS_OF(6); break;
            case 5: BLOCKS_OF(5); break;
            case 4: BLOCKS_OF(4); break;
            case 3: BLOCKS_OF(3); break;
            case 2: BLOCKS_OF(2); break;
            default: BLOCKS_OF(1);
        }
#undef BLOCKS_OF
#undef TILE
    }
}

/* out [m, n] = x [m, k] @ W.T (+ bias [n]) (+ residual [m, n]); bias and
 * residual may be NULL. Every array contiguous bfloat16. Returns 0 (the AVX2
 * build returns -1 when it cannot allocate its float32 rows). */
int linear_bf16(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, const uint16_t *residual,
                uint16_t *out, int64_t m, int64_t n, int64_t k) {
    const int64_t blocks = n / BLOCK, strips = (blocks + STRIP - 1) / STRIP;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t s = 0; s < strips; s++) {
        /* The strip this thread likely takes next, prefetched into L2 by the second tile. */
        const int64_t ns = s + omp_get_num_threads();
        const int next_blocks = ns < strips && m > TILE_ROWS ? (int)MIN(STRIP, blocks - ns * STRIP) : 0;
        const uint16_t *next = next_blocks ? packed + ns * STRIP * k * BLOCK : NULL;
        strip_rows(x, packed, bias, residual, out, m, n, k, s, next, next_blocks);
    }
    return 0;
}

/* A mixture-of-experts layer's linears in one call: rows offsets[g] to
 * offsets[g + 1] of out [rows, n] = the same rows of x [rows, k] @ W_g.T, for
 * groups g of weights packed one after another (pack_linear_bf16 of each
 * [n, k]). Threads take (group, strip) items of the groups that have rows, in
 * group order, so they stream through one group's weights together and the
 * groups without rows are never read; one parallel region where a call per
 * group would pay a fork and join each. Rows from offsets[groups] on are left
 * unwritten. Returns 0, or -1 when out of memory. */
int grouped_linear_bf16(const uint16_t *x, const uint16_t *packed, const int64_t *offsets, int64_t groups,
                        uint16_t *out, int64_t n, int64_t k) {
    const int64_t blocks = n / BLOCK, strips = (blocks + STRIP - 1) / STRIP;
    int64_t count;
    int64_t *active = groups_with_rows(offsets, groups, &count);
    if (active == NULL) return -1;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t item = 0; item < count * strips; item++) {
        const int64_t g = active[item / strips], s = item % strips, first = offsets[g], m = offsets[g + 1] - first;
        const int64_t next_item = item + omp_get_num_threads();
        const int64_t ng = next_item < count * strips ? active[next_item / strips] : -1, ns = next_item % strips;
        const int next_blocks = ng >= 0 && m > TILE_ROWS ? (int)MIN(STRIP, blocks - ns * STRIP) : 0;
        const uint16_t *next = next_blocks ? packed + ng * n * k + ns * STRIP * k * BLOCK : NULL;
        strip_rows(x + first * k, packed + g * n * k, NULL, NULL, out + first * n, m, n, k, s, next, next_blocks);
    }
    free(active);
    return 0;
}

/* Weights that are exactly 4-bit (int4.py): per output, groups of 32 inputs of
 * code * scale + low, codes 0 to 15. Column blocks of 16 outputs; per block and
 * group 384 bytes: 4 vectors in the pair layout above (32 16-bit lanes, lane
 * 2j + e holding output j's codes for inputs 2p + e of 4 consecutive pairs p,
 * the pair 4v + i in bits 4i to 4i + 3 of vector v), then the 16 scales and
 * the 16 lows less 128 scales as float32. A code c widens to the bfloat16
 * 128 + c with one shift and one ternary logic op (0x4300 | c), so each group
 * sums (128 + c) * x on vdpbf16ps, and scale * that + (low - 128 scale) *
 * sum(x) is the output. 0.75 bytes a weight against bfloat16's 2: a step of
 * a few rows, bound by reading the weights, runs on this kernel. */
#define Q4_BLOCK 16
#define Q4_GROUP 32
#define Q4_GROUP_BYTES 384
#define Q4_TILE_ROWS 12 /* up to 24 sums, codes, a widened vector, a broadcast, 2 constants */

/* codes [n, k] (0 to 15), scale and low [n, k / 32] -> the layout above; n a
 * multiple of 16, k of 32. */
void pack_linear_q4(const uint8_t *codes, const float *scale, const float *low, int64_t n, int64_t k,
                    uint8_t *packed) {
    const int64_t groups = k / Q4_GROUP;
#pragma omp parallel for
    for (int64_t b = 0; b < n / Q4_BLOCK; b++)
        for (int64_t g = 0; g < groups; g++) {
            uint8_t *dst = packed + (b * groups + g) * Q4_GROUP_BYTES;
            for (int v = 0; v < 4; v++)
                for (int j = 0; j < Q4_BLOCK; j++)
                    for (int e = 0; e < 2; e++) {
                        uint16_t lane = 0;
                        for (int i = 0; i < 4; i++)
                            lane |= (uint16_t)((codes[(b * Q4_BLOCK + j) * k + g * Q4_GROUP + 2 * (4 * v + i) + e] & 15)
                                               << (4 * i));
                        memcpy(dst + v * 64 + (2 * j + e) * 2, &lane, 2);
                    }
            float *tail = (float *)(dst + 256);
            for (int j = 0; j < Q4_BLOCK; j++) {
                const int64_t at = (b * Q4_BLOCK + j) * groups + g;
                tail[j] = scale[at];
                tail[Q4_BLOCK + j] = low[at] - 128.0f * scale[at];
            }
        }
}

/* rows x 16 outputs at out (row stride n) from bfloat16 rows x (row stride k),
 * their group sums xsum (row stride k / 32) and one packed block w. */
INLINE void q4_tile(const uint16_t *x, const float *xsum, const uint8_t *w, const uint16_t *bias,
                    const uint16_t *residual, uint16_t *out, int64_t n, int64_t k, int rows) {
    const int64_t groups = k / Q4_GROUP;
    const __m512i nibble = _mm512_set1_epi16(15), exponent = _mm512_set1_epi16(0x4300);
    /* A few rows split their sums over chains, so vdpbf16ps's latency overlaps. */
    const int chains = rows <= 2 ? 4 : rows <= 4 ? 2 : 1;
    __m512 sum[Q4_TILE_ROWS];
    for (int r = 0; r < rows; r++) sum[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *gw = w + g * Q4_GROUP_BYTES;
        for (int line = 0; line < Q4_GROUP_BYTES; line += 64) /* the group 4 ahead */
            _mm_prefetch((const char *)(gw + 4 * Q4_GROUP_BYTES + line), _MM_HINT_T0);
        __m512 part[Q4_TILE_ROWS][4];
        for (int r = 0; r < rows; r++)
            for (int c = 0; c < chains; c++) part[r][c] = _mm512_setzero_ps();
        for (int v = 0; v < 4; v++) {
            const __m512i lanes = _mm512_loadu_si512(gw + v * 64);
            for (int i = 0; i < 4; i++) {
                /* (lanes >> 4i) & 15 | 0x4300: the bfloat16 128 + code. */
                const __m512bh wv = (__m512bh)_mm512_ternarylogic_epi32(
                    i ? _mm512_srli_epi16(lanes, 4 * i) : lanes, nibble, exponent, 0xEA);
                const int64_t pair = g * (Q4_GROUP / 2) + 4 * v + i;
                for (int r = 0; r < rows; r++) {
                    int32_t xp;
                    memcpy(&xp, x + r * k + 2 * pair, sizeof xp);
                    part[r][i % chains] = _mm512_dpbf16_ps(part[r][i % chains], (__m512bh)_mm512_set1_epi32(xp), wv);
                }
            }
        }
        const __m512 scale = _mm512_loadu_ps((const float *)(gw + 256));
        const __m512 low = _mm512_loadu_ps((const float *)(gw + 256) + Q4_BLOCK);
        for (int r = 0; r < rows; r++) {
            for (int c = 1; c < chains; c++) part[r][0] = _mm512_add_ps(part[r][0], part[r][c]);
            sum[r] = _mm512_fmadd_ps(scale, part[r][0], sum[r]);
            sum[r] = _mm512_fmadd_ps(low, _mm512_set1_ps(xsum[r * groups + g]), sum[r]);
        }
    }
    for (int r = 0; r < rows; r++) {
        __m512 v = sum[r];
        if (bias != NULL) v = _mm512_add_ps(v, widen(bias));
        if (residual != NULL) v = _mm512_add_ps(v, widen(residual + r * n));
        _mm256_storeu_si256((__m256i *)(out + r * n), (__m256i)_mm512_cvtneps_pbh(v));
    }
}

/* out [m, n] = x [m, k] @ W.T (+ bias [n]) (+ residual [m, n]) for a weight
 * packed by pack_linear_q4; bias and residual may be NULL, every other array
 * contiguous bfloat16. Returns 0, or -1 when out of memory. Threads take
 * runs of consecutive blocks (guided: long runs first, one weight stream the
 * hardware prefetcher follows), every block all rows: from the second tile of
 * rows on a block's weights come from cache. */
int linear_q4(const uint16_t *x, const uint8_t *packed, const uint16_t *bias, const uint16_t *residual,
              uint16_t *out, int64_t m, int64_t n, int64_t k) {
    const int64_t groups = k / Q4_GROUP, blocks = n / Q4_BLOCK;
    float *xsum = malloc((size_t)(m * groups) * sizeof(float));
    if (xsum == NULL) return -1;
    for (int64_t i = 0; i < m * groups; i++) {
        const __m512 a = widen(x + i * Q4_GROUP), b = widen(x + i * Q4_GROUP + 16);
        xsum[i] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
    }
#pragma omp parallel for schedule(guided)
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t r = 0; r < m; r += Q4_TILE_ROWS) {
            const int tile_rows = (int)MIN(Q4_TILE_ROWS, m - r);
            const int64_t col = b * Q4_BLOCK;
            const uint16_t *tile_bias = bias == NULL ? NULL : bias + col;
            const uint16_t *tile_residual = residual == NULL ? NULL : residual + r * n + col;
#define TILE(ROWS) q4_tile(x + r * k, xsum + r * groups, packed + b * groups * Q4_GROUP_BYTES, tile_bias, \
                           tile_residual, out + r * n + col, n, k, ROWS)
            switch (tile_rows) {
                case 12: TILE(12); break;
                case 11: TILE(11); break;
                case 10: TILE(10); break;
                case 9: TILE(9); break;
                case 8: TILE(8); break;
                case 7: TILE(7); break;
                case 6: TILE(6); break;
                case 5: TILE(5); break;
                case 4: TILE(4); break;
                case 3: TILE(3); break;
                case 2: TILE(2); break;
                default: TILE(1);
            }
#undef TILE
        }
    free(xsum);
    return 0;
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
#include <immintrin.h>

#define TILE_ROWS 5 /* rows per tile: 10 sums, 4 widened weight vectors, the mask and a broadcast: 16 registers */

typedef uint32_t u32x8 __attribute__((vector_size(32)));

/* rows x BLOCK outputs at out (row stride n) from float32 rows x (row stride
 * k) and one packed block w. */
INLINE void tile(const float *x, const uint16_t *w, const uint16_t *bias, const uint16_t *residual, uint16_t *out,
                 int64_t n, int64_t k, int rows) {
    f32x8 low[TILE_ROWS], high[TILE_ROWS]; /* outputs 0-7 and 8-15 */
    for (int i = 0; i < rows; i++) low[i] = high[i] = (f32x8){0};
    for (int64_t p = 0; p < k / 2; p++) {
        u32x8 a, b;
        memcpy(&a, w + p * 2 * BLOCK, sizeof a);
        memcpy(&b, w + p * 2 * BLOCK + BLOCK, sizeof b);
        const f32x8 even_low = (f32x8)(a << 16), odd_low = (f32x8)(a & 0xFFFF0000u);
        const f32x8 even_high = (f32x8)(b << 16), odd_high = (f32x8)(b & 0xFFFF0000u);
        for (int i = 0; i < rows; i++) {
            const float x0 = x[i * k + 2 * p], x1 = x[i * k + 2 * p + 1];
            /* One statement per product, so each compiles to one FMA. */
            low[i] += even_low * x0;
            high[i] += even_high * x0;
            low[i] += odd_low * x1;
            high[i] += odd_high * x1;
        }
    }
    for (int i = 0; i < rows; i++) {
        f32x16 v = __builtin_shufflevector(low[i], high[i], 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        if (bias != NULL) v += load16(bias, 0, 1);
        if (residual != NULL) v += load16(residual, i * n, 1);
        store16(v, out, i * n, 1);
    }
}

/* count bfloat16 values widened to a new float32 array (free it), or NULL. */
static float *widened(const uint16_t *x, int64_t count) {
    float *rows = malloc((size_t)count * sizeof(float));
    if (rows == NULL) return NULL;
#pragma omp parallel for if (count >= 4096)
    for (int64_t i = 0; i < count; i += LANES) {
        if (i + LANES <= count) {
            const f32x16 v = load16(x, i, 1);
            memcpy(rows + i, &v, sizeof v);
        } else {
            for (int64_t j = i; j < count; j++) {
                const uint32_t bits = (uint32_t)x[j] << 16;
                memcpy(rows + j, &bits, sizeof bits);
            }
        }
    }
    return rows;
}

/* Strip s of out [m, n] (up to STRIP blocks) from float32 rows x [m, k]: the
 * tiles of linear_bf16 and grouped_linear_bf16. */
INLINE void strip_rows(const float *x, const uint16_t *packed, const uint16_t *bias, const uint16_t *residual,
                       uint16_t *out, int64_t m, int64_t n, int64_t k, int64_t s) {
    const int64_t blocks = n / BLOCK;
    for (int64_t r = 0; r < m; r += TILE_ROWS)
        for (int64_t b = s * STRIP; b < MIN((s + 1) * STRIP, blocks); b++) {
            const int tile_rows = (int)MIN(TILE_ROWS, m - r);
            const int64_t col = b * BLOCK;
            const uint16_t *tile_bias = bias == NULL ? NULL : bias + col;
            const uint16_t *tile_residual = residual == NULL ? NULL : residual + r * n + col;
            /* Constant row counts, so each case compiles to its own unrolled tile. */
#define TILE(ROWS) tile(x + r * k, packed + b * k * BLOCK, tile_bias, tile_residual, out + r * n + col, n, k, ROWS)
            switch (tile_rows) {
                case 5: TILE(5); break;
                case 4: TILE(4); break;
                case 3: TILE(3); break;
                case 2: TILE(2); break;
                default: TILE(1);
            }
#undef TILE
        }
}

int linear_bf16(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, const uint16_t *residual,
                uint16_t *out, int64_t m, int64_t n, int64_t k) {
    float *rows = widened(x, m * k);
    if (rows == NULL) return -1;
    const int64_t blocks = n / BLOCK, strips = (blocks + STRIP - 1) / STRIP;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t s = 0; s < strips; s++) strip_rows(rows, packed, bias, residual, out, m, n, k, s);
    free(rows);
    return 0;
}

/* As the AVX-512 build's grouped_linear_bf16, the rows widened once. */
int grouped_linear_bf16(const uint16_t *x, const uint16_t *packed, const int64_t *offsets, int64_t groups,
                        uint16_t *out, int64_t n, int64_t k) {
    const int64_t strips = (n / BLOCK + STRIP - 1) / STRIP;
    int64_t count;
    int64_t *active = groups_with_rows(offsets, groups, &count);
    if (active != NULL && count == 0) {
        free(active);
        return 0;
    }
    float *rows = active == NULL ? NULL : widened(x, offsets[groups] * k);
    if (rows == NULL) {
        free(active);
        return -1;
    }
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t item = 0; item < count * strips; item++) {
        const int64_t g = active[item / strips], first = offsets[g];
        strip_rows(rows + first * k, packed + g * n * k, NULL, NULL, out + first * n, offsets[g + 1] - first, n, k,
                   item % strips);
    }
    free(rows);
    free(active);
    return 0;
}

/* Weights that are exactly 4-bit (int4.py): per output, groups of 32 inputs of
 * code * scale + low, codes 0 to 15. Column blocks of 8 outputs; per block and
 * group 160 bytes: 4 vectors of 8 lanes, lane j holding output j's codes for 8
 * inputs (input i in bits 4i to 4i + 3), then the 8 scales and the 8 lows as
 * float16. A step of a few rows reads under a third of the bfloat16 bytes. Each
 * group sums code * x in float32 and adds scale * that + low * sum(x). */
#define Q4_BLOCK 8
#define Q4_GROUP 32
#define Q4_GROUP_BYTES 160
#define Q4_TILE_ROWS 4 /* 4 sums, 4 group sums, codes, a code, the mask and a broadcast */
#define Q4_STRIP 6     /* blocks per scheduled strip: 48 outputs */

typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));

/* codes [n, k] (0 to 15), scale and low [n, k / 32] -> the layout above; n a
 * multiple of 8, k of 32. */
void pack_linear_q4(const uint8_t *codes, const float *scale, const float *low, int64_t n, int64_t k,
                    uint8_t *packed) {
    const int64_t groups = k / Q4_GROUP;
#pragma omp parallel for
    for (int64_t b = 0; b < n / Q4_BLOCK; b++)
        for (int64_t g = 0; g < groups; g++) {
            uint8_t *dst = packed + (b * groups + g) * Q4_GROUP_BYTES;
            for (int c = 0; c < 4; c++)
                for (int j = 0; j < Q4_BLOCK; j++) {
                    const uint8_t *src = codes + (b * Q4_BLOCK + j) * k + g * Q4_GROUP + c * 8;
                    uint32_t lane = 0;
                    for (int i = 0; i < 8; i++) lane |= (uint32_t)(src[i] & 15) << (4 * i);
                    memcpy(dst + (c * Q4_BLOCK + j) * 4, &lane, 4);
                }
            float s[Q4_BLOCK], l[Q4_BLOCK];
            for (int j = 0; j < Q4_BLOCK; j++) {
                s[j] = scale[(b * Q4_BLOCK + j) * groups + g];
                l[j] = low[(b * Q4_BLOCK + j) * groups + g];
            }
            _mm_storeu_si128((__m128i *)(dst + 128), _mm256_cvtps_ph(_mm256_loadu_ps(s), _MM_FROUND_TO_NEAREST_INT));
            _mm_storeu_si128((__m128i *)(dst + 144), _mm256_cvtps_ph(_mm256_loadu_ps(l), _MM_FROUND_TO_NEAREST_INT));
        }
}

INLINE f32x8 load8_bf16(const uint16_t *p) {
    u16x8 half;
    memcpy(&half, p, sizeof half);
    return (f32x8)(__builtin_convertvector(half, u32x8) << 16);
}

INLINE void store8_bf16(f32x8 v, uint16_t *p) {
    const u16x8 half = __builtin_convertvector(BF16_ROUND((u32x8)v), u16x8);
    memcpy(p, &half, sizeof half);
}

/* rows x 8 outputs at out (row stride n) from float32 rows x (row stride k),
 * their group sums xsum (row stride k / 32) and one packed block w. */
INLINE void q4_tile(const float *x, const float *xsum, const uint8_t *w, const uint16_t *bias,
                    const uint16_t *residual, uint16_t *out, int64_t n, int64_t k, int rows) {
    const int64_t groups = k / Q4_GROUP;
    f32x8 sum[Q4_TILE_ROWS];
    for (int r = 0; r < rows; r++) sum[r] = (f32x8){0};
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *gw = w + g * Q4_GROUP_BYTES;
        f32x8 part[Q4_TILE_ROWS];
        for (int r = 0; r < rows; r++) part[r] = (f32x8){0};
        for (int c = 0; c < 4; c++) {
            i32x8 lanes;
            memcpy(&lanes, gw + c * 32, sizeof lanes);
            for (int i = 0; i < 8; i++) {
                const f32x8 code = __builtin_convertvector((lanes >> (4 * i)) & 15, f32x8);
                for (int r = 0; r < rows; r++) part[r] += code * x[r * k + g * Q4_GROUP + c * 8 + i];
            }
        }
        const f32x8 scale = (f32x8)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(gw + 128)));
        const f32x8 low = (f32x8)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(gw + 144)));
        for (int r = 0; r < rows; r++) {
            sum[r] += scale * part[r];
            sum[r] += low * xsum[r * groups + g];
        }
    }
    for (int r = 0; r < rows; r++) {
        f32x8 v = sum[r];
        if (bias != NULL) v += load8_bf16(bias);
        if (residual != NULL) v += load8_bf16(residual + r * n);
        store8_bf16(v, out + r * n);
    }
}

/* out [m, n] = x [m, k] @ W.T (+ bias [n]) (+ residual [m, n]) for a weight
 * packed by pack_linear_q4; bias and residual may be NULL, every other array
 * contiguous bfloat16. Returns 0, or -1 when out of memory. */
int linear_q4(const uint16_t *x, const uint8_t *packed, const uint16_t *bias, const uint16_t *residual,
              uint16_t *out, int64_t m, int64_t n, int64_t k) {
    const int64_t groups = k / Q4_GROUP, blocks = n / Q4_BLOCK, strips = (blocks + Q4_STRIP - 1) / Q4_STRIP;
    float *rows = widened(x, m * k), *xsum = malloc((size_t)(m * groups) * sizeof(float));
    if (rows == NULL || xsum == NULL) {
        free(rows);
        free(xsum);
        return -1;
    }
    for (int64_t i = 0; i < m * groups; i++) {
        float total = 0.0f;
        for (int j = 0; j < Q4_GROUP; j++) total += rows[i * Q4_GROUP + j];
        xsum[i] = total;
    }
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t s = 0; s < strips; s++)
        for (int64_t r = 0; r < m; r += Q4_TILE_ROWS)
            for (int64_t b = s * Q4_STRIP; b < MIN((s + 1) * Q4_STRIP, blocks); b++) {
                const int tile_rows = (int)MIN(Q4_TILE_ROWS, m - r);
                const int64_t col = b * Q4_BLOCK;
                const uint16_t *tile_bias = bias == NULL ? NULL : bias + col;
                const uint16_t *tile_residual = residual == NULL ? NULL : residual + r * n + col;
#define TILE(ROWS) q4_tile(rows + r * k, xsum + r * groups, packed + b * groups * Q4_GROUP_BYTES, tile_bias, \
                           tile_residual, out + r * n + col, n, k, ROWS)
                switch (tile_rows) {
                    case 4: TILE(4); break;
                    case 3: TILE(3); break;
                    case 2: TILE(2); break;
                    default: TILE(1);
                }
#undef TILE
            }
    free(rows);
    free(xsum);
    return 0;
}
#endif

#ifdef Q4_GROUP_BYTES
/* Bytes of a weight [n, k] packed by this build's pack_linear_q4, or -1 for a
 * shape its layout does not take. */
int64_t q4_packed_bytes(int64_t n, int64_t k) {
    return n % Q4_BLOCK || k % Q4_GROUP ? -1 : n / Q4_BLOCK * (k / Q4_GROUP) * Q4_GROUP_BYTES;
}
#endif
