// Torch glue of the LayerNorm row statistics kernel: argument checks (shared by the CUDA and Meta implementations),
// output allocation, and the launch on the current stream.
#include "layer_norm/layer_norm.h"

#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <limits>

#include "common/torch_utils.h"

namespace ldmopt::layer_norm {
namespace {

constexpr const char* kStats = "ldmopt.layer_norm_stats_cuda";

}  // namespace

Problem check_row_statistics(const at::Tensor& x, double eps) {
  TORCH_CHECK(x.dim() == 2, kStats, ": x must be a 2-D [rows, C] tensor, got shape ", x.sizes());
  const DType dtype = dtype_of(x, kStats, "x");
  TORCH_CHECK(x.size(1) > 0, kStats, ": x has no columns (shape ", x.sizes(), "); at least one is needed");
  TORCH_CHECK(x.size(1) == 1 || x.stride(1) == 1, kStats, ": x must have unit column stride, got strides ",
              x.strides(), " for shape ", x.sizes());
  TORCH_CHECK(eps >= 0.0 && eps < std::numeric_limits<float>::infinity(), kStats,
              ": eps must be a finite number >= 0, got ", eps);
  return {x.size(0), x.size(1), x.size(0) > 1 ? x.stride(0) : x.size(1), dtype};
}

at::Tensor row_statistics_meta(const at::Tensor& x, double eps) {
  const Problem p = check_row_statistics(x, eps);
  return at::empty({2, p.M}, x.options().dtype(at::kFloat));
}

at::Tensor row_statistics_cuda(const at::Tensor& x, double eps) {
  const Problem p = check_row_statistics(x, eps);
  check_cuda(x, kStats, "x");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor stats = new_output(at::empty({2, p.M}, x.options().dtype(at::kFloat)));
  const Plan plan = make_plan(p, aligned16(x.data_ptr()));
  row_statistics(p, plan, x.data_ptr(), stats.data_ptr<float>(), static_cast<float>(eps),
                 reinterpret_cast<Stream>(c10::cuda::getCurrentCUDAStream().stream()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return stats;
}

}  // namespace ldmopt::layer_norm
