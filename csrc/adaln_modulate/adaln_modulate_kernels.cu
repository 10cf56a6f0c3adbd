// adaLN modulation forward: the (gated) residual sum, LayerNorm without affine and the per-sample modulation in one
// pass, one warp a row. Dtypes fp32/fp16/bf16 (scale, shift and gate in their own); fp32 math; offsets in int64.
#include "adaln_modulate/launch.h"
#include "common/compat.cuh"

namespace ldmopt::adaln_modulate {
namespace {

// Sample b's row of a [B, C] parameter, as an AnyVector param_at reads element by element.
__device__ __forceinline__ AnyVector sample_row(const SampleRows& r, int64_t b) {
  if (r.ptr == nullptr) return {nullptr, r.dtype};
  return {static_cast<const char*>(r.ptr) + b * r.row_bytes, r.dtype};
}

// s at columns [c, c + VEC) of one row: x, x + residual, or residual + gate * x, rounded to T as the unfused add
// stores it (the statistics and the output both read these values).
template <typename T, int VEC>
__device__ __forceinline__ void load_sum(const Problem& p, const T* x, const T* residual, const AnyVector& gate,
                                         int64_t c, float (&s)[VEC]) {
  load_float<T, VEC>(x + c, s);
  if (!p.has_residual) return;
  float r[VEC];
  load_float<T, VEC>(residual + c, r);
#pragma unroll
  for (int i = 0; i < VEC; ++i) {
    const float sum = p.has_gate ? r[i] + param_at(gate, c + i, 0.0f) * s[i] : s[i] + r[i];
    s[i] = to_float(from_float<T>(sum));
  }
}

template <typename T, int VEC>
__global__ __launch_bounds__(kThreads) void forward_kernel(Problem p, Args a) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t row = int64_t{blockIdx.x} * kRowsPerBlock + threadIdx.x / kWarpSize;
  if (row >= p.M) return;  // whole warps leave together: the shuffles below see full warps
  const int64_t b = row / p.tokens;
  const T* x = static_cast<const T*>(a.x) + row * p.x_row_stride;
  const T* residual = p.has_residual ? static_cast<const T*>(a.residual) + row * p.residual_row_stride : nullptr;
  const AnyVector gate = sample_row(a.gate, b);
  T* s_out = p.store_sum ? static_cast<T*>(a.s) + row * p.C : nullptr;
  Welford w;
  for (int64_t c = int64_t{lane} * VEC; c < p.C; c += int64_t{kWarpSize} * VEC) {
    float s[VEC];
    load_sum<T, VEC>(p, x, residual, gate, c, s);
    if (s_out != nullptr) store_float<T, VEC>(s_out + c, s);
#pragma unroll
    for (int i = 0; i < VEC; ++i) w.add(s[i]);
  }
#pragma unroll
  for (int m = kWarpSize / 2; m > 0; m >>= 1) w.merge(w.shfl_xor(m));
  // Lane 0's statistics for every lane: the butterfly leaves each lane its own rounding of them, and the output must
  // be normalised by the one pair that is saved (the backward's) and that the other backends compute per row.
  const float mean = __shfl_sync(kFullMask, w.mean, 0);
  const float var = __shfl_sync(kFullMask, w.m2, 0) / static_cast<float>(p.C);
  const float rstd = rsqrtf((var < 0.0f ? 0.0f : var) + p.eps);  // a comparison: NaN stays NaN
  const AnyVector scale = sample_row(a.scale, b);
  const AnyVector shift = sample_row(a.shift, b);
  T* y = static_cast<T*>(a.y) + row * p.C;
  for (int64_t c = int64_t{lane} * VEC; c < p.C; c += int64_t{kWarpSize} * VEC) {
    float v[VEC];
    load_sum<T, VEC>(p, x, residual, gate, c, v);  // the same values as the first pass: same loads, same rounding
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      v[i] = (v[i] - mean) * rstd * (1.0f + param_at(scale, c + i, 0.0f)) + param_at(shift, c + i, 0.0f);
    }
    store_float<T, VEC>(y + c, v);
  }
  if (p.save && lane == 0) {
    a.mean[row] = mean;
    a.rstd[row] = rstd;
  }
}

template <typename T>
void launch_typed(const Problem& p, const Plan& plan, const Args& args, Stream stream) {
  const dim3 grid(grid_x(ceil_div<int64_t>(p.M, kRowsPerBlock)));
  if (plan.vec == 1) {
    launch_kernel(forward_kernel<T, 1>, grid, dim3(kThreads), 0, stream, p, args);
  } else {
    launch_kernel(forward_kernel<T, 16 / sizeof(T)>, grid, dim3(kThreads), 0, stream, p, args);
  }
}

}  // namespace

void forward(const Problem& p, const Plan& plan, const Args& args, Stream stream) {
  if (p.M == 0) return;
  with_element_type(p.dtype, [&]<typename T>() { launch_typed<T>(p, plan, args, stream); });
}

}  // namespace ldmopt::adaln_modulate
