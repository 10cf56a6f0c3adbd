// The conv epilogue op ldmopt::conv_epilogue_cuda: CUDA and Meta implementations that share one set of argument
// checks (so the checks are testable on CPU with meta tensors).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

#include "conv_epilogue/launch.h"

namespace ldmopt::conv_epilogue {

// The widest output the finalize kernel's shared memory takes (two floats per channel).
constexpr int64_t kMaxChannels = 8192;

using Outputs = std::tuple<at::Tensor, at::Tensor, at::Tensor>;  // mean [N, G], rstd [N, G], sums [N, C or 0, 2]

Outputs run_cuda(const at::Tensor& z, const std::optional<at::Tensor>& shortcut,
                 const std::optional<at::Tensor>& residual, const std::optional<at::Tensor>& temb,
                 const std::optional<at::Tensor>& gate, double inv_scale, bool write, int64_t groups,
                 bool channel_sums, double eps);
Outputs run_meta(const at::Tensor& z, const std::optional<at::Tensor>& shortcut,
                 const std::optional<at::Tensor>& residual, const std::optional<at::Tensor>& temb,
                 const std::optional<at::Tensor>& gate, double inv_scale, bool write, int64_t groups,
                 bool channel_sums, double eps);

}  // namespace ldmopt::conv_epilogue
