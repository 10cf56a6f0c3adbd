// The linear epilogue after a cuBLAS GEMM: activation (or GEGLU's product), gate, residual, clamp, rounding and the
// next LayerNorm's row statistics in one pass, one warp a row. Dtypes fp32/fp16/bf16; fp32 math; offsets in int64.
#include <stdexcept>

#include "common/compat.cuh"
#include "linear_epilogue/launch.h"

namespace ldmopt::linear_epilogue {
namespace {

template <typename T, int VEC>
__device__ __forceinline__ void add_loaded(const T* ptr, float (&v)[VEC]) {
  float r[VEC];
  load_float<T, VEC>(ptr, r);
#pragma unroll
  for (int i = 0; i < VEC; ++i) v[i] += r[i];
}

template <typename T, int VEC, class Act, bool GLU>
__global__ __launch_bounds__(kThreads) void epilogue_kernel(Problem p, Args a) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t row = int64_t{blockIdx.x} * kRowsPerBlock + threadIdx.x / kWarpSize;
  if (row >= p.M) return;  // whole warps leave together: the shuffles below see full warps
  const T* z = static_cast<const T*>(a.z) + row * p.z_row_stride;
  T* y = p.write ? static_cast<T*>(a.y) + row * p.y_row_stride : nullptr;
  const T* gate = a.gate == nullptr ? nullptr
                                    : static_cast<const T*>(a.gate) + row / p.tokens_per_gate * p.gate_row_stride;
  const T* residual = a.residual == nullptr ? nullptr
                                            : static_cast<const T*>(a.residual) +
                                                  row / p.residual_rows * p.residual_sample_stride +
                                                  row % p.residual_rows * p.residual_row_stride;
  Welford w;
  for (int64_t c = int64_t{lane} * VEC; c < p.N; c += int64_t{kWarpSize} * VEC) {
    float v[VEC];
    load_float<T, VEC>(z + c, v);
    if (p.write) {
      if constexpr (GLU) {  // the value half times the activated gate half, as diffusers' GEGLU
        float g[VEC];
        load_float<T, VEC>(z + p.N + c, g);
#pragma unroll
        for (int i = 0; i < VEC; ++i) v[i] *= Act::fwd(g[i]);
      } else {
#pragma unroll
        for (int i = 0; i < VEC; ++i) v[i] = Act::fwd(v[i]);
      }
      if (gate != nullptr) {
        float g[VEC];
        load_float<T, VEC>(gate + c, g);
#pragma unroll
        for (int i = 0; i < VEC; ++i) v[i] *= g[i];
      }
      if (residual != nullptr) add_loaded<T, VEC>(residual + c, v);
      if (p.saturate) {
#pragma unroll
        for (int i = 0; i < VEC; ++i) {  // a comparison keeps NaN (fminf / fmaxf would drop it)
          v[i] = v[i] != v[i] ? v[i] : fminf(fmaxf(v[i], -p.sat_max), p.sat_max);
        }
      }
      store_float<T, VEC>(y + c, v);
      if (a.stats != nullptr) {
#pragma unroll
        for (int i = 0; i < VEC; ++i) v[i] = to_float(from_float<T>(v[i]));  // the values as stored
      }
    }
    if (a.stats != nullptr) {
#pragma unroll
      for (int i = 0; i < VEC; ++i) w.add(v[i]);
    }
  }
  if (a.stats == nullptr) return;  // uniform across the launch
#pragma unroll
  for (int m = kWarpSize / 2; m > 0; m >>= 1) w.merge(w.shfl_xor(m));
  if (lane == 0) {
    a.stats[row] = w.mean;
    const float var = w.m2 / static_cast<float>(p.N);
    a.stats[p.M + row] = rsqrtf((var < 0.0f ? 0.0f : var) + p.eps);  // NaN stays NaN
  }
}

template <typename T, int VEC, class Act, bool GLU>
void launch(const Problem& p, const Args& args, Stream stream) {
  const dim3 grid(grid_x(ceil_div<int64_t>(p.M, kRowsPerBlock)));
  launch_kernel(epilogue_kernel<T, VEC, Act, GLU>, grid, dim3(kThreads), 0, stream, p, args);
}

template <typename T, int VEC>
void launch_activation(const Problem& p, const Args& args, Stream stream) {
  if (p.glu) {
    if (p.activation != Activation::kGelu) throw std::invalid_argument("linear_epilogue: a GLU takes GELU (erf)");
    return launch<T, VEC, GeluErf, true>(p, args, stream);
  }
  switch (p.activation) {
    case Activation::kNone:
      return launch<T, VEC, Identity, false>(p, args, stream);
    case Activation::kSilu:
      return launch<T, VEC, Silu, false>(p, args, stream);
    case Activation::kGelu:
      return launch<T, VEC, GeluErf, false>(p, args, stream);
    case Activation::kGeluTanh:
      return launch<T, VEC, GeluTanh, false>(p, args, stream);
  }
}

template <typename T>
void launch_typed(const Problem& p, const Plan& plan, const Args& args, Stream stream) {
  if (plan.vec == 1) {
    launch_activation<T, 1>(p, args, stream);
  } else {
    launch_activation<T, 16 / sizeof(T)>(p, args, stream);
  }
}

}  // namespace

void run(const Problem& p, const Plan& plan, const Args& args, Stream stream) {
  if (p.M == 0) return;
  with_element_type(p.dtype, [&]<typename T>() { launch_typed<T>(p, plan, args, stream); });
}

}  // namespace ldmopt::linear_epilogue
