// Torch glue of the statistics-from-sums kernel: argument checks (shared by the CUDA and Meta implementations), the
// outputs, and the launch on the current stream.
#include "group_norm_sums/group_norm_sums.h"

#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cmath>

#include "common/torch_utils.h"

namespace ldmopt::group_norm_sums {
namespace {

constexpr const char* kOp = "ldmopt.group_norm_stats_from_sums_cuda";

void check_sums(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 3 && t.size(2) == 2, kOp, ": ", name, " must be [N, C, 2] (per channel: the sum and the ",
              "sum of squares), got shape ", t.sizes());
  TORCH_CHECK_TYPE(t.scalar_type() == at::kDouble, kOp, ": ", name, " has dtype ", t.scalar_type(),
                   "; supported: Double");
  TORCH_CHECK(t.is_contiguous(), kOp, ": ", name, " must be contiguous, got strides ", t.strides());
}

Problem check(const at::Tensor& sums, const std::optional<at::Tensor>& sums_tail, int64_t num_groups, double eps,
              int64_t count, int64_t frames) {
  check_sums(sums, "sums");
  int64_t c = sums.size(1);
  if (sums_tail.has_value() && sums_tail->defined()) {
    check_sums(*sums_tail, "sums_tail");
    TORCH_CHECK(sums_tail->size(0) == sums.size(0), kOp, ": sums_tail has ", sums_tail->size(0), " images, sums ",
                sums.size(0));
    check_same_device(*sums_tail, sums, kOp, "sums_tail", "sums");
    c += sums_tail->size(1);
  }
  TORCH_CHECK(num_groups > 0 && c % num_groups == 0, kOp, ": num_groups=", num_groups,
              " must be a positive divisor of the ", c, " channels");
  TORCH_CHECK(count > 0, kOp, ": count=", count, ": each channel's sums must be over at least one value");
  TORCH_CHECK(frames > 0 && sums.size(0) % frames == 0, kOp, ": frames=", frames,
              " must be a positive divisor of the ", sums.size(0), " images of sums");
  TORCH_CHECK(std::isfinite(eps) && eps >= 0.0, kOp, ": eps must be a finite number >= 0, got ", eps);
  return {sums.size(0), sums.size(1), c, num_groups, frames, count, static_cast<float>(eps)};
}

std::tuple<at::Tensor, at::Tensor> outputs(const at::Tensor& sums, const Problem& p) {
  const auto options = sums.options().dtype(at::kFloat);
  return {new_output(at::empty({p.N / p.frames, p.G}, options)), new_output(at::empty({p.N / p.frames, p.G}, options))};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> from_sums_meta(const at::Tensor& sums, const std::optional<at::Tensor>& sums_tail,
                                                  int64_t num_groups, double eps, int64_t count, int64_t frames) {
  return outputs(sums, check(sums, sums_tail, num_groups, eps, count, frames));
}

std::tuple<at::Tensor, at::Tensor> from_sums_cuda(const at::Tensor& sums, const std::optional<at::Tensor>& sums_tail,
                                                  int64_t num_groups, double eps, int64_t count, int64_t frames) {
  const Problem p = check(sums, sums_tail, num_groups, eps, count, frames);
  check_cuda(sums, kOp, "sums");
  const c10::cuda::CUDAGuard guard(sums.device());
  auto [mean, rstd] = outputs(sums, p);
  const bool two_part = sums_tail.has_value() && sums_tail->defined();
  const double* tail = two_part ? sums_tail->data_ptr<double>() : sums.data_ptr<double>();
  statistics(p, sums.data_ptr<double>(), tail, mean.data_ptr<float>(), rstd.data_ptr<float>(),
             reinterpret_cast<Stream>(c10::cuda::getCurrentCUDAStream().stream()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {mean, rstd};
}

}  // namespace ldmopt::group_norm_sums
