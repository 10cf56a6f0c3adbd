// GroupNorm(+SiLU) ops ldmopt::group_norm_fwd_cuda / group_norm_bwd_cuda / group_norm_stats_cuda /
// group_norm_apply_cuda: CUDA and Meta implementations that share
// one set of argument checks (so the checks are testable on CPU with meta tensors).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string_view>
#include <tuple>

#include "group_norm/launch.h"

namespace ldmopt::group_norm {

using Tensors2 = std::tuple<at::Tensor, at::Tensor>;
using Tensors3 = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

Problem check_forward(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                      const std::optional<at::Tensor>& bias, int64_t num_groups, double eps,
                      std::string_view activation);
Problem check_backward(const at::Tensor& dy, const at::Tensor& x, const std::optional<at::Tensor>& weight,
                       const std::optional<at::Tensor>& bias, const at::Tensor& mean, const at::Tensor& rstd,
                       int64_t num_groups, std::string_view activation);

Tensors3 forward_cuda(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                      const std::optional<at::Tensor>& bias, int64_t num_groups, double eps,
                      std::string_view activation);
Tensors3 forward_meta(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                      const std::optional<at::Tensor>& bias, int64_t num_groups, double eps,
                      std::string_view activation);
// Statistics alone (mean, rstd [N, G] fp32), and the elementwise pass from given statistics (y in x's layout); with
// x_tail, both over cat([x, x_tail], 1) of two 4-D channels-last parts, never written (y channels-last).
Problem check_statistics(const at::Tensor& x, int64_t num_groups, double eps,
                         const std::optional<at::Tensor>& x_tail = std::nullopt);
Problem check_apply(const at::Tensor& x, const at::Tensor& mean, const at::Tensor& rstd,
                    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                    int64_t num_groups, std::string_view activation,
                    const std::optional<at::Tensor>& x_tail = std::nullopt);
Tensors2 statistics_cuda(const at::Tensor& x, int64_t num_groups, double eps,
                         const std::optional<at::Tensor>& x_tail = std::nullopt);
Tensors2 statistics_meta(const at::Tensor& x, int64_t num_groups, double eps,
                         const std::optional<at::Tensor>& x_tail = std::nullopt);
at::Tensor apply_cuda(const at::Tensor& x, const at::Tensor& mean, const at::Tensor& rstd,
                      const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                      int64_t num_groups, std::string_view activation,
                      const std::optional<at::Tensor>& x_tail = std::nullopt);
at::Tensor apply_meta(const at::Tensor& x, const at::Tensor& mean, const at::Tensor& rstd,
                      const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                      int64_t num_groups, std::string_view activation,
                      const std::optional<at::Tensor>& x_tail = std::nullopt);

Tensors3 backward_cuda(const at::Tensor& dy, const at::Tensor& x, const std::optional<at::Tensor>& weight,
                       const std::optional<at::Tensor>& bias, const at::Tensor& mean, const at::Tensor& rstd,
                       int64_t num_groups, std::string_view activation);
Tensors3 backward_meta(const at::Tensor& dy, const at::Tensor& x, const std::optional<at::Tensor>& weight,
                       const std::optional<at::Tensor>& bias, const at::Tensor& mean, const at::Tensor& rstd,
                       int64_t num_groups, std::string_view activation);

}  // namespace ldmopt::group_norm
