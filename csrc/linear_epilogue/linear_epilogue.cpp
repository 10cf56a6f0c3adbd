// Torch glue of the linear epilogue kernel: argument checks (shared by the CUDA and Meta implementations) and the
// launch on the current stream. The caller allocates y (or passes z to write in place) and the statistics.
#include "linear_epilogue/linear_epilogue.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "common/torch_utils.h"

namespace ldmopt::linear_epilogue {
namespace {

constexpr const char* kOp = "ldmopt.linear_epilogue_cuda";

bool present(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

// A stride as the kernel uses it: 0 along a dimension of size 1 (never stepped over; any stride is legal there).
int64_t step(const at::Tensor& t, int dim) { return t.size(dim) > 1 ? t.stride(dim) : 0; }

// z's dtype and device, unit column stride, the given shape.
void check_operand(const at::Tensor& t, const at::Tensor& z, const char* name) {
  TORCH_CHECK_TYPE(t.scalar_type() == z.scalar_type(), kOp, ": ", name, " has dtype ", t.scalar_type(),
                   "; supported: z's dtype ", z.scalar_type());
  TORCH_CHECK(t.size(-1) <= 1 || t.stride(-1) == 1, kOp, ": ", name, " must have unit column stride, got strides ",
              t.strides(), " for shape ", t.sizes());
  check_same_device(t, z, kOp, name, "z");
}

Activation activation_of(std::string_view name) {
  if (name.empty()) return Activation::kNone;
  if (name == "silu") return Activation::kSilu;
  if (name == "gelu") return Activation::kGelu;
  if (name == "gelu_tanh") return Activation::kGeluTanh;
  TORCH_CHECK(false, kOp, ": activation='", name, "' is not supported; supported: '' (none), 'silu', 'gelu', ",
              "'gelu_tanh'");
  return Activation::kNone;
}

float largest_finite(DType d) {
  switch (d) {
    case DType::kFloat16:
      return 65504.0f;
    case DType::kBFloat16:
      return 3.3895313892515355e38f;
    default:
      return std::numeric_limits<float>::max();
  }
}

}  // namespace

Problem check(const at::Tensor& z, const at::Tensor& y, const std::optional<at::Tensor>& gate,
              const std::optional<at::Tensor>& residual, const std::optional<at::Tensor>& stats,
              std::string_view activation, bool glu, bool saturate, bool write, double eps) {
  TORCH_CHECK(z.dim() == 2, kOp, ": z must be a 2-D [M, N] GEMM output, got shape ", z.sizes());
  const DType dtype = dtype_of(z, kOp, "z");
  TORCH_CHECK(z.size(1) > 0, kOp, ": z has no columns (shape ", z.sizes(), "); at least one is needed");
  TORCH_CHECK(z.size(1) == 1 || z.stride(1) == 1, kOp, ": z must have unit column stride, got strides ",
              z.strides(), " for shape ", z.sizes());
  const Activation act = activation_of(activation);
  TORCH_CHECK(!glu || (act == Activation::kGelu && z.size(1) % 2 == 0), kOp, ": glu=True takes activation 'gelu' ",
              "and z of an even width [M, 2N], got activation='", activation, "' and shape ", z.sizes());
  const int64_t m = z.size(0);
  const int64_t n = glu ? z.size(1) / 2 : z.size(1);
  TORCH_CHECK(write || (!glu && !saturate && act == Activation::kNone && !present(gate) && !present(residual) &&
                        present(stats)),
              kOp, ": write=False only takes z's row statistics (stats given; no activation, glu, saturate, gate or ",
              "residual)");
  if (write) {
    TORCH_CHECK(y.dim() == 2 && y.size(0) == m && y.size(1) == n, kOp, ": y must have shape [M, N] = [", m, ", ", n,
                "], got ", y.sizes());
    check_operand(y, z, "y");
    if (y.is_alias_of(z)) {  // in place: the very same elements, read before written by the same lane
      TORCH_CHECK(!glu && y.data_ptr() == z.data_ptr() && step(y, 0) == step(z, 0), kOp,
                  ": y shares z's memory but is not z itself (in place needs the same view and no glu)");
    }
  }
  int64_t tokens_per_gate = 1;
  if (present(gate)) {
    TORCH_CHECK(gate->dim() == 2 && gate->size(0) > 0 && m % gate->size(0) == 0 && gate->size(1) == n, kOp,
                ": gate must have shape [B, N] with B dividing M = ", m, " and N = ", n, ", got ", gate->sizes());
    check_operand(*gate, z, "gate");
    tokens_per_gate = std::max<int64_t>(m / gate->size(0), 1);
  }
  int64_t residual_rows = std::max<int64_t>(m, 1);
  int64_t residual_sample_stride = 0;
  int64_t residual_row_stride = 0;
  if (present(residual)) {
    const at::Tensor& r = *residual;
    const bool two_d = r.dim() == 2 && r.size(0) == m && r.size(1) == n;
    const bool three_d = r.dim() == 3 && r.size(0) * r.size(1) == m && r.size(2) == n && r.size(1) > 0;
    TORCH_CHECK(two_d || three_d, kOp, ": residual must have shape [M, N] = [", m, ", ", n,
                "] or [B, T, N] with B * T = M, got ", r.sizes());
    check_operand(r, z, "residual");
    if (three_d) {
      residual_rows = r.size(1);
      residual_sample_stride = step(r, 0);
      residual_row_stride = step(r, 1);
    } else {
      residual_row_stride = step(r, 0);
    }
  }
  if (present(stats)) {
    TORCH_CHECK(stats->dim() == 2 && stats->size(0) == 2 && stats->size(1) == m, kOp,
                ": stats must have shape [2, M] = [2, ", m, "], got ", stats->sizes());
    TORCH_CHECK_TYPE(stats->scalar_type() == at::kFloat, kOp, ": stats has dtype ", stats->scalar_type(),
                     "; supported: Float");
    TORCH_CHECK(stats->is_contiguous(), kOp, ": stats must be contiguous, got strides ", stats->strides());
    check_same_device(*stats, z, kOp, "stats", "z");
  }
  TORCH_CHECK(std::isfinite(eps) && eps >= 0.0, kOp, ": eps must be a finite number >= 0, got ", eps);
  return {m,
          n,
          step(z, 0),
          write ? step(y, 0) : 0,
          present(gate) ? step(*gate, 0) : 0,
          tokens_per_gate,
          residual_sample_stride,
          residual_row_stride,
          residual_rows,
          dtype,
          act,
          glu,
          saturate,
          write,
          largest_finite(dtype),
          static_cast<float>(eps)};
}

void run_meta(const at::Tensor& z, const at::Tensor& y, const std::optional<at::Tensor>& gate,
              const std::optional<at::Tensor>& residual, const std::optional<at::Tensor>& stats,
              std::string_view activation, bool glu, bool saturate, bool write, double eps) {
  check(z, y, gate, residual, stats, activation, glu, saturate, write, eps);
}

void run_cuda(const at::Tensor& z, const at::Tensor& y, const std::optional<at::Tensor>& gate,
              const std::optional<at::Tensor>& residual, const std::optional<at::Tensor>& stats,
              std::string_view activation, bool glu, bool saturate, bool write, double eps) {
  const Problem p = check(z, y, gate, residual, stats, activation, glu, saturate, write, eps);
  check_cuda(z, kOp, "z");
  const c10::cuda::CUDAGuard guard(z.device());
  const Args args{z.data_ptr(), write ? y.data_ptr() : nullptr, present(gate) ? gate->data_ptr() : nullptr,
                  present(residual) ? residual->data_ptr() : nullptr,
                  present(stats) ? stats->data_ptr<float>() : nullptr};
  const bool aligned = aligned16(args.z) && (args.y == nullptr || aligned16(args.y)) &&
                       (args.gate == nullptr || aligned16(args.gate)) &&
                       (args.residual == nullptr || aligned16(args.residual));
  run(p, make_plan(p, aligned), args, reinterpret_cast<Stream>(c10::cuda::getCurrentCUDAStream().stream()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace ldmopt::linear_epilogue
