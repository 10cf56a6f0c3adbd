// The linear epilogue op ldmopt::linear_epilogue_cuda: CUDA and Meta implementations that share one set of argument
// checks (so the checks are testable on CPU with meta tensors).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string_view>

#include "linear_epilogue/launch.h"

namespace ldmopt::linear_epilogue {

Problem check(const at::Tensor& z, const at::Tensor& y, const std::optional<at::Tensor>& gate,
              const std::optional<at::Tensor>& residual, const std::optional<at::Tensor>& stats,
              std::string_view activation, bool glu, bool saturate, bool write, double eps);
void run_cuda(const at::Tensor& z, const at::Tensor& y, const std::optional<at::Tensor>& gate,
              const std::optional<at::Tensor>& residual, const std::optional<at::Tensor>& stats,
              std::string_view activation, bool glu, bool saturate, bool write, double eps);
void run_meta(const at::Tensor& z, const at::Tensor& y, const std::optional<at::Tensor>& gate,
              const std::optional<at::Tensor>& residual, const std::optional<at::Tensor>& stats,
              std::string_view activation, bool glu, bool saturate, bool write, double eps);

}  // namespace ldmopt::linear_epilogue
