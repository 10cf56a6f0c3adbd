// The adaLN modulation op ldmopt::adaln_modulate_cuda: CUDA and Meta implementations that share one set of argument
// checks (so the checks are testable on CPU with meta tensors).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

#include "adaln_modulate/launch.h"

namespace ldmopt::adaln_modulate {

using Outputs = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

Problem check(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& shift,
              const std::optional<at::Tensor>& residual, const std::optional<at::Tensor>& gate, double eps,
              bool store_sum, bool save);
Outputs forward_cuda(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& shift,
                     const std::optional<at::Tensor>& residual, const std::optional<at::Tensor>& gate, double eps,
                     bool store_sum, bool save);
Outputs forward_meta(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& shift,
                     const std::optional<at::Tensor>& residual, const std::optional<at::Tensor>& gate, double eps,
                     bool store_sum, bool save);

}  // namespace ldmopt::adaln_modulate
