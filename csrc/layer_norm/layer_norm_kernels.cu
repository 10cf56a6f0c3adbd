// LayerNorm row kernels, one warp a row: the statistics (mean and rstd of each row of x [M, C], unit column stride, in
// fp32) and the normalisation applied from them. Dtypes fp32/fp16/bf16; fp32 math; offsets in int64.
#include "common/compat.cuh"
#include "layer_norm/launch.h"

namespace ldmopt::layer_norm {
namespace {

template <typename T, int VEC>
__global__ __launch_bounds__(kThreads) void row_stats_kernel(const T* x, float* stats, int64_t M, int64_t C,
                                                             int64_t row_stride, float eps) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t row = int64_t{blockIdx.x} * kRowsPerBlock + threadIdx.x / kWarpSize;
  if (row >= M) return;  // whole warps leave together: the shuffles below see full warps
  const T* base = x + row * row_stride;
  Welford w;
  for (int64_t c = int64_t{lane} * VEC; c < C; c += int64_t{kWarpSize} * VEC) {
    float v[VEC];
    load_float<T, VEC>(base + c, v);
#pragma unroll
    for (int i = 0; i < VEC; ++i) w.add(v[i]);
  }
#pragma unroll
  for (int m = kWarpSize / 2; m > 0; m >>= 1) w.merge(w.shfl_xor(m));
  if (lane == 0) {
    stats[row] = w.mean;
    // A comparison, not fmaxf: a NaN or inf in the row keeps rstd NaN (fmaxf would turn it into 1 / sqrt(eps)).
    const float var = w.m2 / static_cast<float>(C);
    stats[M + row] = rsqrtf((var < 0.0f ? 0.0f : var) + eps);
  }
}

template <typename T, int VEC>
void launch(const Problem& p, const void* x, float* stats, float eps, Stream stream) {
  const dim3 grid(grid_x(ceil_div<int64_t>(p.M, kRowsPerBlock)));
  launch_kernel(row_stats_kernel<T, VEC>, grid, dim3(kThreads), 0, stream, static_cast<const T*>(x), stats, p.M, p.C,
                p.row_stride, eps);
}

template <typename T>
void launch_typed(const Problem& p, const Plan& plan, const void* x, float* stats, float eps, Stream stream) {
  if (plan.vec == 1) {
    launch<T, 1>(p, x, stats, eps, stream);
  } else {
    launch<T, 16 / sizeof(T)>(p, x, stats, eps, stream);
  }
}

template <typename T, int VEC>
__global__ __launch_bounds__(kThreads) void apply_kernel(ApplyProblem p, ApplyArgs a) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t row = int64_t{blockIdx.x} * kRowsPerBlock + threadIdx.x / kWarpSize;
  if (row >= p.M) return;
  const float mean = a.stats[row];
  const float rstd = a.stats[p.M + row];
  const T* x = static_cast<const T*>(a.x) + row * p.row_stride;
  T* h = static_cast<T*>(a.h) + row * p.C;
  const T* pos = a.positions == nullptr
                     ? nullptr
                     : static_cast<const T*>(a.positions) + (row / p.position_rows) % p.P * p.position_stride;
  for (int64_t c = int64_t{lane} * VEC; c < p.C; c += int64_t{kWarpSize} * VEC) {
    float v[VEC];
    load_float<T, VEC>(x + c, v);
    // The order of the Triton kernel and of the reference: normalise, scale, shift, then add the position.
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      v[i] = (v[i] - mean) * rstd * param_at(a.weight, c + i, 1.0f) + param_at(a.bias, c + i, 0.0f);
    }
    if (pos != nullptr) {
      float add[VEC];
      load_float<T, VEC>(pos + c, add);
#pragma unroll
      for (int i = 0; i < VEC; ++i) v[i] += add[i];
    }
    store_float<T, VEC>(h + c, v);
  }
}

template <typename T>
void apply_typed(const ApplyProblem& p, const Plan& plan, const ApplyArgs& args, Stream stream) {
  const dim3 grid(grid_x(ceil_div<int64_t>(p.M, kRowsPerBlock)));
  if (plan.vec == 1) {
    launch_kernel(apply_kernel<T, 1>, grid, dim3(kThreads), 0, stream, p, args);
  } else {
    launch_kernel(apply_kernel<T, 16 / sizeof(T)>, grid, dim3(kThreads), 0, stream, p, args);
  }
}

}  // namespace

void apply(const ApplyProblem& p, const Plan& plan, const ApplyArgs& args, Stream stream) {
  if (p.M == 0) return;
  with_element_type(p.dtype, [&]<typename T>() { apply_typed<T>(p, plan, args, stream); });
}

void row_statistics(const Problem& p, const Plan& plan, const void* x, float* stats, float eps, Stream stream) {
  if (p.M == 0) return;
  with_element_type(p.dtype, [&]<typename T>() { launch_typed<T>(p, plan, x, stats, eps, stream); });
}

}  // namespace ldmopt::layer_norm
