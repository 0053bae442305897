/* One token's K and V heads into their slot of the head-major paged cache ([kv_heads,
 * num_blocks, block_size, head_dim]): one memcpy per head. Shared by reshape_and_cache
 * (cpu_cache.c) and the fused rotary-and-cache (cpu_elementwise.c), so both store the same
 * bytes. `row` = head_dim * element size; `head_plane` = one kv head's whole cache in bytes. */
#ifndef KVFLEET_CPU_CACHE_H
#define KVFLEET_CPU_CACHE_H

#include <stdint.h>
#include <string.h>

static inline void cache_token(const char *k, const char *v, char *k_cache, char *v_cache,
                               int64_t slot, int kv_heads, size_t row, size_t head_plane) {
    char *kc = k_cache + (size_t)slot * row, *vc = v_cache + (size_t)slot * row;
    for (int h = 0; h < kv_heads; h++) {
        memcpy(kc + h * head_plane, k + h * row, row);
        memcpy(vc + h * head_plane, v + h * row, row);
    }
}

#endif
