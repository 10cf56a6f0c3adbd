// Temporal attention op ldmopt::temporal_attention_fwd_cuda: CUDA and Meta implementations sharing one set of
// argument checks (so they are testable on CPU with meta tensors).
#pragma once

#include <ATen/core/Tensor.h>

#include "temporal_attention/launch.h"

namespace ldmopt::temporal_attention {

Problem check_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale);

at::Tensor forward_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale);
at::Tensor forward_meta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale);

}  // namespace ldmopt::temporal_attention
