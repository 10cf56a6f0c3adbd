// Torch glue of the LayerNorm row kernels: argument checks (shared by the CUDA and Meta implementations), output
// allocation, and the launch on the current stream.
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
constexpr const char* kApply = "ldmopt.layer_norm_apply_cuda";

bool present(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

// A per-channel weight or bias: [C] contiguous in fp32/fp16/bf16 (read in its own dtype), on x's device.
AnyVector check_vector(const std::optional<at::Tensor>& t, const at::Tensor& x, const char* name) {
  if (!present(t)) return {nullptr, DType::kFloat32};
  TORCH_CHECK(t->dim() == 1 && t->size(0) == x.size(1), kApply, ": ", name, " must have shape [C] = [", x.size(1),
              "], got ", t->sizes());
  TORCH_CHECK(t->is_contiguous(), kApply, ": ", name, " must be contiguous, got strides ", t->strides());
  check_same_device(*t, x, kApply, name, "x");
  return {t->data_ptr(), dtype_of(*t, kApply, name)};
}

Stream current_stream() { return reinterpret_cast<Stream>(c10::cuda::getCurrentCUDAStream().stream()); }

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
                 current_stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return stats;
}


ApplyProblem check_apply(const at::Tensor& x, const at::Tensor& stats, const std::optional<at::Tensor>& weight,
                         const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& positions,
                         int64_t position_rows) {
  TORCH_CHECK(x.dim() == 2, kApply, ": x must be a 2-D [rows, C] tensor, got shape ", x.sizes());
  const DType dtype = dtype_of(x, kApply, "x");
  const int64_t m = x.size(0);
  const int64_t c = x.size(1);
  TORCH_CHECK(c > 0, kApply, ": x has no columns (shape ", x.sizes(), "); at least one is needed");
  TORCH_CHECK(c == 1 || x.stride(1) == 1, kApply, ": x must have unit column stride, got strides ", x.strides(),
              " for shape ", x.sizes());
  TORCH_CHECK(stats.dim() == 2 && stats.size(0) == 2 && stats.size(1) == m, kApply,
              ": stats must have shape [2, M] = [2, ", m, "], got ", stats.sizes());
  TORCH_CHECK_TYPE(stats.scalar_type() == at::kFloat, kApply, ": stats has dtype ", stats.scalar_type(),
                   "; supported: Float (the row statistics)");
  TORCH_CHECK(stats.is_contiguous(), kApply, ": stats must be contiguous, got strides ", stats.strides());
  check_same_device(stats, x, kApply, "stats", "x");
  check_vector(weight, x, "weight");
  check_vector(bias, x, "bias");
  int64_t p = 0;
  int64_t position_stride = 0;
  if (present(positions)) {
    TORCH_CHECK(positions->dim() == 2 && positions->size(0) > 0 && positions->size(1) == c, kApply,
                ": positions must have shape [P, C] with P >= 1 and C = ", c, ", got ", positions->sizes());
    TORCH_CHECK_TYPE(positions->scalar_type() == x.scalar_type(), kApply, ": positions has dtype ",
                     positions->scalar_type(), "; supported: x's dtype ", x.scalar_type());
    TORCH_CHECK(c == 1 || positions->stride(1) == 1, kApply, ": positions must have unit column stride, got strides ",
                positions->strides());
    check_same_device(*positions, x, kApply, "positions", "x");
    p = positions->size(0);
    position_stride = p > 1 ? positions->stride(0) : c;
  }
  TORCH_CHECK(position_rows >= 1, kApply, ": position_rows must be >= 1, got ", position_rows);
  return {m, c, m > 1 ? x.stride(0) : c, p, position_stride, position_rows, dtype};
}

at::Tensor apply_meta(const at::Tensor& x, const at::Tensor& stats, const std::optional<at::Tensor>& weight,
                      const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& positions,
                      int64_t position_rows) {
  check_apply(x, stats, weight, bias, positions, position_rows);
  return at::empty(x.sizes(), x.options());
}

at::Tensor apply_cuda(const at::Tensor& x, const at::Tensor& stats, const std::optional<at::Tensor>& weight,
                      const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& positions,
                      int64_t position_rows) {
  const ApplyProblem p = check_apply(x, stats, weight, bias, positions, position_rows);
  check_cuda(x, kApply, "x");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor h = new_output(at::empty(x.sizes(), x.options()));  // contiguous
  const void* pos = present(positions) ? positions->data_ptr() : nullptr;
  const ApplyArgs args{x.data_ptr(), stats.data_ptr<float>(), check_vector(weight, x, "weight"),
                       check_vector(bias, x, "bias"), pos, h.data_ptr()};
  const bool aligned = aligned16(x.data_ptr()) && aligned16(h.data_ptr()) && (pos == nullptr || aligned16(pos));
  apply(p, make_apply_plan(p, aligned), args, current_stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return h;
}

}  // namespace ldmopt::layer_norm
