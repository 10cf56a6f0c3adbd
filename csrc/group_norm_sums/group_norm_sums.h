// The op ldmopt::group_norm_stats_from_sums_cuda: CUDA and Meta implementations that share one set of argument checks
// (so the checks are testable on CPU with meta tensors).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

#include "group_norm_sums/launch.h"

namespace ldmopt::group_norm_sums {

std::tuple<at::Tensor, at::Tensor> from_sums_cuda(const at::Tensor& sums, const std::optional<at::Tensor>& sums_tail,
                                                  int64_t num_groups, double eps, int64_t count, int64_t frames);
std::tuple<at::Tensor, at::Tensor> from_sums_meta(const at::Tensor& sums, const std::optional<at::Tensor>& sums_tail,
                                                  int64_t num_groups, double eps, int64_t count, int64_t frames);

}  // namespace ldmopt::group_norm_sums
