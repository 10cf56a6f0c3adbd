// GroupNorm statistics from per-channel fp64 sums, one warp per (video, group); fp64 sums, fp32 results.
#include "common/compat.cuh"
#include "group_norm_sums/launch.h"

namespace ldmopt::group_norm_sums {
namespace {

__global__ __launch_bounds__(kThreads) void from_sums_kernel(Problem p, const double* sums, const double* tail,
                                                             float* mean, float* rstd) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t item = int64_t{blockIdx.x} * kWarps + threadIdx.x / kWarpSize;  // video * G + group
  const int64_t videos = p.N / p.frames;
  if (item >= videos * p.G) return;  // whole warps leave together: the shuffles below see full warps
  const int64_t video = item / p.G;
  const int64_t cpg = p.C / p.G;
  const int64_t first = item % p.G * cpg;
  double s = 0.0;
  double s2 = 0.0;
  for (int64_t i = lane; i < p.frames * cpg; i += kWarpSize) {  // (frame, channel of the group) pairs
    const int64_t image = video * p.frames + i / cpg;
    const int64_t c = first + i % cpg;
    const double* at = c < p.C_head ? sums + (image * p.C_head + c) * 2
                                    : tail + (image * (p.C - p.C_head) + c - p.C_head) * 2;
    s += at[0];
    s2 += at[1];
  }
#pragma unroll
  for (int m = kWarpSize / 2; m > 0; m >>= 1) {
    s += __shfl_xor_sync(kFullMask, s, m);
    s2 += __shfl_xor_sync(kFullMask, s2, m);
  }
  if (lane == 0) {
    const double elements = static_cast<double>(p.count) * static_cast<double>(p.frames * cpg);
    const double m = s / elements;
    const double var = s2 / elements - m * m;
    mean[item] = static_cast<float>(m);
    rstd[item] = rsqrtf(static_cast<float>(var < 0.0 ? 0.0 : var) + p.eps);  // NaN stays NaN
  }
}

}  // namespace

void statistics(const Problem& p, const double* sums, const double* tail, float* mean, float* rstd, Stream stream) {
  const int64_t items = p.N / p.frames * p.G;
  if (items == 0) return;
  launch_kernel(from_sums_kernel, dim3(grid_x(ceil_div<int64_t>(items, kWarps))), dim3(kThreads), 0, stream, p,
                sums, tail, mean, rstd);
}

}  // namespace ldmopt::group_norm_sums
