// Temporal attention forward, host interface: plain pointers and strides (no torch types), shared by the torch glue
// (temporal_attention.cpp) and the CPU emulator tests.
//
// q, k, v, out are (B, F, N, H, D) views with arbitrary strides; attention runs over F (frames) independently for
// each of the B*N*H sequences, flattened with h fastest onto grid axis x (no 65,535 limit). A block stages
// `per_block` sequences in shared memory (F and D padded to multiples of 16 there only), computes S = Q K^T with
// tensor-core WMMA tiles (fp16/bf16) or fp32 FMA tiles (fp32), an exact fp32 softmax, then O = P V.
#pragma once

#include <algorithm>
#include <cstdint>

#include "common/types.h"

namespace ldmopt::temporal_attention {

constexpr int64_t kMaxFrames = 64;
constexpr int64_t kMaxHeadDim = 256;
constexpr int kThreads = 128;
constexpr int kMaxPerBlock = 16;
// Shared memory a block aims for: four blocks (16 warps) fit on an H100/H200 SM without an opt-in.
constexpr int64_t kSmemBudget = 48 * 1024;
// The kernel's static shared memory (each staged sequence's q, k, v, out offsets): counts against the per-block limit
// with the dynamic part.
constexpr int64_t kStaticSmemBytes = 4 * kMaxPerBlock * sizeof(int64_t);

template <typename Ptr>
struct ViewT {
  Ptr ptr;
  int64_t stride[5];  // elements, (B, F, N, H, D)
};
using View = ViewT<const void*>;
using OutView = ViewT<void*>;

struct Problem {
  int64_t B, F, N, H, D;
  DType dtype;
  float scale;
};

struct Plan {
  int f_pad, d_pad;          // multiples of 16
  int ld_qkv, ld_s, ld_p, ld_o;  // shared-memory row pitches in elements
  int per_block;             // sequences per block
  int64_t smem_bytes;        // dynamic shared memory per block
  int64_t blocks;
};

inline int64_t round_up(int64_t x, int64_t m) { return ceil_div(x, m) * m; }

inline Plan make_plan(const Problem& p) {
  Plan plan{};
  const int elem = dtype_bytes(p.dtype);
  const int pad16 = 16 / elem;  // keeps every row 16-byte aligned (and WMMA pitches legal)
  plan.f_pad = static_cast<int>(round_up(p.F, 16));
  plan.d_pad = static_cast<int>(round_up(p.D, 16));
  plan.ld_qkv = plan.d_pad + pad16;
  plan.ld_s = plan.f_pad + 4;
  // fp32 computes P in place of S; 16-bit types keep a separate P in the input dtype for the tensor cores.
  plan.ld_p = elem == 4 ? plan.ld_s : plan.f_pad + pad16;
  plan.ld_o = plan.d_pad + 4;
  const int64_t per_seq = int64_t{3} * plan.f_pad * plan.ld_qkv * elem + int64_t{plan.f_pad} * plan.ld_s * 4 +
                          (elem == 4 ? 0 : int64_t{plan.f_pad} * plan.ld_p * elem);
  const int64_t n_seq = p.B * p.N * p.H;
  plan.per_block = static_cast<int>(std::clamp<int64_t>(kSmemBudget / per_seq, 1, kMaxPerBlock));
  plan.per_block = static_cast<int>(std::min<int64_t>(plan.per_block, std::max<int64_t>(n_seq, 1)));
  plan.smem_bytes = per_seq * plan.per_block;
  plan.blocks = ceil_div<int64_t>(n_seq, plan.per_block);
  return plan;
}

// A view can use 16-byte packed accesses: unit stride along D, every other stride and the base pointer aligned.
template <typename Ptr>
inline bool packable(const ViewT<Ptr>& v, const Problem& p) {
  const int vec = max_vec(p.dtype);
  if (v.stride[4] != 1 || p.D % vec != 0) return false;
  if (reinterpret_cast<uintptr_t>(v.ptr) % 16 != 0) return false;
  for (int i = 0; i < 4; ++i) {
    if (v.stride[i] % vec != 0) return false;
  }
  return true;
}

// out = softmax(q k^T * scale) v over F; enqueued on stream, launch errors left for the caller to check.
void forward(const Problem& p, const Plan& plan, const View& q, const View& k, const View& v, const OutView& out,
             Stream stream);

}  // namespace ldmopt::temporal_attention
