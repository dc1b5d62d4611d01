// Decode attention over a KV cache, one source, two entry points.
//
// decode_contiguous reads K/V laid out [seqs, kv_heads, max_len, head_dim];
// decode_paged reads K/V laid out [blocks, kv_heads, block_size, head_dim] through
// block_tables int32 [seqs, max_blocks]. The block-table lookup is the only difference: both
// instantiate the same template.
//
// One thread block per (query head, sequence). Each warp walks tokens t = warp, warp + W, ...
// and keeps an online softmax (running max m, running sum l, accumulator acc); lanes split
// head_dim (up to 8 elements each, so head_dim <= 256). fp16 storage, fp32 accumulation,
// grouped-query attention (num_heads a multiple of num_kv_heads). Output is fp32.

#include <cuda_fp16.h>

#define MAX_PER_LANE 8
#define MAX_WARPS 8

template <bool PAGED>
__device__ __forceinline__ void attend(
    float* __restrict__ out,              // [seqs, num_heads, head_dim]
    const __half* __restrict__ q,         // [seqs, num_heads, head_dim]
    const __half* __restrict__ k_cache,
    const __half* __restrict__ v_cache,
    const int* __restrict__ block_tables, // paged only: [seqs, max_blocks]
    const int* __restrict__ context_lens, // [seqs]
    int num_heads, int num_kv_heads, int head_dim,
    int stride_len,                       // contiguous: max_len; paged: block_size
    int max_blocks, float scale)
{
    const int head = blockIdx.x;
    const int seq = blockIdx.y;
    const int kv_head = head / (num_heads / num_kv_heads);
    const int ctx = context_lens[seq];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int num_warps = blockDim.x >> 5;
    const int per_lane = (head_dim + 31) / 32;

    float qv[MAX_PER_LANE];
    float acc[MAX_PER_LANE];
    const __half* q_row = q + ((size_t)seq * num_heads + head) * head_dim;
    for (int i = 0; i < MAX_PER_LANE; ++i) {
        const int d = lane + 32 * i;
        qv[i] = (i < per_lane && d < head_dim) ? __half2float(q_row[d]) : 0.0f;
        acc[i] = 0.0f;
    }
    float m = -INFINITY;
    float l = 0.0f;

    for (int t = warp; t < ctx; t += num_warps) {
        size_t row;
        if (PAGED) {
            const int block = block_tables[(size_t)seq * max_blocks + t / stride_len];
            row = ((size_t)block * num_kv_heads + kv_head) * stride_len + t % stride_len;
        } else {
            row = ((size_t)seq * num_kv_heads + kv_head) * stride_len + t;
        }
        const __half* k_row = k_cache + row * head_dim;
        const __half* v_row = v_cache + row * head_dim;
        float s = 0.0f;
        for (int i = 0; i < per_lane; ++i) {
            const int d = lane + 32 * i;
            if (d < head_dim) s += qv[i] * __half2float(k_row[d]);
        }
        for (int offset = 16; offset > 0; offset >>= 1)
            s += __shfl_xor_sync(0xffffffffu, s, offset);
        s *= scale;
        const float m_new = fmaxf(m, s);
        const float correction = expf(m - m_new);
        const float p = expf(s - m_new);
        l = l * correction + p;
        for (int i = 0; i < per_lane; ++i) {
            const int d = lane + 32 * i;
            if (d < head_dim) acc[i] = acc[i] * correction + p * __half2float(v_row[d]);
        }
        m = m_new;
    }

    // Combine the warps' partial softmax states.
    __shared__ float warp_m[MAX_WARPS];
    __shared__ float warp_l[MAX_WARPS];
    __shared__ float warp_acc[MAX_WARPS][MAX_PER_LANE * 32];
    if (lane == 0) {
        warp_m[warp] = m;
        warp_l[warp] = l;
    }
    for (int i = 0; i < per_lane; ++i) warp_acc[warp][lane + 32 * i] = acc[i];
    __syncthreads();
    if (warp == 0) {
        float big = -INFINITY;
        for (int w = 0; w < num_warps; ++w) big = fmaxf(big, warp_m[w]);
        float total = 0.0f;
        for (int w = 0; w < num_warps; ++w)
            if (warp_l[w] > 0.0f) total += warp_l[w] * expf(warp_m[w] - big);
        float* out_row = out + ((size_t)seq * num_heads + head) * head_dim;
        for (int i = 0; i < per_lane; ++i) {
            const int d = lane + 32 * i;
            if (d >= head_dim) continue;
            float value = 0.0f;
            for (int w = 0; w < num_warps; ++w)
                if (warp_l[w] > 0.0f) value += warp_acc[w][d] * expf(warp_m[w] - big);
            out_row[d] = value / total;
        }
    }
}

extern "C" __global__ void decode_contiguous(
    float* out, const __half* q, const __half* k_cache, const __half* v_cache,
    const int* context_lens, int num_heads, int num_kv_heads, int head_dim, int max_len,
    float scale)
{
    attend<false>(out, q, k_cache, v_cache, nullptr, context_lens, num_heads, num_kv_heads,
                  head_dim, max_len, 0, scale);
}

extern "C" __global__ void decode_paged(
    float* out, const __half* q, const __half* k_cache, const __half* v_cache,
    const int* block_tables, const int* context_lens, int num_heads, int num_kv_heads,
    int head_dim, int block_size, int max_blocks, float scale)
{
    attend<true>(out, q, k_cache, v_cache, block_tables, context_lens, num_heads,
                 num_kv_heads, head_dim, block_size, max_blocks, scale);
}
