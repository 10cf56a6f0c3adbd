// GroupNorm statistics from per-channel sums (what the fused convs' epilogues hand a UNet up block's two-part
// GroupNorm), host interface: plain pointers and sizes, shared by the torch glue and the CPU emulator tests.
// sums [N, C_head, 2] and tail [N, C - C_head, 2] fp64 contiguous (per channel: sum, sum of squares over `count`
// values); the groups of cat([head, tail], 1), each spanning `frames` consecutive images: mean, rstd [N / frames, G]
// fp32, rstd = 1 / sqrt(var + eps) with the biased variance computed in fp64. One warp per (video, group).
#pragma once

#include <cstdint>

#include "common/types.h"

namespace ldmopt::group_norm_sums {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

struct Problem {
  int64_t N, C_head, C, G, frames, count;  // N images of sums, C channels in all
  float eps;
};

// Enqueue the kernel on stream; launch errors are left for the caller to check.
void statistics(const Problem& p, const double* sums, const double* tail, float* mean, float* rstd, Stream stream);

}  // namespace ldmopt::group_norm_sums
