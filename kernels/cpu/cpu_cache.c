/* reshape_and_cache for kvfleet's CPU path: copy each new token's K and V heads into their
 * slots of the head-major paged cache.
 *
 * Why C: torch's advanced-index assignment into the permuted head-major view goes through
 * index_put's generic strided machinery, a few percent of every decode step; this is one
 * memcpy per (token, head).
 *
 * Layouts: key/value [tokens, kv_heads, head_dim] with heads adjacent and head_dim contiguous,
 * token strides given in elements (they may be views of a fused qkv row); k_cache, v_cache
 * [kv_heads, num_blocks, block_size, head_dim] contiguous, of the same element size as key and
 * value. slots[t] = block * block_size + offset; a negative slot is padding and is skipped. A
 * slot past the cache is an error before anything is written.
 *
 * Built with the other CPU kernels into one library by kernels/cpu/cpu_library.py.
 */

#include <stdint.h>

#include "cpu_cache.h"

enum { OK = 0, ERR_SHAPE = 1, ERR_SLOT = 2 };

int kvfleet_reshape_and_cache(const void *key, int64_t key_stride, const void *value,
                              int64_t value_stride, void *k_cache, void *v_cache,
                              const int64_t *slots, int64_t tokens, int kv_heads, int head_dim,
                              int block_size, int64_t num_blocks, int elem_size) {
    if (kv_heads <= 0 || head_dim <= 0 || block_size <= 0 || elem_size <= 0) return ERR_SHAPE;
    const int64_t capacity = num_blocks * block_size;
    for (int64_t t = 0; t < tokens; t++)
        if (slots[t] >= capacity) return ERR_SLOT;
    const size_t row = (size_t)head_dim * elem_size;
    const size_t head_plane = (size_t)capacity * row; /* one kv head's whole cache */
    for (int64_t t = 0; t < tokens; t++) {
        if (slots[t] < 0) continue;
        cache_token((const char *)key + t * key_stride * elem_size,
                    (const char *)value + t * value_stride * elem_size, k_cache, v_cache,
                    slots[t], kv_heads, row, head_plane);
    }
    return OK;
}
