// LayerNorm row ops ldmopt::layer_norm_stats_cuda and ldmopt::layer_norm_apply_cuda: CUDA and Meta implementations that
// share one set of argument checks each (so the checks are testable on CPU with meta tensors).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

#include "layer_norm/launch.h"

namespace ldmopt::layer_norm {

Problem check_row_statistics(const at::Tensor& x, double eps);
at::Tensor row_statistics_cuda(const at::Tensor& x, double eps);
at::Tensor row_statistics_meta(const at::Tensor& x, double eps);

ApplyProblem check_apply(const at::Tensor& x, const at::Tensor& stats, const std::optional<at::Tensor>& weight,
                         const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& positions,
                         int64_t position_rows);
at::Tensor apply_cuda(const at::Tensor& x, const at::Tensor& stats, const std::optional<at::Tensor>& weight,
                      const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& positions,
                      int64_t position_rows);
at::Tensor apply_meta(const at::Tensor& x, const at::Tensor& stats, const std::optional<at::Tensor>& weight,
                      const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& positions,
                      int64_t position_rows);

}  // namespace ldmopt::layer_norm
