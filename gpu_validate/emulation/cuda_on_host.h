// Just enough CUDA, on the CPU, to run gpu_validate/decode_attention.cu as C++.
//
// Think of a block as a room of threads that take turns at one desk: each CUDA thread is a
// fiber (ucontext), and only one works at a time. A thread gives up the desk only where a
// real GPU thread would wait for others, at a warp shuffle or at __syncthreads, so every
// thread sees what its warp or block wrote before the meeting point. Blocks run one after
// another. This checks a kernel's indexing, reductions and arithmetic order on any machine;
// it says nothing about its speed or its memory model (there are no data races to find, as
// no two threads ever run at once).
#pragma once

#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};
struct alignas(8) uint2 {
    unsigned int x, y;
};
inline uint2 make_uint2(unsigned int x, unsigned int y) { return uint2{x, y}; }

inline dim3 threadIdx, blockIdx, blockDim, gridDim;

using std::max;
using std::min;

inline float __int_as_float(unsigned int bits)
{
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

namespace kvsim_host {

// IEEE binary16 to float, exactly (every half is a float).
inline float fp16_to_float(unsigned short h)
{
    const int sign = (h >> 15) & 1, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
    float value;
    if (exponent == 0)
        value = std::ldexp(static_cast<float>(mantissa), -24);
    else if (exponent == 31)
        value = mantissa ? NAN : INFINITY;
    else
        value = std::ldexp(static_cast<float>(mantissa | 0x400), exponent - 25);
    return sign ? -value : value;
}

constexpr std::size_t kStackBytes = 128 * 1024;
constexpr unsigned kWarpSize = 32;

struct Fiber {
    ucontext_t context;
    std::unique_ptr<char[]> stack;
    bool done = false;
};

// Threads wait here until `parties` have arrived; the generation tells a waiter it is over.
struct Barrier {
    unsigned arrived = 0;
    unsigned generation = 0;
};

// The block being run: its fibers, whose turn it is, and its meeting points.
struct Block {
    std::vector<Fiber> fibers;
    unsigned current = 0;
    ucontext_t scheduler;
    std::vector<Barrier> warp_barriers;
    Barrier block_barrier;
    std::vector<float> shuffle_slots;     // [2 (alternating calls)][warps][32]
    std::vector<unsigned> shuffle_calls;  // per thread
    unsigned long idle_turns = 0;         // turns in a row in which no barrier opened
    std::function<void()> body;
};

inline Block* running = nullptr;

inline void yield()
{
    Fiber& fiber = running->fibers[running->current];
    swapcontext(&fiber.context, &running->scheduler);
}

inline void wait(Barrier& barrier, unsigned parties)
{
    const unsigned generation = barrier.generation;
    if (++barrier.arrived == parties) {
        barrier.arrived = 0;
        ++barrier.generation;
        running->idle_turns = 0;
        return;
    }
    while (barrier.generation == generation) yield();
}

inline void fiber_main()
{
    running->body();
    running->fibers[running->current].done = true;
    running->idle_turns = 0;
}  // returns to the scheduler through uc_link

// Run one block to the end: each live thread gets a turn in order until all are done.
// Returns 0, or -1 when they can make no progress (some wait at a barrier that the others
// never reach).
// (Kept out of line: swapcontext and getcontext return twice, like setjmp.)
__attribute__((noinline)) inline int run_block(Block& state)
{
    const unsigned threads = static_cast<unsigned>(state.fibers.size());
    for (Fiber& fiber : state.fibers) {
        fiber.done = false;
        getcontext(&fiber.context);
        fiber.context.uc_stack.ss_sp = fiber.stack.get();
        fiber.context.uc_stack.ss_size = kStackBytes;
        fiber.context.uc_link = &state.scheduler;
        makecontext(&fiber.context, fiber_main, 0);
    }
    unsigned live = threads;
    while (live > 0) {
        for (unsigned t = 0; t < threads; ++t) {
            Fiber& fiber = state.fibers[t];
            if (fiber.done) continue;
            state.current = t;
            threadIdx = dim3{t, 0, 0};
            ++state.idle_turns;
            swapcontext(&state.scheduler, &fiber.context);
            if (fiber.done) --live;
        }
        if (live > 0 && state.idle_turns > 2ul * threads) return -1;
    }
    return 0;
}

// Run `body` as every thread of every block of the grid. Returns 0, -1 on a deadlock, or -2
// when the block shape is not whole warps in x.
template <class Body>
int launch(dim3 grid, dim3 block, Body body)
{
    if (block.x == 0 || block.x % kWarpSize || block.y != 1 || block.z != 1) return -2;
    const unsigned threads = block.x, warps = threads / kWarpSize;
    Block state;
    state.body = body;
    state.fibers.resize(threads);
    for (Fiber& fiber : state.fibers) fiber.stack.reset(new char[kStackBytes]);
    running = &state;
    gridDim = grid;
    blockDim = block;
    int status = 0;
    for (unsigned z = 0; z < grid.z && status == 0; ++z)
        for (unsigned y = 0; y < grid.y && status == 0; ++y)
            for (unsigned x = 0; x < grid.x && status == 0; ++x) {
                blockIdx = dim3{x, y, z};
                state.warp_barriers.assign(warps, Barrier{});
                state.block_barrier = Barrier{};
                state.shuffle_slots.assign(2 * warps * kWarpSize, 0.0f);
                state.shuffle_calls.assign(threads, 0);
                state.idle_turns = 0;
                status = run_block(state);
            }
    running = nullptr;
    return status;
}

}  // namespace kvsim_host

inline float __shfl_xor_sync(unsigned /*mask*/, float value, int lane_mask, int /*width*/ = 32)
{
    using namespace kvsim_host;
    Block& block = *running;
    const unsigned t = threadIdx.x, warp = t / kWarpSize, lane = t % kWarpSize;
    const unsigned warps = blockDim.x / kWarpSize;
    // Alternate two slot sets: a lane can only come back to this set after the barrier of
    // the next call, which every lane reaches only after reading this one.
    const unsigned parity = block.shuffle_calls[t]++ & 1u;
    float* slots = &block.shuffle_slots[(parity * warps + warp) * kWarpSize];
    slots[lane] = value;
    wait(block.warp_barriers[warp], kWarpSize);
    return slots[lane ^ static_cast<unsigned>(lane_mask)];
}

inline void __syncthreads() { kvsim_host::wait(kvsim_host::running->block_barrier, blockDim.x); }
