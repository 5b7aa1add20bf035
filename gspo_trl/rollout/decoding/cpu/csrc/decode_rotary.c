/* The rotary position embedding of one decoding step on CPU and the step's write into the KV cache, in fp32. Built
 * and called by gspo_trl/decoding/cpu/kernel.py for forward.py's steps.
 *
 * transformers' apply_rotary_pos_emb computes q * cos + rotate_half(q) * sin for the query and the key: about 16
 * small PyTorch operators per layer, then two copies into the cache, a tenth of a one-row step on a 2-core EPYC.
 * This loop does the same arithmetic in one call: each product and the sum rounded on its own (compiled with
 * -ffp-contract=off, no fused multiply-add), so the result is PyTorch's bit for bit.
 */
#include <stdint.h>
#include <string.h>

/* out = x * c + rotate_half(x) * s, rotate_half(x) = (-x[half:], x[:half]). */
static void rotate(const float *x, const float *c, const float *s, float *out, int half) {
    for (int i = 0; i < half; i++) out[i] = x[i] * c[i] + (-x[i + half]) * s[i];
    for (int i = half; i < 2 * half; i++) out[i] = x[i] * c[i] + x[i - half] * s[i];
}

/* query: (rows, heads, head_dim), key and value: (rows, kv_heads, head_dim), cos and sin: (rows, head_dim), all
 * contiguous. query_out: (rows, heads, head_dim), contiguous. key_slot, value_slot: the new position of the cache,
 * element (row, head, t) at row * row_stride + head * head_stride + t. */
void decode_rotary(const float *query, const float *key, const float *value, const float *cos, const float *sin,
                   float *query_out, float *key_slot, float *value_slot, int64_t row_stride, int64_t head_stride,
                   int rows, int heads, int kv_heads, int head_dim) {
    const int half = head_dim / 2;
    for (int row = 0; row < rows; row++) {
        const float *c = cos + (int64_t)row * head_dim, *s = sin + (int64_t)row * head_dim;
        for (int head = 0; head < heads; head++) {
            const int64_t at = ((int64_t)row * heads + head) * head_dim;
            rotate(query + at, c, s, query_out + at, half);
        }
        for (int head = 0; head < kv_heads; head++) {
            const int64_t at = ((int64_t)row * kv_heads + head) * head_dim;
            const int64_t slot = row * row_stride + head * head_stride;
            rotate(key + at, c, s, key_slot + slot, half);
            memcpy(value_slot + slot, value + at, sizeof(float) * (size_t)head_dim);
        }
    }
}
