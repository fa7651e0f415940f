/* One-pass CPU kernels for the elementwise parts of a Llama-family layer,
 * which torch runs as several passes each (RMSNorm: square, mean, rsqrt and
 * two products; rotary: a concatenation, a negation, two products and a sum;
 * SiLU times up: two). Each computes in float32 and rounds once to the
 * tensor's dtype. Rows are split over torch's OpenMP team when there are
 * enough of them to pay for it.
 *
 * Sizes: dim must be a multiple of 16, head_dim of 32 (cpu_kernels.py checks). */
#include <math.h>

#include "simd.h"

/* Below this many elements a call runs on one thread: a decode step's rows. */
#define PARALLEL_ELEMENTS (1 << 16)

/* out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight; x rows `x_stride` apart, out contiguous. */
INLINE void rms_norm(const void *x, int64_t x_stride, const void *weight, void *out, int64_t rows, int64_t dim,
                     float eps, int bf16) {
#pragma omp parallel for if (rows * dim >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        f32x16 squares = {0};
        for (int64_t i = 0; i < dim; i += LANES) {
            const f32x16 v = load16(x, r * x_stride + i, bf16);
            squares += v * v;
        }
        const float scale = 1.0f / sqrtf(sum16(squares) / (float)dim + eps);
        for (int64_t i = 0; i < dim; i += LANES)
            store16(load16(x, r * x_stride + i, bf16) * scale * load16(weight, i, bf16), out, r * dim + i, bf16);
    }
}

/* out[r][i] = silu(gate_up[r][i]) * gate_up[r][dim + i]: the gate and up halves of one matmul. */
INLINE void silu_mul(const void *gate_up, void *out, int64_t rows, int64_t dim, int bf16) {
#pragma omp parallel for if (rows * dim >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < dim; i += LANES) {
            const f32x16 gate = load16(gate_up, 2 * r * dim + i, bf16);
            const f32x16 up = load16(gate_up, 2 * r * dim + dim + i, bf16);
            store16(gate / (1.0f + exp16(-gate)) * up, out, r * dim + i, bf16);
        }
}

/* Rotary embedding in place, rotate-half form, on `heads` heads of head_dim at
 * the start of each row (rows `row_stride` apart): x' = x * cos + rotate_half(x) * sin,
 * with cos and sin [rows][head_dim]. */
INLINE void rotary(void *x, int64_t row_stride, const void *cos, const void *sin, int64_t rows, int64_t heads,
                   int64_t head_dim, int bf16) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for if (rows * heads * head_dim >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < heads; h++)
            for (int64_t i = 0; i < half; i += LANES) {
                const int64_t at = r * row_stride + h * head_dim + i, t = r * head_dim + i;
                const f32x16 x1 = load16(x, at, bf16), x2 = load16(x, at + half, bf16);
                store16(x1 * load16(cos, t, bf16) - x2 * load16(sin, t, bf16), x, at, bf16);
                store16(x2 * load16(cos, t + half, bf16) + x1 * load16(sin, t + half, bf16), x, at + half, bf16);
            }
}

#define ENTRY_POINTS(SUFFIX, BF16)                                                                               \
    void rms_norm_##SUFFIX(const void *x, int64_t x_stride, const void *weight, void *out, int64_t rows,       \
                           int64_t dim, float eps) {                                                            \
        rms_norm(x, x_stride, weight, out, rows, dim, eps, BF16);                                               \
    }                                                                                                           \
    void silu_mul_##SUFFIX(const void *gate_up, void *out, int64_t rows, int64_t dim) {                        \
        silu_mul(gate_up, out, rows, dim, BF16);                                                                \
    }                                                                                                           \
    void rotary_##SUFFIX(void *x, int64_t row_stride, const void *cos, const void *sin, int64_t rows,          \
                         int64_t heads, int64_t head_dim) {                                                     \
        rotary(x, row_stride, cos, sin, rows, heads, head_dim, BF16);                                           \
    }

ENTRY_POINTS(f32, 0)
ENTRY_POINTS(bf16, 1)
