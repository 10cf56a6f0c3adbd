// LayerNorm row statistics op ldmopt::layer_norm_stats_cuda: CUDA and Meta implementations that share one set of
// argument checks (so the checks are testable on CPU with meta tensors).
#pragma once

#include <ATen/core/Tensor.h>

#include "layer_norm/launch.h"

namespace ldmopt::layer_norm {

Problem check_row_statistics(const at::Tensor& x, double eps);
at::Tensor row_statistics_cuda(const at::Tensor& x, double eps);
at::Tensor row_statistics_meta(const at::Tensor& x, double eps);

}  // namespace ldmopt::layer_norm
