/* The last step of a mixture-of-experts layer: each token's expert rows,
 * weighted and summed in float32, in one pass (torch takes a conversion, a
 * product and a serial index_add, each over all rows). */
#include "simd.h"

/* Below this many products a call runs on one thread: a decode step's rows. */
#define PARALLEL_PRODUCTS (1 << 16)

/* out [tokens, dim] float32 = sum over j < k of weights[t * k + j] *
 * rows[where[t * k + j]], rows bfloat16 [*, dim] (the experts' outputs in
 * their sorted order), pairs whose `where` is negative skipped (another
 * shard's experts). dim a multiple of 16. */
void moe_combine_bf16(const uint16_t *rows, const int64_t *where, const float *weights, float *out, int64_t tokens,
                      int64_t k, int64_t dim) {
#pragma omp parallel for if (tokens * k * dim >= PARALLEL_PRODUCTS)
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t i = 0; i < dim; i += LANES) {
            f32x16 sum = {0};
            for (int64_t j = 0; j < k; j++) {
                const int64_t row = where[t * k + j];
                if (row >= 0) sum += load16(rows, row * dim + i, 1) * weights[t * k + j];
            }
            store16(sum, out, t * dim + i, 0);
        }
}
