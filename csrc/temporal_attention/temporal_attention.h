// Temporal attention ops ldmopt::temporal_attention_fwd_cuda and temporal_attention_fwd_out_cuda: CUDA and Meta
// implementations sharing one set of argument checks (so they are testable on CPU with meta tensors).
#pragma once

#include <ATen/core/Tensor.h>

#include "temporal_attention/launch.h"

namespace ldmopt::temporal_attention {

// `op` names the op in error messages.
Problem check_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, const char* op);

at::Tensor forward_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale);
at::Tensor forward_meta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale);
// Writes into `out` (q's shape and dtype, any strides).
void forward_out_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                      const at::Tensor& out);
void forward_out_meta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                      const at::Tensor& out);

}  // namespace ldmopt::temporal_attention
