/* Attention of one decoding step on CPU: one query token per row over its KV cache, the query heads of each
 * key/value head together, in fp32. Built and called by gspo_trl/decoding/cpu/kernel.py.
 *
 * A step near the end of a long rollout is a few rows over thousands of cached positions. PyTorch's CPU SDPA reads
 * such a cache at 10-16 GB/s on a 2-core EPYC; this loop reads it at 25-28 GB/s, near the memory bandwidth. Work is
 * split over (row, key/value head, chunk of positions) so that even one row keeps every thread busy; each chunk
 * keeps its own softmax maximum and sum, and the chunks are merged by those (the log-sum-exp merge of
 * flash-decoding). exp() is a polynomial the compiler vectorises (within 1e-7 relative of expf), and the sums are
 * reassociated (-fassociative-math), so the result is SDPA's within float rounding (1e-6), not bit for bit.
 */
#include <stdint.h>
#include <string.h>

#define MAX_GROUP 16   /* query heads per key/value head */
#define MAX_HEAD_DIM 256
#define MAX_CHUNK 512  /* positions per work item */
#define MASKED (-3.0e38f)

/* e^x for x <= 0 (a score minus its maximum): x = n ln2 + r with |r| <= ln2 / 2, e^r by its Taylor series to r^7
 * (truncation below 1e-8 relative), 2^n from the exponent bits. Below -87 it returns e^-87 (about 1.6e-38), which
 * a softmax sum of at least one term e^0 = 1 cannot tell from 0. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = __builtin_rintf(x * 1.44269504088896341f);
    const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f; /* ln2 in two parts */
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* query, out: (rows, kv_heads, group, head_dim), contiguous. keys, values: element (row, head, position, t) at
 * row * row_stride + head * head_stride + position * position_stride + t (the loop's preallocated buffers are
 * views with room to grow). mask: NULL, or byte (row, position) at row * mask_row_stride + position, nonzero where
 * the row attends (left padding is zero). scratch: rows * kv_heads * chunks * group * (head_dim + 2) floats. */
void decode_attention(const float *query, const float *keys, const float *values, int64_t row_stride,
                      int64_t head_stride, int64_t position_stride, const uint8_t *mask, int64_t mask_row_stride,
                      float *out, int rows, int kv_heads, int group, int head_dim, int64_t length, float scale,
                      int chunk, float *scratch, int threads) {
    const int64_t chunks = (length + chunk - 1) / chunk;
    const int64_t items = (int64_t)rows * kv_heads * chunks;
    const int64_t partial_size = (int64_t)group * (head_dim + 2); /* per item: (max, sum, weighted values) each */

#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t item = 0; item < items; item++) {
        const int64_t row_head = item / chunks, first = (item % chunks) * chunk;
        const int row = (int)(row_head / kv_heads), head = (int)(row_head % kv_heads);
        const int64_t n = first + chunk < length ? chunk : length - first;
        const float *q = query + row_head * group * head_dim;
        const float *k = keys + row * row_stride + head * head_stride + first * position_stride;
        const float *v = values + row * row_stride + head * head_stride + first * position_stride;
        const uint8_t *attends = mask ? mask + row * mask_row_stride + first : 0;
        float weights[MAX_GROUP][MAX_CHUNK], maximum[MAX_GROUP], total[MAX_GROUP], acc[MAX_GROUP][MAX_HEAD_DIM];

        for (int j = 0; j < group; j++) {
            maximum[j] = MASKED;
            for (int t = 0; t < head_dim; t++) acc[j][t] = 0.0f;
        }
        for (int64_t i = 0; i < n; i++) { /* scores, and each query head's maximum */
            const float *key = k + i * position_stride;
            const int on = !attends || attends[i];
            for (int j = 0; j < group; j++) {
                const float *qj = q + j * head_dim;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int t = 0; t < head_dim; t++) dot += qj[t] * key[t];
                const float score = on ? dot * scale : MASKED;
                weights[j][i] = score;
                maximum[j] = score > maximum[j] ? score : maximum[j];
            }
        }
        for (int j = 0; j < group; j++) { /* softmax numerators and their sum */
            float *w = weights[j], sum = 0.0f;
            const float m = maximum[j];
#pragma omp simd reduction(+ : sum)
            for (int64_t i = 0; i < n; i++) {
                const float e = w[i] == MASKED ? 0.0f : exp_nonpositive(w[i] - m);
                w[i] = e;
                sum += e;
            }
            total[j] = sum;
        }
        for (int64_t i = 0; i < n; i++) { /* the numerators' weighted values */
            const float *value = v + i * position_stride;
            for (int j = 0; j < group; j++) {
                const float w = weights[j][i];
                float *a = acc[j];
#pragma omp simd
                for (int t = 0; t < head_dim; t++) a[t] += w * value[t];
            }
        }
        float *partial = scratch + item * partial_size;
        for (int j = 0; j < group; j++) {
            float *p = partial + j * (head_dim + 2);
            p[0] = maximum[j];
            p[1] = total[j];
            memcpy(p + 2, acc[j], sizeof(float) * head_dim);
        }
    }

#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t row_head = 0; row_head < (int64_t)rows * kv_heads; row_head++) { /* merge the chunks */
        const float *partials = scratch + row_head * chunks * partial_size;
        for (int j = 0; j < group; j++) {
            float m = MASKED, sum = 0.0f, merged[MAX_HEAD_DIM];
            for (int64_t c = 0; c < chunks; c++) {
                const float *p = partials + c * partial_size + j * (head_dim + 2);
                m = p[1] > 0.0f && p[0] > m ? p[0] : m;
            }
            for (int t = 0; t < head_dim; t++) merged[t] = 0.0f;
            for (int64_t c = 0; c < chunks; c++) {
                const float *p = partials + c * partial_size + j * (head_dim + 2);
                if (p[1] == 0.0f) continue; /* every position of the chunk masked */
                const float w = exp_nonpositive(p[0] - m);
                sum += w * p[1];
                for (int t = 0; t < head_dim; t++) merged[t] += w * p[2 + t];
            }
            float *o = out + (row_head * group + j) * head_dim;
            for (int t = 0; t < head_dim; t++) o[t] = merged[t] / sum;
        }
    }
}
