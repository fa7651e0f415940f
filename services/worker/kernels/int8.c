/* Integer dot-product linears, the way llama.cpp's CPU backend runs its
 * quantised matmuls: the activations are quantised to int8 at the start of
 * each call and every product is an integer one, summed exactly in int32,
 * scaled to float32 once per sum.
 *
 * - W8A8: int8 weights with a float32 scale per output. Dynamic (a scale per
 *   row of activations, amax / 127) or static (msModelSlim's W8A8: one input
 *   scale and offset, an int32 bias added to the integer sums, and the
 *   output's dequantising scale per output).
 * - W4A8: exactly-4-bit weights (int4.py: code * scale + low per group of 32
 *   inputs) against activations quantised per row and block of 32 inputs, as
 *   llama.cpp's Q8_0; each block keeps its sum of codes for the `low` term.
 *
 * Three builds of the same entry points, by what the compiler targets:
 *
 * - AVX512_VNNI: vpdpbusd on 16 int32 lanes, each lane the sum of 4 unsigned
 *   times signed byte products. W8A8 shifts the activations by 128 to make them
 *   unsigned and takes 128 * sum(w) off each output's sum (folded into its
 *   integer offset at pack time); W4A8's codes are the unsigned operand as they
 *   are.
 * - AVX-VNNI (Alder Lake and later without AVX-512): the same on 8 lanes.
 * - AVX2: W4A8 on vpmaddubsw, summing up to 8 products of a code (at most 15)
 *   and an activation (at most 127 in magnitude) in int16 lanes, which cannot
 *   saturate (8 * 2 * 15 * 127 = 30480), then vpmaddwd into int32. W8A8 cannot
 *   do that exactly: two products of an unsigned byte and a full int8 weight
 *   reach 2 * 255 * 128, past int16, and vpmaddubsw saturates. It widens the
 *   weights to int16 once per tile of rows (vpmovsxbw) and multiplies them
 *   with int16 activations on vpmaddwd: two multiplies per 32 products, as
 *   vpmaddubsw + vpmaddwd would be, and exact.
 *
 * One core of a Xeon (Sapphire Rapids, a VM), 32 rows through gate_up's
 * weight (576 -> 3072) warm in cache, in GMAC/s: W8A8 289 on AVX512_VNNI, 123
 * on AVX-VNNI, 59 on AVX2; W4A8 170, 98, 68; linear.c's bfloat16 kernel 44
 * (AVX512_BF16) and 32 (AVX2), its 4-bit one 41 and 26. At 1 row every kernel
 * is bound by reading the weights, which are 1 (W8A8) or 0.75 (W4A8) bytes
 * each.
 *
 * Elsewhere none is built; cpu_kernels.py then finds no `linear_w8a8` in the
 * library. Every build takes x, the residual and the output as bfloat16 or
 * float32 (`bf16`), the bias as float32. Threads take (rows, column strip)
 * items, the strips of a chunk of rows before the next chunk's: a decode step
 * (a few rows) is one chunk and reads each weight byte once; a prefill step
 * splits its rows only where there are too few strips for the threads. They
 * take runs of consecutive items (guided: long runs first), one weight stream
 * the hardware prefetcher follows: 5 to 10 % faster than one strip at a time
 * (dynamic) at 1 to 32 rows, the bundled model's linears from memory, 2 cores. */
#include <omp.h>

#include "simd.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define I8_VL 16 /* int32 lanes per vector */
#define I8_VNNI 1
#elif defined(__AVXVNNI__) && defined(__AVX2__) && defined(__FMA__)
#define I8_VL 8
#define I8_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__)
#define I8_VL 8
#define I8_VNNI 0
#endif

#ifdef I8_VL
#include <immintrin.h>

#define I8_BLOCK 16  /* outputs per packed column block: n a multiple of it */
#define I8_GROUP 32  /* inputs per W4A8 group and per activation block: k a multiple of it */
#define HALVES (I8_BLOCK / I8_VL) /* vectors per column block */
#define Q4A8_GROUP_BYTES 384 /* per block and group: 256 bytes of codes, 16 scales, 16 lows */

typedef float fvec __attribute__((vector_size(I8_VL * 4)));
typedef int32_t ivec __attribute__((vector_size(I8_VL * 4)));
typedef uint32_t uvec __attribute__((vector_size(I8_VL * 4)));
typedef uint16_t hvec __attribute__((vector_size(I8_VL * 2)));
typedef int8_t bvec __attribute__((vector_size(I8_VL)));
typedef uint8_t ubvec __attribute__((vector_size(I8_VL)));
typedef int16_t svec __attribute__((vector_size(I8_VL * 2)));

#if I8_VL == 16
#define VEC_INT(v) ((__m512i)(v))
INLINE ivec round_int(fvec v) { return (ivec)_mm512_cvtps_epi32((__m512)v); } /* nearest, ties to even */
INLINE fvec vmax(fvec a, fvec b) { return (fvec)_mm512_max_ps((__m512)a, (__m512)b); }
INLINE float hmax(fvec v) { return _mm512_reduce_max_ps((__m512)v); }
/* acc + the 4 products of unsigned bytes u and signed bytes s in each lane. */
INLINE ivec dot_u8s8(ivec acc, ivec u, ivec s) {
    return (ivec)_mm512_dpbusd_epi32(VEC_INT(acc), VEC_INT(u), VEC_INT(s));
}
#else
#define VEC_INT(v) ((__m256i)(v))
INLINE ivec round_int(fvec v) { return (ivec)_mm256_cvtps_epi32((__m256)v); }
INLINE fvec vmax(fvec a, fvec b) { return (fvec)_mm256_max_ps((__m256)a, (__m256)b); }
INLINE float hmax(fvec v) {
    const f32x4 a = (f32x4)_mm_max_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
    const f32x4 b = (f32x4)_mm_max_ps((__m128)a, _mm_movehl_ps((__m128)a, (__m128)a));
    return b[0] > b[1] ? b[0] : b[1];
}
#if I8_VNNI
INLINE ivec dot_u8s8(ivec acc, ivec u, ivec s) {
    return (ivec)_mm256_dpbusd_avx_epi32(VEC_INT(acc), VEC_INT(u), VEC_INT(s));
}
#endif
#endif

INLINE ivec clamp_int(ivec v, int32_t lo, int32_t hi) {
    const ivec low = v < lo, high = v > hi;
    return (v & ~low & ~high) | (((ivec){0} + lo) & low) | (((ivec){0} + hi) & high);
}

INLINE ivec broadcast32(const void *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return (ivec){0} + v;
}

/* I8_VL values of a float32 or bfloat16 array from element `index` on, as float32. */
INLINE fvec loadv(const void *base, int64_t index, int bf16) {
    if (bf16) {
        hvec half;
        memcpy(&half, (const uint16_t *)base + index, sizeof half);
        return (fvec)(__builtin_convertvector(half, uvec) << 16);
    }
    fvec v;
    memcpy(&v, (const float *)base + index, sizeof v);
    return v;
}

INLINE void storev(fvec v, void *base, int64_t index, int bf16) {
    if (bf16) {
        const hvec half = __builtin_convertvector(BF16_ROUND((uvec)v), hvec);
        memcpy((uint16_t *)base + index, &half, sizeof half);
    } else {
        memcpy((float *)base + index, &v, sizeof v);
    }
}

INLINE fvec absv(fvec v) { return (fvec)((ivec)v & 0x7FFFFFFF); }

/* The largest magnitude of x[0:count] (count a multiple of I8_VL). */
INLINE float amax_of(const void *x, int64_t count, int bf16) {
    fvec m = {0};
    for (int64_t i = 0; i < count; i += I8_VL) m = vmax(m, absv(loadv(x, i, bf16)));
    return hmax(m);
}

/* The output epilogue: + bias (float32, may be NULL) + residual (may be NULL),
 * rounded once to the output's dtype. */
INLINE void finish(fvec v, const float *bias, const void *residual, void *out, int64_t index, int64_t col, int bf16) {
    if (bias != NULL) v += loadv(bias, col, 0);
    if (residual != NULL) v += loadv(residual, index, bf16);
    storev(v, out, index, bf16);
}

/* Activations (rows times inputs) from which a call quantises its rows on all
 * threads: below, one thread's few microseconds cost less than a fork and join. */
#define QUANTIZE_PARALLEL 65536

/* Rows per chunk: all of them while the strips alone give each thread a few
 * items (the weights are then read once per call), else fewer, in whole tiles. */
static int64_t chunk_rows(int64_t m, int64_t strips, int tile_rows) {
    const int64_t want = 4 * (int64_t)omp_get_max_threads();
    if (strips >= want || m <= tile_rows) return m;
    const int64_t chunks = MIN((m + tile_rows - 1) / tile_rows, (want + strips - 1) / strips);
    const int64_t rows = (m + chunks - 1) / chunks;
    return (rows + tile_rows - 1) / tile_rows * tile_rows;
}

/* Which build this is: 3 AVX512_VNNI, 2 AVX-VNNI, 1 AVX2 (tests and benches). */
int64_t int8_isa(void) { return I8_VL == 16 ? 3 : I8_VNNI ? 2 : 1; }

/* ---------------------------------------------------------------- W8A8 ---- */

/* The packed weight: column blocks of 16 outputs, k * 16 bytes each (the VNNI
 * builds: per 4 inputs 64 bytes, output j's 4 at bytes 4j; the AVX2 build: per
 * 2 inputs 32 bytes, outputs 0-7 then 8-15, output j's 2 at bytes 2j), then
 * the n float32 scales, then n int32 offsets added to the integer sums (the
 * int32 bias, less 128 * sum(w) where the activations are shifted). */
#if I8_VNNI
#define W8_STEP 4 /* inputs per lane per instruction */
#define W8_TILE_ROWS (I8_VL == 16 ? 8 : 4)
#define W8_TILE_VECS (I8_VL == 16 ? 3 : 2) /* 24 (8) sums, 3 (2) weights, a broadcast */
typedef uint8_t w8_act; /* xq + 128 */
#else
#define W8_STEP 2
#define W8_TILE_ROWS 4
#define W8_TILE_VECS 2 /* 8 sums, 2 widened weights, a broadcast, a product */
typedef int16_t w8_act;
#endif
_Static_assert(W8_TILE_ROWS == 4 || W8_TILE_ROWS == 6 || W8_TILE_ROWS == 8, "linear_w8a8 unrolls 4, 6 or 8 rows");
_Static_assert(W8_TILE_VECS >= 2 && W8_TILE_VECS <= 4, "linear_w8a8 unrolls 2 to 4 vectors");
#ifndef W8_PREFETCH
/* Bytes ahead in each block that a strip's first tile prefetches: one row from
 * memory on one core, 12.4 -> 13.6 GB/s on AVX512_VNNI, 8.0 -> 11.6 on AVX2. */
#define W8_PREFETCH 4096
#endif

/* int32 sums wrap, and come out exact wherever the true sum fits: up to k =
 * 2^17 products of at most 2^14 (a margin left for the int32 bias). */
int64_t w8a8_packed_bytes(int64_t n, int64_t k) {
    return n <= 0 || k <= 0 || n % I8_BLOCK || k % I8_GROUP || k > 65536 ? -1 : n * k + n * 8;
}

/* weight [n, k] int8, scale [n] float32, quant_bias [n] int32 (or NULL) ->
 * the layout above. */
void pack_linear_w8a8(const int8_t *weight, const float *scale, const int32_t *quant_bias, int64_t n, int64_t k,
                      uint8_t *packed) {
    float *scales = (float *)(packed + n * k);
    int32_t *offsets = (int32_t *)(packed + n * k + n * 4);
#pragma omp parallel for
    for (int64_t b = 0; b < n / I8_BLOCK; b++) {
        int8_t *dst = (int8_t *)packed + b * I8_BLOCK * k;
        for (int64_t s = 0; s < k / W8_STEP; s++)
            for (int j = 0; j < I8_BLOCK; j++)
                for (int e = 0; e < W8_STEP; e++) {
#if I8_VNNI
                    const int64_t at = s * 64 + j * 4 + e;
#else
                    const int64_t at = s * 32 + j * 2 + e;
#endif
                    dst[at] = weight[(b * I8_BLOCK + j) * k + s * W8_STEP + e];
                }
        for (int j = 0; j < I8_BLOCK; j++) {
            const int64_t o = b * I8_BLOCK + j;
            int32_t total = 0;
            for (int64_t i = 0; i < k; i++) total += weight[o * k + i];
            scales[o] = scale[o];
            offsets[o] = (quant_bias == NULL ? 0 : quant_bias[o]) - (I8_VNNI ? 128 * total : 0);
        }
    }
}

/* Row r of x quantised into xq: dynamic (input_quant NULL) round(x / s) in
 * [-127, 127] with s = amax / 127, *row_scale = s; static round(x / scale +
 * offset) in [-128, 127], *row_scale = 1. Shifted by 128 on the VNNI builds. */
static void w8_quantize_row(const void *x, int64_t k, int bf16, const float *input_quant, w8_act *xq,
                            float *row_scale) {
    float divisor, offset = 0.0f;
    int32_t lo = -127;
    if (input_quant == NULL) {
        const float amax = amax_of(x, k, bf16);
        *row_scale = amax / 127.0f;
        divisor = amax > 0.0f ? *row_scale : 1.0f;
    } else {
        *row_scale = 1.0f;
        divisor = input_quant[0];
        offset = input_quant[1];
        lo = -128;
    }
    for (int64_t i = 0; i < k; i += I8_VL) {
        const ivec q = clamp_int(round_int(loadv(x, i, bf16) / divisor + offset), lo, 127);
#if I8_VNNI
        const ubvec u = __builtin_convertvector(q + 128, ubvec);
#else
        const svec u = __builtin_convertvector(q, svec);
#endif
        memcpy(xq + i, &u, sizeof u);
    }
}

/* rows x vecs vectors of outputs from column col on: xq rows (stride k), w
 * the packed weights of the tile's first block, `half` its first vector in it. */
INLINE void w8_tile(const w8_act *xq, const float *row_scale, const int8_t *w, int half, const float *scales,
                    const int32_t *offsets, const float *bias, const void *residual, void *out, int64_t n, int64_t k,
                    int64_t col, int bf16, int rows, int vecs, int prefetch) {
    ivec acc[W8_TILE_ROWS][W8_TILE_VECS];
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < vecs; j++) acc[i][j] = (ivec){0};
    const int8_t *wv_at[W8_TILE_VECS];
    for (int j = 0; j < vecs; j++)
        wv_at[j] = w + (half + j) / HALVES * I8_BLOCK * k + (half + j) % HALVES * I8_VL * W8_STEP;
    for (int64_t s = 0; s < k / W8_STEP; s++) {
        ivec wv[W8_TILE_VECS];
        if (prefetch)
            for (int j = 0; j < vecs; j++)
                _mm_prefetch((const char *)(wv_at[j] + s * W8_STEP * I8_BLOCK + W8_PREFETCH), _MM_HINT_T0);
        for (int j = 0; j < vecs; j++) {
#if I8_VNNI
            memcpy(&wv[j], wv_at[j] + s * 64, sizeof wv[j]);
#else
            wv[j] = (ivec)_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wv_at[j] + s * 32)));
#endif
        }
        for (int i = 0; i < rows; i++) {
            const ivec xv = broadcast32(xq + i * k + s * W8_STEP);
            for (int j = 0; j < vecs; j++) {
#if I8_VNNI
                acc[i][j] = dot_u8s8(acc[i][j], xv, wv[j]);
#else
                acc[i][j] += (ivec)_mm256_madd_epi16(VEC_INT(xv), VEC_INT(wv[j]));
#endif
            }
        }
    }
    for (int j = 0; j < vecs; j++) {
        const int64_t c = col + j * I8_VL;
        fvec scale;
        ivec offset;
        memcpy(&scale, scales + c, sizeof scale);
        memcpy(&offset, offsets + c, sizeof offset);
        for (int i = 0; i < rows; i++)
            finish(__builtin_convertvector(acc[i][j] + offset, fvec) * (scale * row_scale[i]), bias, residual, out,
                   i * n + c, c, bf16);
    }
}

/* out [m, n] = the W8A8 product of x [m, k] and a weight packed by
 * pack_linear_w8a8 (+ bias [n] float32) (+ residual [m, n]); bias and
 * residual may be NULL; x, residual and out bfloat16 (bf16) or float32.
 * input_quant: NULL (dynamic) or {scale, offset} (static). Returns 0, or -1
 * when out of memory. */
int linear_w8a8(const void *x, const uint8_t *packed, const float *bias, const void *residual, void *out, int64_t m,
                int64_t n, int64_t k, int64_t bf16, const float *input_quant) {
    w8_act *xq = malloc((size_t)(m * k) * sizeof(w8_act) + 64);
    float *row_scale = malloc((size_t)m * sizeof(float) + 64);
    if (xq == NULL || row_scale == NULL) {
        free(xq);
        free(row_scale);
        return -1;
    }
    const float *scales = (const float *)(packed + n * k);
    const int32_t *offsets = (const int32_t *)(packed + n * k + n * 4);
    const int64_t vecs = n / I8_VL, strips = (vecs + W8_TILE_VECS - 1) / W8_TILE_VECS;
    const int64_t rows = chunk_rows(m, strips, W8_TILE_ROWS), chunks = (m + rows - 1) / rows;
    const int64_t row_bytes = k * (bf16 ? 2 : 4);
    if (m * k >= QUANTIZE_PARALLEL) {
#pragma omp parallel for
        for (int64_t r = 0; r < m; r++)
            w8_quantize_row((const uint8_t *)x + r * row_bytes, k, (int)bf16, input_quant, xq + r * k, row_scale + r);
    } else {
        for (int64_t r = 0; r < m; r++)
            w8_quantize_row((const uint8_t *)x + r * row_bytes, k, (int)bf16, input_quant, xq + r * k, row_scale + r);
    }
#pragma omp parallel for schedule(guided)
    for (int64_t item = 0; item < chunks * strips; item++) {
        const int64_t first = item / strips * rows, last = MIN(m, first + rows), s = item % strips;
        const int64_t v = s * W8_TILE_VECS, col = v * I8_VL;
        const int nv = (int)MIN(W8_TILE_VECS, vecs - v);
        const int8_t *w = (const int8_t *)packed + v / HALVES * I8_BLOCK * k;
        for (int64_t r = first; r < last; r += W8_TILE_ROWS) {
            const int tile_rows = (int)MIN(W8_TILE_ROWS, last - r);
            const void *tile_residual = residual == NULL ? NULL : (const uint8_t *)residual + r * n * (bf16 ? 2 : 4);
            void *tile_out = (uint8_t *)out + r * n * (bf16 ? 2 : 4);
            /* Constant row and vector counts, so each case compiles to its own unrolled tile. */
#define TILE(ROWS, VECS) w8_tile(xq + r * k, row_scale + r, w, (int)(v % HALVES), scales, offsets, bias, \
                                 tile_residual, tile_out, n, k, col, (int)bf16, ROWS, VECS, r == first)
#if W8_TILE_VECS == 4
#define VECS_OF(ROWS)                 \
    switch (nv) {                     \
        case 4: TILE(ROWS, 4); break; \
        case 3: TILE(ROWS, 3); break; \
        case 2: TILE(ROWS, 2); break; \
        default: TILE(ROWS, 1);       \
    }
#elif W8_TILE_VECS == 3
#define VECS_OF(ROWS)                 \
    switch (nv) {                     \
        case 3: TILE(ROWS, 3); break; \
        case 2: TILE(ROWS, 2); break; \
        default: TILE(ROWS, 1);       \
    }
#else
#define VECS_OF(ROWS)                 \
    switch (nv) {                     \
        case 2: TILE(ROWS, 2); break; \
        default: TILE(ROWS, 1);       \
    }
#endif
            switch (tile_rows) {
#if W8_TILE_ROWS >= 8
                case 8: VECS_OF(8); break;
                case 7: VECS_OF(7); break;
#endif
#if W8_TILE_ROWS >= 6
                case 6: VECS_OF(6); break;
                case 5: VECS_OF(5); break;
#endif
                case 4: VECS_OF(4); break;
                case 3: VECS_OF(3); break;
                case 2: VECS_OF(2); break;
                default: VECS_OF(1);
            }
#undef VECS_OF
#undef TILE
        }
    }
    free(xq);
    free(row_scale);
    return 0;
}

/* ---------------------------------------------------------------- W4A8 ---- */

/* The packed weight: per column block of 16 outputs and group of 32 inputs,
 * 384 bytes: 4 vectors of 64 bytes, byte 4j + i of vector v holding output j's
 * codes for inputs 8v + i (low nibble) and 8v + 4 + i (high nibble), then the
 * 16 scales and the 16 lows as float32. One 64-byte load feeds 16 outputs times
 * 8 inputs of every row of a tile: a nibble mask (and a shift) gives each half
 * in the operand layout of vpdpbusd (or vpmaddubsw, whose int16 pairs vpmaddwd
 * then adds). */
#define Q4A8_TILE_ROWS (I8_VL == 16 ? 12 : (I8_VNNI ? 6 : 5)) /* sums, float sums, codes, mask, broadcast */
#define Q4A8_STRIP (48 / I8_VL) /* vectors per scheduled strip: 48 outputs */
_Static_assert(Q4A8_TILE_ROWS == 5 || Q4A8_TILE_ROWS == 6 || Q4A8_TILE_ROWS == 8 || Q4A8_TILE_ROWS == 12,
               "linear_q4a8 unrolls 5, 6, 8 or 12 rows");
#ifndef Q4A8_PREFETCH
/* Groups ahead that a strip's first tile prefetches (3 KB): as W8_PREFETCH,
 * 9.4 -> 12.4 GB/s. */
#define Q4A8_PREFETCH 8
#endif

int64_t q4a8_packed_bytes(int64_t n, int64_t k) {
    return n <= 0 || k <= 0 || n % I8_BLOCK || k % I8_GROUP ? -1 : n / I8_BLOCK * (k / I8_GROUP) * Q4A8_GROUP_BYTES;
}

/* codes [n, k] (0 to 15), scale and low [n, k / 32] float32 -> the layout above. */
void pack_linear_q4a8(const uint8_t *codes, const float *scale, const float *low, int64_t n, int64_t k,
                      uint8_t *packed) {
    const int64_t groups = k / I8_GROUP;
#pragma omp parallel for
    for (int64_t b = 0; b < n / I8_BLOCK; b++)
        for (int64_t g = 0; g < groups; g++) {
            uint8_t *dst = packed + (b * groups + g) * Q4A8_GROUP_BYTES;
            for (int v = 0; v < 4; v++)
                for (int j = 0; j < I8_BLOCK; j++)
                    for (int i = 0; i < 4; i++) {
                        const uint8_t *src = codes + (b * I8_BLOCK + j) * k + g * I8_GROUP + 8 * v + i;
                        dst[v * 64 + 4 * j + i] = (uint8_t)((src[0] & 15) | (src[4] & 15) << 4);
                    }
            float *tail = (float *)(dst + 256);
            for (int j = 0; j < I8_BLOCK; j++) {
                tail[j] = scale[(b * I8_BLOCK + j) * groups + g];
                tail[I8_BLOCK + j] = low[(b * I8_BLOCK + j) * groups + g];
            }
        }
}

/* Row r of x quantised per block of 32 inputs, as Q8_0: xq = round(x / s) in
 * [-127, 127] with s = amax / 127; per block s and s * sum(xq). */
static void q4a8_quantize_row(const void *x, int64_t k, int bf16, int8_t *xq, float *block_scale,
                              float *block_sum) {
    for (int64_t g = 0; g < k / I8_GROUP; g++) {
        const int64_t first = g * I8_GROUP;
        const float amax = amax_of((const uint8_t *)x + first * (bf16 ? 2 : 4), I8_GROUP, bf16);
        const float s = amax / 127.0f, divisor = amax > 0.0f ? s : 1.0f;
        ivec total = {0};
        for (int64_t i = first; i < first + I8_GROUP; i += I8_VL) {
            const ivec q = clamp_int(round_int(loadv(x, i, bf16) / divisor), -127, 127);
            total += q;
            const bvec b = __builtin_convertvector(q, bvec);
            memcpy(xq + i, &b, sizeof b);
        }
        int32_t sum = 0;
        for (int i = 0; i < I8_VL; i++) sum += total[i];
        block_scale[g] = s;
        block_sum[g] = s * (float)sum;
    }
}

/* The integer sums of one group: per row of the tile, each lane one output's
 * 32 products of codes (gw: the group's bytes at the tile's vector) and xq. */
INLINE void q4a8_group(const uint8_t *gw, const int8_t *xq, int64_t k, int rows, ivec *sums) {
    const ivec nibble = (ivec){0} + 0x0F0F0F0F;
#if I8_VNNI
    for (int i = 0; i < rows; i++) sums[i] = (ivec){0};
    for (int v = 0; v < 4; v++) {
        ivec lanes;
        memcpy(&lanes, gw + v * 64, sizeof lanes);
        const ivec lo = lanes & nibble, hi = (ivec)((uvec)lanes >> 4) & nibble;
        for (int i = 0; i < rows; i++) {
            sums[i] = dot_u8s8(sums[i], lo, broadcast32(xq + i * k + 8 * v));
            sums[i] = dot_u8s8(sums[i], hi, broadcast32(xq + i * k + 8 * v + 4));
        }
    }
#else
    __m256i pairs[Q4A8_TILE_ROWS]; /* int16 sums of products */
    for (int i = 0; i < rows; i++) pairs[i] = _mm256_setzero_si256();
    for (int v = 0; v < 4; v++) {
        ivec lanes;
        memcpy(&lanes, gw + v * 64, sizeof lanes);
        const ivec lo = lanes & nibble, hi = (ivec)((uvec)lanes >> 4) & nibble;
        for (int i = 0; i < rows; i++) {
            pairs[i] = _mm256_add_epi16(pairs[i], _mm256_maddubs_epi16(VEC_INT(lo),
                                                                        VEC_INT(broadcast32(xq + i * k + 8 * v))));
            pairs[i] = _mm256_add_epi16(pairs[i], _mm256_maddubs_epi16(VEC_INT(hi),
                                                                        VEC_INT(broadcast32(xq + i * k + 8 * v + 4))));
        }
    }
    for (int i = 0; i < rows; i++) sums[i] = (ivec)_mm256_madd_epi16(pairs[i], _mm256_set1_epi16(1));
#endif
}

/* rows x I8_VL outputs from column col on: w the packed weights of their
 * block, `half` the vector in it. */
INLINE void q4a8_tile(const int8_t *xq, const float *block_scale, const float *block_sum, const uint8_t *w, int half,
                      const float *bias, const void *residual, void *out, int64_t n, int64_t k, int64_t col, int bf16,
                      int rows, int prefetch) {
    const int64_t groups = k / I8_GROUP;
    fvec y[Q4A8_TILE_ROWS];
    for (int i = 0; i < rows; i++) y[i] = (fvec){0};
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *gw = w + g * Q4A8_GROUP_BYTES;
        if (prefetch)
            for (int line = 0; line < Q4A8_GROUP_BYTES; line += 64)
                _mm_prefetch((const char *)(gw + Q4A8_PREFETCH * Q4A8_GROUP_BYTES + line), _MM_HINT_T0);
        ivec sums[Q4A8_TILE_ROWS];
        q4a8_group(gw + half * I8_VL * 4, xq + g * I8_GROUP, k, rows, sums);
        fvec scale, low;
        memcpy(&scale, gw + 256 + half * I8_VL * 4, sizeof scale);
        memcpy(&low, gw + 320 + half * I8_VL * 4, sizeof low);
        for (int i = 0; i < rows; i++) {
            y[i] += __builtin_convertvector(sums[i], fvec) * scale * block_scale[i * groups + g];
            y[i] += low * block_sum[i * groups + g];
        }
    }
    for (int i = 0; i < rows; i++) finish(y[i], bias, residual, out, i * n + col, col, bf16);
}

/* out [m, n] = x [m, k] times a weight packed by pack_linear_q4a8 (+ bias [n]
 * float32) (+ residual [m, n]), the activations quantised per block of 32;
 * bias and residual may be NULL; x, residual and out bfloat16 (bf16) or
 * float32. Returns 0, or -1 when out of memory. */
int linear_q4a8(const void *x, const uint8_t *packed, const float *bias, const void *residual, void *out, int64_t m,
                int64_t n, int64_t k, int64_t bf16) {
    const int64_t groups = k / I8_GROUP;
    int8_t *xq = malloc((size_t)(m * k) + 64);
    float *block_scale = malloc((size_t)(m * groups) * 2 * sizeof(float) + 64);
    if (xq == NULL || block_scale == NULL) {
        free(xq);
        free(block_scale);
        return -1;
    }
    float *block_sum = block_scale + m * groups;
    const int64_t vecs = n / I8_VL, strips = (vecs + Q4A8_STRIP - 1) / Q4A8_STRIP;
    const int64_t rows = chunk_rows(m, strips, Q4A8_TILE_ROWS), chunks = (m + rows - 1) / rows;
    const int64_t row_bytes = k * (bf16 ? 2 : 4);
    if (m * k >= QUANTIZE_PARALLEL) {
#pragma omp parallel for
        for (int64_t r = 0; r < m; r++)
            q4a8_quantize_row((const uint8_t *)x + r * row_bytes, k, (int)bf16, xq + r * k, block_scale + r * groups,
                              block_sum + r * groups);
    } else {
        for (int64_t r = 0; r < m; r++)
            q4a8_quantize_row((const uint8_t *)x + r * row_bytes, k, (int)bf16, xq + r * k, block_scale + r * groups,
                              block_sum + r * groups);
    }
#pragma omp parallel for schedule(guided)
    for (int64_t item = 0; item < chunks * strips; item++) {
        const int64_t first = item / strips * rows, last = MIN(m, first + rows), s = item % strips;
        for (int64_t r = first; r < last; r += Q4A8_TILE_ROWS) {
            const int tile_rows = (int)MIN(Q4A8_TILE_ROWS, last - r);
            const void *tile_residual = residual == NULL ? NULL : (const uint8_t *)residual + r * n * (bf16 ? 2 : 4);
            void *tile_out = (uint8_t *)out + r * n * (bf16 ? 2 : 4);
            for (int64_t v = s * Q4A8_STRIP; v < MIN((s + 1) * Q4A8_STRIP, vecs); v++) {
                const uint8_t *w = packed + v / HALVES * groups * Q4A8_GROUP_BYTES;
#define TILE(ROWS) q4a8_tile(xq + r * k, block_scale + r * groups, block_sum + r * groups, w, (int)(v % HALVES), \
                             bias, tile_residual, tile_out, n, k, v * I8_VL, (int)bf16, ROWS, \
                             r == first && v % HALVES == 0)
                switch (tile_rows) {
#if Q4A8_TILE_ROWS >= 12
                    case 12: TILE(12); break;
                    case 11: TILE(11); break;
                    case 10: TILE(10); break;
                    case 9: TILE(9); break;
#endif
#if Q4A8_TILE_ROWS >= 8
                    case 8: TILE(8); break;
                    case 7: TILE(7); break;
#endif
#if Q4A8_TILE_ROWS >= 6
                    case 6: TILE(6); break;
#endif
                    case 5: TILE(5); break;
                    case 4: TILE(4); break;
                    case 3: TILE(3); break;
                    case 2: TILE(2); break;
                    default: TILE(1);
                }
#undef TILE
            }
        }
    }
    free(xq);
    free(block_scale);
    return 0;
}
#endif
