// The kernel source compiled for the CPU, with one C entry point per kernel for ctypes.
// Each takes the grid and block sizes first, then exactly the kernel's own arguments.

#include "cuda_on_host.h"
#include "../decode_attention.cu"

extern "C" int kvsim_host_decode_contiguous(
    unsigned grid_x, unsigned grid_y, unsigned block_x, float* out, const fp16_bits* q,
    const fp16_bits* k_cache, const fp16_bits* v_cache, const int* context_lens,
    int num_heads, int num_kv_heads, int head_dim, int max_len, float scale)
{
    return kvsim_host::launch(dim3{grid_x, grid_y, 1}, dim3{block_x, 1, 1}, [=] {
        decode_contiguous(out, q, k_cache, v_cache, context_lens, num_heads, num_kv_heads,
                          head_dim, max_len, scale);
    });
}

extern "C" int kvsim_host_decode_paged(
    unsigned grid_x, unsigned grid_y, unsigned block_x, float* out, const fp16_bits* q,
    const fp16_bits* k_cache, const fp16_bits* v_cache, const int* block_tables,
    const int* context_lens, int num_heads, int num_kv_heads, int head_dim, int block_size,
    int max_blocks, float scale)
{
    return kvsim_host::launch(dim3{grid_x, grid_y, 1}, dim3{block_x, 1, 1}, [=] {
        decode_paged(out, q, k_cache, v_cache, block_tables, context_lens, num_heads,
                     num_kv_heads, head_dim, block_size, max_blocks, scale);
    });
}
