// Torch glue of the adaLN modulation kernel: argument checks (shared by the CUDA and Meta implementations), output
// allocation and the launch on the current stream.
#include "adaln_modulate/adaln_modulate.h"

#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cmath>

#include "common/torch_utils.h"

namespace ldmopt::adaln_modulate {
namespace {

constexpr const char* kOp = "ldmopt.adaln_modulate_cuda";

bool present(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

// A stride as the kernel uses it: 0 along a dimension of size 1 (never stepped over; any stride is legal there).
int64_t step(const at::Tensor& t, int dim) { return t.size(dim) > 1 ? t.stride(dim) : 0; }

void check_unit_columns(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.size(1) <= 1 || t.stride(1) == 1, kOp, ": ", name, " must have unit column stride, got strides ",
              t.strides(), " for shape ", t.sizes());
}

// scale, shift, gate: [B, C] with B dividing M, a float dtype of their own, unit column stride, x's device.
void check_per_sample(const at::Tensor& t, const at::Tensor& x, const at::Tensor& scale, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.size(0) > 0 && t.size(1) == x.size(1) && x.size(0) % t.size(0) == 0 &&
                  t.size(0) == scale.size(0),
              kOp, ": ", name, " must have shape [B, C] with B dividing M = ", x.size(0), " (as scale) and C = ",
              x.size(1), ", got ", t.sizes());
  dtype_of(t, kOp, name);
  check_unit_columns(t, name);
  check_same_device(t, x, kOp, name, "x");
}

SampleRows rows_of(const std::optional<at::Tensor>& t) {
  if (!present(t)) return {nullptr, DType::kFloat32, 0};
  const DType dtype = dtype_of(*t, kOp, "scale/shift/gate");
  return {t->data_ptr(), dtype, step(*t, 0) * dtype_bytes(dtype)};
}

}  // namespace

Problem check(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& shift,
              const std::optional<at::Tensor>& residual, const std::optional<at::Tensor>& gate, double eps,
              bool store_sum, bool save) {
  TORCH_CHECK(x.dim() == 2, kOp, ": x must be a 2-D [M, C] tensor of rows, got shape ", x.sizes());
  const DType dtype = dtype_of(x, kOp, "x");
  TORCH_CHECK(x.size(1) > 0, kOp, ": x has no columns (shape ", x.sizes(), "); at least one is needed");
  check_unit_columns(x, "x");
  TORCH_CHECK(scale.dim() == 2 && scale.size(0) > 0, kOp, ": scale must have shape [B, C], got ", scale.sizes());
  check_per_sample(scale, x, scale, "scale");
  check_per_sample(shift, x, scale, "shift");
  if (present(gate)) {
    TORCH_CHECK(present(residual), kOp, ": a gate needs a residual (the gated sum is residual + gate * x)");
    check_per_sample(*gate, x, scale, "gate");
  }
  if (present(residual)) {
    TORCH_CHECK(residual->sizes() == x.sizes(), kOp, ": residual must have x's shape ", x.sizes(), ", got ",
                residual->sizes());
    TORCH_CHECK_TYPE(residual->scalar_type() == x.scalar_type(), kOp, ": residual has dtype ",
                     residual->scalar_type(), " but x has ", x.scalar_type(), "; they must match");
    check_unit_columns(*residual, "residual");
    check_same_device(*residual, x, kOp, "residual", "x");
  }
  TORCH_CHECK(!store_sum || present(residual), kOp, ": store_sum needs a residual (the sum is x + residual)");
  TORCH_CHECK(std::isfinite(eps) && eps >= 0.0, kOp, ": eps must be a finite number >= 0, got ", eps);
  const int64_t m = x.size(0);
  return {m,
          x.size(1),
          std::max<int64_t>(m / scale.size(0), 1),
          step(x, 0),
          present(residual) ? step(*residual, 0) : 0,
          dtype,
          present(residual),
          present(gate),
          store_sum,
          save,
          static_cast<float>(eps)};
}

namespace {

Outputs allocate(const at::Tensor& x, const Problem& p) {
  const auto options = x.options().memory_format(at::MemoryFormat::Contiguous);
  const auto f32 = options.dtype(at::kFloat);
  return {new_output(at::empty({p.M, p.C}, options)),
          p.store_sum ? new_output(at::empty({p.M, p.C}, options)) : at::empty({0}, options),
          p.save ? new_output(at::empty({p.M}, f32)) : at::empty({0}, f32),
          p.save ? new_output(at::empty({p.M}, f32)) : at::empty({0}, f32)};
}

}  // namespace

Outputs forward_meta(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& shift,
                     const std::optional<at::Tensor>& residual, const std::optional<at::Tensor>& gate, double eps,
                     bool store_sum, bool save) {
  return allocate(x, check(x, scale, shift, residual, gate, eps, store_sum, save));
}

Outputs forward_cuda(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& shift,
                     const std::optional<at::Tensor>& residual, const std::optional<at::Tensor>& gate, double eps,
                     bool store_sum, bool save) {
  const Problem p = check(x, scale, shift, residual, gate, eps, store_sum, save);
  check_cuda(x, kOp, "x");
  const c10::cuda::CUDAGuard guard(x.device());
  Outputs out = allocate(x, p);
  auto& [y, s, mean, rstd] = out;
  const Args args{x.data_ptr(),
                  present(residual) ? residual->data_ptr() : nullptr,
                  rows_of(scale),
                  rows_of(shift),
                  rows_of(gate),
                  y.data_ptr(),
                  p.store_sum ? s.data_ptr() : nullptr,
                  p.save ? mean.data_ptr<float>() : nullptr,
                  p.save ? rstd.data_ptr<float>() : nullptr};
  const bool aligned = aligned16(args.x) && aligned16(args.y) && (args.residual == nullptr || aligned16(args.residual)) &&
                       (args.s == nullptr || aligned16(args.s));
  forward(p, make_plan(p, aligned), args, reinterpret_cast<Stream>(c10::cuda::getCurrentCUDAStream().stream()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace ldmopt::adaln_modulate
