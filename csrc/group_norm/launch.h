// GroupNorm(+SiLU) kernels, host interface: plain pointers and sizes (no torch types), so the torch glue
// (group_norm.cpp) and the CPU emulator tests drive exactly the same launch code.
//
// x is viewed as (N, C, S), S = product of the spatial dims, either channels-first (S contiguous) or channels-last
// (C contiguous). Forward: per-(n, chunk of S, c) Welford partials -> per-(n, group) merge into mean/rstd and the
// per-(n, c) affine coefficients a = w * rstd, b = bias - a * mean -> one elementwise pass y = act(a * x + b).
// Backward mirrors it with partial sums of dz and dz * xhat, dz = act'(a * x + b) * dy.
#pragma once

#include <algorithm>
#include <cstdint>

#include "common/types.h"

namespace ldmopt::group_norm {

// Threads of the partial and elementwise kernels; warps of the channels-first partial kernel.
constexpr int kThreads = 256;
constexpr int kFinalizeThreads = 128;
// Blocks the statistics pass aims for: enough to fill a large GPU several times over.
constexpr int64_t kTargetBlocks = 1024;

struct Problem {
  int64_t N, C, S, G;
  bool channels_last;
  DType dtype;
  bool silu;
};

struct Plan {
  int vec;              // elements per packed access: max_vec(dtype), or 1 when sizes/pointers do not allow it
  int64_t s_per_chunk;  // spatial positions per partial item
  int64_t n_chunks;
  int64_t tc;         // channels-last partial kernel: threads along channel vectors
  int64_t n_cblocks;  // channels-last partial kernel: blocks along channels
};

// The vectorised path needs the contiguous axis (C when channels-last, S otherwise) to be a multiple of the pack
// and every data pointer 16-byte aligned (the caller checks the pointers).
inline Plan make_plan(const Problem& p, bool pointers_aligned) {
  Plan plan{};
  const int64_t inner = p.channels_last ? p.C : p.S;
  const int v = max_vec(p.dtype);
  plan.vec = (pointers_aligned && inner % v == 0) ? v : 1;
  if (p.channels_last) {
    const int64_t n_vec = p.C / plan.vec;
    plan.n_cblocks = ceil_div<int64_t>(n_vec, kThreads);
    plan.tc = ceil_div<int64_t>(n_vec, plan.n_cblocks);
    const int64_t rows = kThreads / plan.tc;
    const int64_t want = std::max<int64_t>(1, ceil_div<int64_t>(kTargetBlocks, p.N * plan.n_cblocks));
    // At least 4 rows per thread, so a block does real work before its shared-memory merge.
    plan.s_per_chunk = std::min(p.S, std::max(ceil_div<int64_t>(p.S, want), 4 * rows));
  } else {
    const int64_t warps = kThreads / 32;
    const int64_t want = std::max<int64_t>(1, ceil_div<int64_t>(kTargetBlocks * warps, p.N * p.C));
    // At least 4 packs per lane; chunk boundaries stay multiples of the pack.
    int64_t per = std::max(ceil_div<int64_t>(p.S, want), int64_t{4} * 32 * plan.vec);
    per = ceil_div<int64_t>(per, plan.vec) * plan.vec;
    plan.s_per_chunk = std::min(p.S, per);
    plan.tc = 0;
    plan.n_cblocks = 0;
  }
  plan.n_chunks = ceil_div<int64_t>(p.S, plan.s_per_chunk);
  return plan;
}

// fp32 scratch the launches need, in floats.
inline int64_t partial_floats(const Problem& p, const Plan& plan) { return p.N * plan.n_chunks * p.C; }

struct ForwardArgs {
  const void* x;
  void* y;
  AnyVector weight;     // [C] or null (ones)
  AnyVector bias;       // [C] or null (zeros)
  float* mean;          // [N, G]
  float* rstd;          // [N, G]
  float* part_a;        // [N, n_chunks, C] scratch
  float* part_b;        // [N, n_chunks, C] scratch
  float* coef;          // [N, C, 2] scratch
  float eps;
};

struct BackwardArgs {
  const void* dy;
  const void* x;
  void* dx;
  AnyVector weight;
  AnyVector bias;
  const float* mean;
  const float* rstd;
  float* part_a;    // [N, n_chunks, C] scratch
  float* part_b;    // [N, n_chunks, C] scratch
  float* coef;      // [N, C, 4] scratch
  float* sum_dz;    // [N, C]: per-(n, c) sum of dz (dbias = sum over n)
  float* sum_dzx;   // [N, C]: per-(n, c) sum of dz * xhat (dweight = sum over n)
};

// Enqueue the kernels on stream; launch errors are left for the caller to check.
void forward(const Problem& p, const Plan& plan, const ForwardArgs& args, Stream stream);
// The forward's two statistics passes alone (partial, finalize): writes args.mean/rstd; y, weight and bias unused,
// coef is scratch.
void statistics(const Problem& p, const Plan& plan, const ForwardArgs& args, Stream stream);
// The forward's elementwise pass from statistics already known (args.mean/rstd are read): the per-(n, c)
// coefficients into coef, then y = act(a x + b); part_a/part_b unused.
void apply(const Problem& p, const Plan& plan, const ForwardArgs& args, Stream stream);
// apply over the channel concatenation cat([x, x_tail], 1) of two channels-last parts (an up block's hidden state and
// skip), never written: p.C = c_head + the tail's channels; args.x is the head [N, S, c_head], x_tail [N, S, C -
// c_head], y [N, S, C]. The plan must come from make_parts_plan (no pack straddles the parts).
void apply_parts(const Problem& p, const Plan& plan, const ForwardArgs& args, const void* x_tail, int64_t c_head,
                 Stream stream);
// statistics over the channel concatenation cat([x, x_tail], 1) of two channels-last parts, never written (the
// statistics of an up block's (hidden, skip) pair): p.C = both parts' channels, args.x the head [N, S, c_head], x_tail
// [N, S, C - c_head]. The plan must come from make_parts_plan.
void statistics_parts(const Problem& p, const Plan& plan, const ForwardArgs& args, const void* x_tail,
                      int64_t c_head, Stream stream);
// Whether a packed access can serve two parts of c_head and c_total - c_head channels (the pack divides both).
inline bool parts_packable(DType dtype, int64_t c_head, int64_t c_total) {
  const int v = max_vec(dtype);
  return c_head % v == 0 && (c_total - c_head) % v == 0;
}
// The plan of the two-part passes (statistics_parts, apply_parts): packed accesses only where the pack divides both
// parts' channel counts, so that none straddles them; pointers_aligned covers every pointer the pass reads or writes.
inline Plan make_parts_plan(const Problem& p, bool pointers_aligned, int64_t c_head) {
  return make_plan(p, pointers_aligned && parts_packable(p.dtype, c_head, p.C));
}
void backward(const Problem& p, const Plan& plan, const BackwardArgs& args, Stream stream);

}  // namespace ldmopt::group_norm
