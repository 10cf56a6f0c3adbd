// A CPU emulator for the ldmopt CUDA kernels (tests only): compiles the kernel sources with a host C++ compiler and
// runs every CUDA thread of a block as a fiber (ucontext), one block after another. __syncthreads, __syncwarp and
// warp shuffles are real barriers between the fibers; a barrier that not every thread reaches (divergent
// __syncthreads, a thread returning early) is reported as a deadlock instead of silently passing. __shared__ becomes
// a function-local static, which is exact because one block runs at a time. WMMA fragments hold whole tiles and
// every lane computes the full product; stores are done by lane 0, so missing __syncwarp() calls still matter.
#pragma once

#define __host__
#define __device__
#define __global__
#define __shared__ static
#define __launch_bounds__(...)

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "common/types.h"

namespace ldmopt_emu {

constexpr size_t kStackBytes = 256 * 1024;

struct Fiber {
  ucontext_t ctx;
  std::unique_ptr<char[]> stack;
  bool done = false;
  int waiting = -1;  // barrier index, -1 when runnable
  uint64_t gen = 0;
};

struct Barrier {
  int participants = 0;
  int arrived = 0;
  uint64_t generation = 0;
};

struct State {
  ucontext_t main;
  std::vector<Fiber> fibers;
  std::vector<Barrier> barriers;  // [0]: the block, [1 + w]: warp w
  std::vector<uint64_t> exchange;  // 32 slots per warp for shuffles
  std::vector<unsigned char> smem;  // dynamic shared memory, used from a 128-byte aligned offset
  std::function<void()> body;
  std::exception_ptr error;  // thrown inside a fiber, rethrown by the scheduler
  int current = 0;
  bool reverse = false;  // schedule fibers last-to-first: a missing barrier then shows as a wrong result
};

inline State& state() {
  static State s;
  return s;
}

}  // namespace ldmopt_emu

inline dim3 threadIdx, blockIdx, blockDim, gridDim;

namespace ldmopt_emu {

inline int linear_tid() { return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z); }

inline void arrive(int b) {
  State& s = state();
  Barrier& bar = s.barriers[b];
  if (++bar.arrived == bar.participants) {
    bar.arrived = 0;
    ++bar.generation;
    return;
  }
  Fiber& f = s.fibers[s.current];
  f.waiting = b;
  f.gen = bar.generation;
  swapcontext(&f.ctx, &s.main);
}

inline void check_aligned(const void* p, size_t alignment) {
  if (reinterpret_cast<uintptr_t>(p) % alignment != 0) {
    throw std::runtime_error("cuda_emu: packed access at " + std::to_string(reinterpret_cast<uintptr_t>(p)) +
                             " is not aligned to " + std::to_string(alignment) + " bytes");
  }
}

// Bytes around a launch's dynamic shared memory, checked after every block.
constexpr size_t kSmemGuardBytes = 1024;
constexpr unsigned char kSmemGuard = 0xa5;

inline unsigned char* dynamic_smem() {
  const uintptr_t p = reinterpret_cast<uintptr_t>(state().smem.data());
  return reinterpret_cast<unsigned char*>((p + 127) / 128 * 128);
}

inline void trampoline() {
  State& s = state();
  try {
    s.body();
  } catch (...) {
    s.error = std::current_exception();
  }
  s.fibers[s.current].done = true;
}

inline void run_block(int n_threads) {
  State& s = state();
  for (int t = 0; t < n_threads; ++t) {
    Fiber& f = s.fibers[t];
    f.done = false;
    f.waiting = -1;
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack.get();
    f.ctx.uc_stack.ss_size = kStackBytes;
    f.ctx.uc_link = &s.main;
    makecontext(&f.ctx, trampoline, 0);
  }
  for (;;) {
    bool progress = false;
    bool all_done = true;
    for (int u = 0; u < n_threads; ++u) {
      const int t = s.reverse ? n_threads - 1 - u : u;
      Fiber& f = s.fibers[t];
      if (f.done) continue;
      all_done = false;
      if (f.waiting >= 0) {
        if (s.barriers[f.waiting].generation == f.gen) continue;
        f.waiting = -1;
      }
      s.current = t;
      threadIdx = dim3(t % blockDim.x, (t / blockDim.x) % blockDim.y, t / (blockDim.x * blockDim.y));
      swapcontext(&s.main, &f.ctx);
      progress = true;
      if (s.error) {
        std::exception_ptr e = s.error;
        s.error = nullptr;
        std::rethrow_exception(e);
      }
    }
    if (all_done) return;
    if (!progress) {
      std::string msg = "cuda_emu: deadlock in block (" + std::to_string(blockIdx.x) + "," +
                        std::to_string(blockIdx.y) + "," + std::to_string(blockIdx.z) + "): ";
      int done = 0;
      for (int t = 0; t < n_threads; ++t) done += s.fibers[t].done;
      msg += std::to_string(done) + " threads exited while the others wait at a barrier";
      throw std::runtime_error(msg);
    }
  }
}

template <typename... KArgs, typename... Args>
void launch_kernel(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, ldmopt::Stream, Args&&... args) {
  State& s = state();
  const int n_threads = block.x * block.y * block.z;
  if (n_threads % 32 != 0 || n_threads > 1024 || n_threads == 0) {
    throw std::runtime_error("cuda_emu: block of " + std::to_string(n_threads) + " threads (need a multiple of 32)");
  }
  if (smem > 227 * 1024) throw std::runtime_error("cuda_emu: dynamic shared memory over 227 KB");
  if (grid.y > 65535 || grid.z > 65535) throw std::runtime_error("cuda_emu: grid.y/z over 65535");
  // A real launch fails with cudaErrorInvalidConfiguration for these; an empty grid never reaches a kernel.
  if (grid.x > 0x7FFFFFFFu) throw std::runtime_error("cuda_emu: grid.x over 2^31 - 1");
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) throw std::runtime_error("cuda_emu: empty grid");
  while (static_cast<int>(s.fibers.size()) < n_threads) {
    s.fibers.emplace_back();
    s.fibers.back().stack.reset(new char[kStackBytes]);
  }
  const int n_warps = n_threads / 32;
  s.barriers.assign(1 + n_warps, Barrier{});
  s.barriers[0].participants = n_threads;
  for (int w = 0; w < n_warps; ++w) s.barriers[1 + w].participants = 32;
  s.exchange.assign(32 * n_warps, 0);
  // Garbage, like real shared memory, between guard bytes: a block writing outside its smem bytes (a size computed
  // too small) is an error here, as it would be an illegal access or corruption on a GPU.
  s.smem.assign(smem + 128 + kSmemGuardBytes, kSmemGuard);
  const size_t begin = static_cast<size_t>(dynamic_smem() - s.smem.data());
  std::fill(s.smem.begin() + begin, s.smem.begin() + begin + smem, 0xff);
  const auto guard_intact = [&](size_t from, size_t to) {
    return std::all_of(s.smem.begin() + from, s.smem.begin() + to, [](unsigned char b) { return b == kSmemGuard; });
  };
  blockDim = block;
  gridDim = grid;
  std::tuple<KArgs...> converted(static_cast<KArgs>(args)...);
  s.body = [&]() { std::apply(kernel, converted); };
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        blockIdx = dim3(x, y, z);
        run_block(n_threads);
        if (!guard_intact(0, begin) || !guard_intact(begin + smem, s.smem.size())) {
          throw std::runtime_error("cuda_emu: a block wrote outside its " + std::to_string(smem) +
                                   " bytes of dynamic shared memory");
        }
      }
}

template <typename T, typename F>
T shuffle(T v, F source_lane) {
  static_assert(sizeof(T) <= 8, "shuffle of a type over 8 bytes");
  State& s = state();
  const int tid = linear_tid();
  const int warp = tid / 32;
  const int lane = tid % 32;
  std::memcpy(&s.exchange[warp * 32 + lane], &v, sizeof(T));
  arrive(1 + warp);
  T out;
  std::memcpy(&out, &s.exchange[warp * 32 + source_lane(lane)], sizeof(T));
  arrive(1 + warp);
  return out;
}

}  // namespace ldmopt_emu

inline void __syncthreads() { ldmopt_emu::arrive(0); }
inline void __syncwarp(unsigned = 0xffffffffu) { ldmopt_emu::arrive(1 + ldmopt_emu::linear_tid() / 32); }

template <typename T>
T __shfl_xor_sync(unsigned, T v, int lane_mask, int width = 32) {
  return ldmopt_emu::shuffle(v, [=](int lane) { return (lane ^ lane_mask) % width + lane / width * width; });
}

template <typename T>
T __shfl_sync(unsigned, T v, int src, int width = 32) {
  return ldmopt_emu::shuffle(v, [=](int lane) { return lane / width * width + src % width; });
}

template <typename T>
T __ldg(const T* p) {
  return *p;
}

inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float x) { return 1.0f / x; }

// WMMA: every lane holds the whole tile and computes the whole product; the collective *_sync calls are warp
// barriers, and only lane 0 stores.
namespace nvcuda::wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <typename Use, int M, int N, int K, typename T, typename Layout = void>
struct fragment {
  static constexpr int rows = std::is_same_v<Use, matrix_b> ? K : M;
  static constexpr int cols = std::is_same_v<Use, matrix_a> ? K : N;
  float x[rows * cols];
};

inline float emu_to_float(float v) { return v; }
inline float emu_to_float(__half v) { return __half2float(v); }
inline float emu_to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

inline void warp_sync() { __syncwarp(); }

template <typename Use, int M, int N, int K, typename T, typename Layout>
void fill_fragment(fragment<Use, M, N, K, T, Layout>& f, float v) {
  for (float& e : f.x) e = v;
}

template <typename Use, int M, int N, int K, typename T, typename Layout, typename P>
void load_matrix_sync(fragment<Use, M, N, K, T, Layout>& f, const P* p, unsigned ld) {
  static_assert(std::is_same_v<T, P>, "fragment and pointer types differ");
  if (reinterpret_cast<uintptr_t>(p) % 32 != 0) throw std::runtime_error("cuda_emu: wmma load not 256-bit aligned");
  if (ld % (16 / sizeof(P)) != 0) throw std::runtime_error("cuda_emu: wmma load pitch not a multiple of 16 bytes");
  warp_sync();
  using F = fragment<Use, M, N, K, T, Layout>;
  for (int r = 0; r < F::rows; ++r)
    for (int c = 0; c < F::cols; ++c)
      f.x[r * F::cols + c] = emu_to_float(std::is_same_v<Layout, row_major> ? p[r * ld + c] : p[c * ld + r]);
  warp_sync();
}

template <int M, int N, int K, typename TA, typename LA, typename TB, typename LB>
void mma_sync(fragment<accumulator, M, N, K, float>& d, const fragment<matrix_a, M, N, K, TA, LA>& a,
              const fragment<matrix_b, M, N, K, TB, LB>& b, const fragment<accumulator, M, N, K, float>& c) {
  warp_sync();
  float out[M * N];
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) {
      float acc = c.x[m * N + n];
      for (int k = 0; k < K; ++k) acc += a.x[m * K + k] * b.x[k * N + n];
      out[m * N + n] = acc;
    }
  std::memcpy(d.x, out, sizeof(out));
  warp_sync();
}

template <int M, int N, int K>
void store_matrix_sync(float* p, const fragment<accumulator, M, N, K, float>& f, unsigned ld, layout_t layout) {
  if (reinterpret_cast<uintptr_t>(p) % 32 != 0) throw std::runtime_error("cuda_emu: wmma store not 256-bit aligned");
  if (ld % 4 != 0) throw std::runtime_error("cuda_emu: wmma store pitch not a multiple of 16 bytes");
  warp_sync();
  if (ldmopt_emu::linear_tid() % 32 == 0) {
    for (int m = 0; m < M; ++m)
      for (int n = 0; n < N; ++n) p[layout == mem_row_major ? m * ld + n : n * ld + m] = f.x[m * N + n];
  }
  warp_sync();
}

}  // namespace nvcuda::wmma
