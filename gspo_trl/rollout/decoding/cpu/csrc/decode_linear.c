/* The product x @ weightᵀ (+ bias) of a decoding step on CPU for one to eight rows, in fp32. Built and called by
 * gspo_trl/decoding/cpu/kernel.py; linear.py measures it against its other forms and takes it where it is faster.
 *
 * At the end of a rollout a step multiplies every weight matrix by one to a few rows, so it should run at the
 * memory bandwidth. On a 2-core EPYC MKL reads such a product's weights at a third of it (F.linear) or two thirds
 * (the transposed form); this loop, near all of it. It reads each weight row once from memory, while the few input
 * rows stay in the first-level cache: one dot product per input row, 16 lanes per dot, the lanes summed at the end.
 * The result is F.linear's within float rounding, not bit for bit. Compiled without -fassociative-math, every sum
 * keeps this order whatever the row count, and each output is summed by one thread (output rows are split between
 * the threads): a row's result does not depend on the rows beside it or on the thread count.
 */
#include <stdint.h>

#define LANES 16
#define MAX_ROWS 8

/* weight: (out, in), x: (rows, in), y: (rows, out), all contiguous; bias: NULL or (out). */
#define PRODUCT(R)                                                                                                   \
    static void product_##R(const float *restrict weight, const float *restrict x, const float *restrict bias,      \
                            float *restrict y, int64_t out, int64_t in, int threads) {                               \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                                            \
        for (int64_t o = 0; o < out; o++) {                                                                          \
            const float *restrict w = weight + o * in;                                                               \
            float sums[R][LANES] = {{0.0f}};                                                                         \
            int64_t i = 0;                                                                                           \
            for (; i + LANES <= in; i += LANES)                                                                      \
                for (int r = 0; r < R; r++) {                                                                        \
                    _Pragma("omp simd")                                                                              \
                    for (int l = 0; l < LANES; l++) sums[r][l] += w[i + l] * x[r * in + i + l];                      \
                }                                                                                                    \
            for (int r = 0; r < R; r++) {                                                                            \
                float dot = 0.0f;                                                                                    \
                for (int64_t j = i; j < in; j++) dot += w[j] * x[r * in + j];                                        \
                for (int l = 0; l < LANES; l++) dot += sums[r][l];                                                   \
                y[r * out + o] = bias ? dot + bias[o] : dot;                                                         \
            }                                                                                                        \
        }                                                                                                            \
    }

PRODUCT(1)
PRODUCT(2)
PRODUCT(3)
PRODUCT(4)
PRODUCT(5)
PRODUCT(6)
PRODUCT(7)
PRODUCT(8)

/* Returns 0, or -1 for a row count outside 1..MAX_ROWS (nothing written). */
int decode_linear(const float *weight, const float *x, const float *bias, float *y, int64_t out, int64_t in,
                  int rows, int threads) {
    switch (rows) {
        case 1: product_1(weight, x, bias, y, out, in, threads); return 0;
        case 2: product_2(weight, x, bias, y, out, in, threads); return 0;
        case 3: product_3(weight, x, bias, y, out, in, threads); return 0;
        case 4: product_4(weight, x, bias, y, out, in, threads); return 0;
        case 5: product_5(weight, x, bias, y, out, in, threads); return 0;
        case 6: product_6(weight, x, bias, y, out, in, threads); return 0;
        case 7: product_7(weight, x, bias, y, out, in, threads); return 0;
        case 8: product_8(weight, x, bias, y, out, in, threads); return 0;
        default: return -1;
    }
}
