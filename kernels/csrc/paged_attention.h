/* paged_attention.c's decode attention, for the kernels linked with it (llama_decode.c). */
#ifndef MOEMESH_PAGED_ATTENTION_H
#define MOEMESH_PAGED_ATTENTION_H

#include <stdint.h>

/* out[r, h] = softmax(scale * q[r, h] . K[r, :len]) @ V[r, :len] for requests [r_begin, r_end):
 * paged_attention.c says the layouts and return codes */
int paged_decode_attention(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                           const int32_t *block_tables, int64_t max_blocks, const int32_t *context_lens,
                           int64_t num_blocks, int64_t block_size, int64_t heads, int64_t kv_heads, int64_t head_dim,
                           float scale, void *out, int64_t r_begin, int64_t r_end, int bf16);

#endif
