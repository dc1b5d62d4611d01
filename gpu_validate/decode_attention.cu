// Decode attention over a KV cache, one source, two entry points.
//
// decode_contiguous reads K/V laid out [seqs, kv_heads, max_len, head_dim];
// decode_paged reads K/V laid out [blocks, kv_heads, block_size, head_dim] through
// block_tables int32 [seqs, max_blocks]. The block-table lookup (kv_row) is the only
// difference: both instantiate the same template.
//
// One thread block per (query head, sequence); blockDim.x is a multiple of 32, at most
// 32 * MAX_WARPS. Warp w takes tokens in groups of TOKENS_PER_WARP (w*U .. w*U+U-1, then
// num_warps*U further on) and keeps an online softmax (running max m, running sum l,
// accumulator acc). Within a token row each lane owns LANE_ELEMS consecutive elements per
// SLICE, read as one 8-byte load, so a row of head_dim 128 is one coalesced 256-byte read.
// All K and V rows of a group are loaded before any is used: decode attention is bound by how
// many loads are in flight, not by arithmetic.
//
// fp16 storage (kept as raw 16-bit words and converted by one PTX instruction, so NVRTC needs
// no CUDA headers), fp32 accumulation, grouped-query attention (num_heads a multiple of
// num_kv_heads), head_dim a multiple of 4 up to MAX_SLICES * SLICE, any context length >= 1,
// block_size any positive value. Output is fp32. The host checks these before launching.
//
// Built with -DKVSIM_HOST_EMULATION this same text also compiles as C++ for the CPU, under the
// small CUDA emulation in gpu_validate/emulation/, which is how the test suite runs it without
// a GPU.

#define LANE_ELEMS 4                 // fp16 elements per lane per slice: one 8-byte load
#define SLICE (32 * LANE_ELEMS)      // elements one warp-wide load covers
#define MAX_SLICES 2                 // head_dim <= 256
#define MAX_WARPS 8                  // blockDim.x <= 256
#ifndef TOKENS_PER_WARP               // a build option (-DTOKENS_PER_WARP=N) for tuning
#define TOKENS_PER_WARP 4            // rows of K and of V in flight per lane
#endif

typedef unsigned short fp16_bits;

// -inf without math.h, which NVRTC does not provide.
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float fp16_to_float(fp16_bits h)
{
#ifdef KVSIM_HOST_EMULATION
    return kvsim_host::fp16_to_float(h);
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#endif
}

// Four consecutive fp16 values, as loaded: element 0 is the low half of x (little-endian).
__device__ __forceinline__ void unpack4(uint2 raw, float* f)
{
    f[0] = fp16_to_float((fp16_bits)(raw.x & 0xffffu));
    f[1] = fp16_to_float((fp16_bits)(raw.x >> 16));
    f[2] = fp16_to_float((fp16_bits)(raw.y & 0xffffu));
    f[3] = fp16_to_float((fp16_bits)(raw.y >> 16));
}

// Row index of token t of this sequence's kv_head: the only place the layouts differ.
template <bool PAGED>
__device__ __forceinline__ size_t kv_row(const int* __restrict__ block_tables, int seq,
                                         int kv_head, int t, int num_kv_heads,
                                         int stride_len, int max_blocks)
{
    if (PAGED) {
        const int block = block_tables[(size_t)seq * max_blocks + t / stride_len];
        return ((size_t)block * num_kv_heads + kv_head) * stride_len + t % stride_len;
    }
    return ((size_t)seq * num_kv_heads + kv_head) * stride_len + t;
}

template <bool PAGED>
__device__ __forceinline__ void attend(
    float* __restrict__ out,                  // [seqs, num_heads, head_dim]
    const fp16_bits* __restrict__ q,          // [seqs, num_heads, head_dim]
    const fp16_bits* __restrict__ k_cache,
    const fp16_bits* __restrict__ v_cache,
    const int* __restrict__ block_tables,     // paged only: [seqs, max_blocks]
    const int* __restrict__ context_lens,     // [seqs]
    int num_heads, int num_kv_heads, int head_dim,
    int stride_len,                           // contiguous: max_len; paged: block_size
    int max_blocks, float scale)
{
    const int head = blockIdx.x;
    const int seq = blockIdx.y;
    const int kv_head = head / (num_heads / num_kv_heads);
    const int ctx = context_lens[seq];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int num_warps = blockDim.x >> 5;
    const int slices = (head_dim + SLICE - 1) / SLICE;

    // This lane's elements: d = s * SLICE + lane * LANE_ELEMS + j. The scale is folded into q.
    bool owns[MAX_SLICES];
    float qv[MAX_SLICES][LANE_ELEMS];
    float acc[MAX_SLICES][LANE_ELEMS];
    const fp16_bits* q_row = q + ((size_t)seq * num_heads + head) * head_dim;
#pragma unroll
    for (int s = 0; s < MAX_SLICES; ++s) {
        const int d0 = s * SLICE + lane * LANE_ELEMS;
        owns[s] = s < slices && d0 < head_dim;
#pragma unroll
        for (int j = 0; j < LANE_ELEMS; ++j) {
            qv[s][j] = owns[s] ? fp16_to_float(q_row[d0 + j]) * scale : 0.0f;
            acc[s][j] = 0.0f;
        }
    }
    float m = NEG_INF;
    float l = 0.0f;

    for (int first = warp * TOKENS_PER_WARP; first < ctx;
         first += num_warps * TOKENS_PER_WARP) {
        // Issue every load of the group first. Tokens past the end re-read the last valid
        // row (cached, always in bounds) and are masked below.
        uint2 k_raw[TOKENS_PER_WARP][MAX_SLICES];
        uint2 v_raw[TOKENS_PER_WARP][MAX_SLICES];
#pragma unroll
        for (int u = 0; u < TOKENS_PER_WARP; ++u) {
            const int t = min(first + u, ctx - 1);
            const size_t row = kv_row<PAGED>(block_tables, seq, kv_head, t, num_kv_heads,
                                             stride_len, max_blocks) * head_dim;
#pragma unroll
            for (int s = 0; s < MAX_SLICES; ++s) {
                const size_t at = row + s * SLICE + lane * LANE_ELEMS;
                k_raw[u][s] = owns[s] ? *reinterpret_cast<const uint2*>(k_cache + at)
                                      : make_uint2(0u, 0u);
                v_raw[u][s] = owns[s] ? *reinterpret_cast<const uint2*>(v_cache + at)
                                      : make_uint2(0u, 0u);
            }
        }
        float score[TOKENS_PER_WARP];
#pragma unroll
        for (int u = 0; u < TOKENS_PER_WARP; ++u) {
            float dot = 0.0f;
#pragma unroll
            for (int s = 0; s < MAX_SLICES; ++s) {
                float kf[LANE_ELEMS];
                unpack4(k_raw[u][s], kf);
#pragma unroll
                for (int j = 0; j < LANE_ELEMS; ++j) dot += qv[s][j] * kf[j];
            }
            score[u] = dot;
        }
        // Butterfly sums, the group's tokens interleaved so their shuffles overlap.
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) {
#pragma unroll
            for (int u = 0; u < TOKENS_PER_WARP; ++u)
                score[u] += __shfl_xor_sync(0xffffffffu, score[u], offset);
        }
        // One rescale per group: the new max covers all of its valid tokens.
        float group_max = m;
#pragma unroll
        for (int u = 0; u < TOKENS_PER_WARP; ++u)
            if (first + u < ctx) group_max = fmaxf(group_max, score[u]);
        const float correction = expf(m - group_max);  // 0 on the first group (m = -inf)
        l *= correction;
#pragma unroll
        for (int s = 0; s < MAX_SLICES; ++s) {
#pragma unroll
            for (int j = 0; j < LANE_ELEMS; ++j) acc[s][j] *= correction;
        }
#pragma unroll
        for (int u = 0; u < TOKENS_PER_WARP; ++u) {
            if (first + u >= ctx) continue;  // warp-uniform
            const float p = expf(score[u] - group_max);
            l += p;
#pragma unroll
            for (int s = 0; s < MAX_SLICES; ++s) {
                float vf[LANE_ELEMS];
                unpack4(v_raw[u][s], vf);
#pragma unroll
                for (int j = 0; j < LANE_ELEMS; ++j) acc[s][j] += p * vf[j];
            }
        }
        m = group_max;
    }

    // Combine the warps' partial softmax states; a warp that saw no token has l == 0.
    __shared__ float warp_m[MAX_WARPS];
    __shared__ float warp_l[MAX_WARPS];
    __shared__ float warp_acc[MAX_WARPS][MAX_SLICES * SLICE];
    if (lane == 0) {
        warp_m[warp] = m;
        warp_l[warp] = l;
    }
#pragma unroll
    for (int s = 0; s < MAX_SLICES; ++s) {
        if (!owns[s]) continue;
#pragma unroll
        for (int j = 0; j < LANE_ELEMS; ++j)
            warp_acc[warp][s * SLICE + lane * LANE_ELEMS + j] = acc[s][j];
    }
    __syncthreads();
    float big = NEG_INF;
    for (int w = 0; w < num_warps; ++w) big = fmaxf(big, warp_m[w]);
    float total = 0.0f;
    for (int w = 0; w < num_warps; ++w)
        if (warp_l[w] > 0.0f) total += warp_l[w] * expf(warp_m[w] - big);
    float* out_row = out + ((size_t)seq * num_heads + head) * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float value = 0.0f;
        for (int w = 0; w < num_warps; ++w)
            if (warp_l[w] > 0.0f) value += warp_acc[w][d] * expf(warp_m[w] - big);
        out_row[d] = value / total;
    }
}

extern "C" __global__ void decode_contiguous(
    float* out, const fp16_bits* q, const fp16_bits* k_cache, const fp16_bits* v_cache,
    const int* context_lens, int num_heads, int num_kv_heads, int head_dim, int max_len,
    float scale)
{
    attend<false>(out, q, k_cache, v_cache, nullptr, context_lens, num_heads, num_kv_heads,
                  head_dim, max_len, 0, scale);
}

extern "C" __global__ void decode_paged(
    float* out, const fp16_bits* q, const fp16_bits* k_cache, const fp16_bits* v_cache,
    const int* block_tables, const int* context_lens, int num_heads, int num_kv_heads,
    int head_dim, int block_size, int max_blocks, float scale)
{
    attend<true>(out, q, k_cache, v_cache, block_tables, context_lens, num_heads,
                 num_kv_heads, head_dim, block_size, max_blocks, scale);
}
