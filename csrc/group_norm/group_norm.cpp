// Torch glue of the GroupNorm kernels: argument checks (shared by the CUDA and Meta implementations), output and
// scratch allocation, and the launch on the current stream.
#include "group_norm/group_norm.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "common/torch_utils.h"

namespace ldmopt::group_norm {
namespace {

constexpr const char* kFwd = "ldmopt.group_norm_fwd_cuda";
constexpr const char* kBwd = "ldmopt.group_norm_bwd_cuda";
constexpr const char* kStats = "ldmopt.group_norm_stats_cuda";
constexpr const char* kApply = "ldmopt.group_norm_apply_cuda";

// True for channels-last (C contiguous), false for contiguous; anything else is refused.
bool channels_last_layout(const at::Tensor& x, const char* op, const char* name) {
  if (x.is_contiguous()) return false;
  if (x.dim() == 4 && x.is_contiguous(at::MemoryFormat::ChannelsLast)) return true;
  if (x.dim() == 5 && x.is_contiguous(at::MemoryFormat::ChannelsLast3d)) return true;
  if (x.dim() == 3 && x.transpose(1, 2).is_contiguous()) return true;
  TORCH_CHECK(false, op, ": ", name, " must be contiguous or channels-last, got shape ", x.sizes(), " with strides ",
              x.strides());
  return false;
}

void check_affine(const std::optional<at::Tensor>& t, const at::Tensor& x, const char* op, const char* name,
                  int64_t channels) {
  if (!t.has_value() || !t->defined()) return;
  TORCH_CHECK(t->dim() == 1 && t->size(0) == channels, op, ": ", name, " must have shape [C] = [", channels,
              "], got ", t->sizes());
  TORCH_CHECK_TYPE(t->is_floating_point(), op, ": ", name, " has dtype ", t->scalar_type(),
                   "; supported: floating point");
  check_same_device(*t, x, op, name, "x");
}

Problem check_common(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                     const std::optional<at::Tensor>& bias, int64_t num_groups, std::string_view activation,
                     const char* op) {
  TORCH_CHECK(x.dim() >= 3 && x.dim() <= 5, op, ": x must have 3 to 5 dims (N, C, *spatial), got shape ",
              x.sizes());
  const DType dtype = dtype_of(x, op, "x");
  TORCH_CHECK(x.numel() > 0, op, ": x is empty (shape ", x.sizes(), "); at least one element is needed");
  TORCH_CHECK(num_groups > 0, op, ": num_groups must be positive, got ", num_groups);
  TORCH_CHECK(x.size(1) % num_groups == 0, op, ": num_groups=", num_groups, " does not divide C=", x.size(1),
              " (x shape ", x.sizes(), ")");
  TORCH_CHECK(activation.empty() || activation == "silu", op, ": activation='", activation,
              "' is not supported; supported: '' (none) or 'silu'");
  check_affine(weight, x, op, "weight", x.size(1));
  check_affine(bias, x, op, "bias", x.size(1));
  const bool cl = channels_last_layout(x, op, "x");
  return {x.size(0), x.size(1), x.numel() / (x.size(0) * x.size(1)), num_groups, cl, dtype, activation == "silu"};
}

void check_stats(const at::Tensor& t, const Problem& p, const at::Tensor& x, const char* op, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.size(0) == p.N && t.size(1) == p.G, op, ": ", name, " must have shape [N, G] = [",
              p.N, ", ", p.G, "], got ", t.sizes());
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, op, ": ", name, " has dtype ", t.scalar_type(),
                   "; supported: Float (the forward's statistics)");
  check_same_device(t, x, op, name, "x");
}

// weight/bias as the kernels read them: fp32/fp16/bf16 in place (contiguous), anything else cast to fp32.
at::Tensor param_tensor(const std::optional<at::Tensor>& t) {
  if (!t.has_value() || !t->defined()) return {};
  const auto st = t->scalar_type();
  const bool native = st == at::kFloat || st == at::kHalf || st == at::kBFloat16;
  return native ? t->contiguous() : t->to(at::kFloat).contiguous();
}

AnyVector param_view(const at::Tensor& t) {
  if (!t.defined()) return {nullptr, DType::kFloat32};
  return {t.data_ptr(), dtype_of(t, "ldmopt.group_norm", "weight/bias")};
}

Stream current_stream() { return reinterpret_cast<Stream>(c10::cuda::getCurrentCUDAStream().stream()); }

void check_eps(double eps, const char* op) {
  TORCH_CHECK(eps >= 0.0 && eps < std::numeric_limits<float>::infinity(), op,
              ": eps must be a finite number >= 0, got ", eps);
}

// The statistics' scratch (partials and the per-(n, c) coefficients) in one fp32 buffer.
struct Scratch {
  at::Tensor buffer;
  float* part_a;
  float* part_b;
  float* coef;
};

Scratch forward_scratch(const Problem& p, const Plan& plan, const at::Tensor& x, bool partials) {
  const int64_t n_part = partials ? partial_floats(p, plan) : 0;
  Scratch s{at::empty({2 * n_part + p.N * p.C * 2}, x.options().dtype(at::kFloat)), nullptr, nullptr, nullptr};
  float* base = s.buffer.data_ptr<float>();
  s.part_a = base;
  s.part_b = base + n_part;
  s.coef = base + 2 * n_part;
  return s;
}

}  // namespace

Problem check_forward(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                      const std::optional<at::Tensor>& bias, int64_t num_groups, double eps,
                      std::string_view activation) {
  const Problem p = check_common(x, weight, bias, num_groups, activation, kFwd);
  check_eps(eps, kFwd);
  return p;
}

namespace {

// A 4-D tensor whose channel vectors are dense in memory, pixel after pixel: what the two-part pass reads and writes.
bool dense_channels_last(const at::Tensor& t) {
  return t.dim() == 4 && t.is_contiguous(at::MemoryFormat::ChannelsLast);
}

// The two-part problem over cat([x, x_tail], 1): C = both parts' channels, channels-last.
Problem check_parts(const at::Tensor& x, const at::Tensor& tail, const std::optional<at::Tensor>& weight,
                    const std::optional<at::Tensor>& bias, int64_t num_groups, std::string_view activation,
                    const char* op) {
  TORCH_CHECK(x.dim() == 4 && tail.dim() == 4, op, ": with x_tail, x and x_tail must be 4-D (N, C, H, W), got ",
              x.sizes(), " and ", tail.sizes());
  const DType dtype = dtype_of(x, op, "x");
  TORCH_CHECK_TYPE(tail.scalar_type() == x.scalar_type(), op, ": x_tail has dtype ", tail.scalar_type(),
                   " but x has ", x.scalar_type(), "; they must match");
  check_same_device(tail, x, op, "x_tail", "x");
  TORCH_CHECK(tail.size(0) == x.size(0) && tail.size(2) == x.size(2) && tail.size(3) == x.size(3), op,
              ": x_tail ", tail.sizes(), " must match x ", x.sizes(), " in batch and spatial size");
  TORCH_CHECK(dense_channels_last(x) && dense_channels_last(tail), op,
              ": with x_tail, x and x_tail must be channels-last, got strides ", x.strides(), " and ",
              tail.strides());
  TORCH_CHECK(x.numel() > 0 && tail.numel() > 0, op, ": x ", x.sizes(), " or x_tail ", tail.sizes(),
              " is empty; at least one element each is needed");
  const int64_t channels = x.size(1) + tail.size(1);
  TORCH_CHECK(num_groups > 0, op, ": num_groups must be positive, got ", num_groups);
  TORCH_CHECK(channels % num_groups == 0, op, ": num_groups=", num_groups, " does not divide C=", channels,
              " (x ", x.sizes(), " and x_tail ", tail.sizes(), ")");
  TORCH_CHECK(activation.empty() || activation == "silu", op, ": activation='", activation,
              "' is not supported; supported: '' (none) or 'silu'");
  check_affine(weight, x, op, "weight", channels);
  check_affine(bias, x, op, "bias", channels);
  return {x.size(0), channels, x.size(2) * x.size(3), num_groups, true, dtype, activation == "silu"};
}

}  // namespace

Problem check_statistics(const at::Tensor& x, int64_t num_groups, double eps, const std::optional<at::Tensor>& x_tail) {
  const bool parts = x_tail.has_value() && x_tail->defined();
  const Problem p = parts ? check_parts(x, *x_tail, std::nullopt, std::nullopt, num_groups, "", kStats)
                          : check_common(x, std::nullopt, std::nullopt, num_groups, "", kStats);
  check_eps(eps, kStats);
  return p;
}

Problem check_apply(const at::Tensor& x, const at::Tensor& mean, const at::Tensor& rstd,
                    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                    int64_t num_groups, std::string_view activation, const std::optional<at::Tensor>& x_tail) {
  const bool parts = x_tail.has_value() && x_tail->defined();
  const Problem p = parts ? check_parts(x, *x_tail, weight, bias, num_groups, activation, kApply)
                          : check_common(x, weight, bias, num_groups, activation, kApply);
  check_stats(mean, p, x, kApply, "mean");
  check_stats(rstd, p, x, kApply, "rstd");
  return p;
}

Problem check_backward(const at::Tensor& dy, const at::Tensor& x, const std::optional<at::Tensor>& weight,
                       const std::optional<at::Tensor>& bias, const at::Tensor& mean, const at::Tensor& rstd,
                       int64_t num_groups, std::string_view activation) {
  const Problem p = check_common(x, weight, bias, num_groups, activation, kBwd);
  TORCH_CHECK(dy.sizes() == x.sizes(), kBwd, ": dy must have x's shape ", x.sizes(), ", got ", dy.sizes());
  TORCH_CHECK_TYPE(dy.scalar_type() == x.scalar_type(), kBwd, ": dy has dtype ", dy.scalar_type(),
                   " but x has ", x.scalar_type(), "; they must match");
  check_same_device(dy, x, kBwd, "dy", "x");
  check_stats(mean, p, x, kBwd, "mean");
  check_stats(rstd, p, x, kBwd, "rstd");
  return p;
}

Tensors3 forward_meta(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                      const std::optional<at::Tensor>& bias, int64_t num_groups, double eps,
                      std::string_view activation) {
  const Problem p = check_forward(x, weight, bias, num_groups, eps, activation);
  at::Tensor mean = at::empty({p.N, p.G}, x.options().dtype(at::kFloat));
  return {at::empty_like(x), mean, at::empty_like(mean)};
}

Tensors2 statistics_meta(const at::Tensor& x, int64_t num_groups, double eps,
                         const std::optional<at::Tensor>& x_tail) {
  const Problem p = check_statistics(x, num_groups, eps, x_tail);
  at::Tensor mean = at::empty({p.N, p.G}, x.options().dtype(at::kFloat));
  return {mean, at::empty_like(mean)};
}

at::Tensor apply_meta(const at::Tensor& x, const at::Tensor& mean, const at::Tensor& rstd,
                      const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                      int64_t num_groups, std::string_view activation, const std::optional<at::Tensor>& x_tail) {
  const Problem p = check_apply(x, mean, rstd, weight, bias, num_groups, activation, x_tail);
  if (x_tail.has_value() && x_tail->defined()) {
    return at::empty({p.N, p.C, x.size(2), x.size(3)}, x.options().memory_format(at::MemoryFormat::ChannelsLast));
  }
  return at::empty_like(x);
}

Tensors3 backward_meta(const at::Tensor& dy, const at::Tensor& x, const std::optional<at::Tensor>& weight,
                       const std::optional<at::Tensor>& bias, const at::Tensor& mean, const at::Tensor& rstd,
                       int64_t num_groups, std::string_view activation) {
  const Problem p = check_backward(dy, x, weight, bias, mean, rstd, num_groups, activation);
  at::Tensor dweight = at::empty({p.C}, x.options().dtype(at::kFloat));
  return {at::empty_like(x), dweight, at::empty_like(dweight)};
}

Tensors3 forward_cuda(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                      const std::optional<at::Tensor>& bias, int64_t num_groups, double eps,
                      std::string_view activation) {
  const Problem p = check_forward(x, weight, bias, num_groups, eps, activation);
  check_cuda(x, kFwd, "x");
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor w = param_tensor(weight);
  const at::Tensor b = param_tensor(bias);
  at::Tensor y = new_output(at::empty_like(x));
  at::Tensor mean = new_output(at::empty({p.N, p.G}, x.options().dtype(at::kFloat)));
  at::Tensor rstd = new_output(at::empty({p.N, p.G}, x.options().dtype(at::kFloat)));
  const Plan plan = make_plan(p, aligned16(x.data_ptr()) && aligned16(y.data_ptr()));
  const auto f32 = x.options().dtype(at::kFloat);
  at::Tensor part = at::empty({2, partial_floats(p, plan)}, f32);
  at::Tensor coef = at::empty({p.N, p.C, 2}, f32);
  const ForwardArgs args{x.data_ptr(),
                         y.data_ptr(),
                         param_view(w),
                         param_view(b),
                         mean.data_ptr<float>(),
                         rstd.data_ptr<float>(),
                         part[0].data_ptr<float>(),
                         part[1].data_ptr<float>(),
                         coef.data_ptr<float>(),
                         static_cast<float>(eps)};
  forward(p, plan, args, current_stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {y, mean, rstd};
}

Tensors2 statistics_cuda(const at::Tensor& x, int64_t num_groups, double eps,
                         const std::optional<at::Tensor>& x_tail) {
  const Problem p = check_statistics(x, num_groups, eps, x_tail);
  check_cuda(x, kStats, "x");
  const bool parts = x_tail.has_value() && x_tail->defined();
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor mean = new_output(at::empty({p.N, p.G}, x.options().dtype(at::kFloat)));
  at::Tensor rstd = new_output(at::empty({p.N, p.G}, x.options().dtype(at::kFloat)));
  const Plan plan = parts ? make_parts_plan(p, aligned16(x.data_ptr()) && aligned16(x_tail->data_ptr()), x.size(1))
                          : make_plan(p, aligned16(x.data_ptr()));
  const Scratch scratch = forward_scratch(p, plan, x, true);
  const ForwardArgs args{x.data_ptr(),
                         nullptr,
                         {nullptr, DType::kFloat32},
                         {nullptr, DType::kFloat32},
                         mean.data_ptr<float>(),
                         rstd.data_ptr<float>(),
                         scratch.part_a,
                         scratch.part_b,
                         scratch.coef,
                         static_cast<float>(eps)};
  if (parts) {
    statistics_parts(p, plan, args, x_tail->data_ptr(), x.size(1), current_stream());
  } else {
    statistics(p, plan, args, current_stream());
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {mean, rstd};
}

at::Tensor apply_cuda(const at::Tensor& x, const at::Tensor& mean_in, const at::Tensor& rstd_in,
                      const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                      int64_t num_groups, std::string_view activation, const std::optional<at::Tensor>& x_tail) {
  const Problem p = check_apply(x, mean_in, rstd_in, weight, bias, num_groups, activation, x_tail);
  check_cuda(x, kApply, "x");
  const bool parts = x_tail.has_value() && x_tail->defined();
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor mean = mean_in.contiguous();
  const at::Tensor rstd = rstd_in.contiguous();
  const at::Tensor w = param_tensor(weight);
  const at::Tensor b = param_tensor(bias);
  // Canonical strides for a channels-last x (its own may differ on size-1 dims): the layout the op's fake promises;
  // both are addressed linearly in the same order.
  const bool cl4 = x.dim() == 4 && p.channels_last;
  const auto cl_options = x.options().memory_format(at::MemoryFormat::ChannelsLast);
  at::Tensor y = new_output(parts ? at::empty({p.N, p.C, x.size(2), x.size(3)}, cl_options)
                            : cl4 ? at::empty(x.sizes(), cl_options)
                                  : at::empty_like(x));
  const bool aligned = aligned16(x.data_ptr()) && aligned16(y.data_ptr()) &&
                       (!parts || aligned16(x_tail->data_ptr()));
  const Plan plan = parts ? make_parts_plan(p, aligned, x.size(1)) : make_plan(p, aligned);
  const Scratch scratch = forward_scratch(p, plan, x, false);
  // The kernels read the statistics through the forward's (writable) pointers; apply only reads them.
  const ForwardArgs args{x.data_ptr(),
                         y.data_ptr(),
                         param_view(w),
                         param_view(b),
                         const_cast<float*>(mean.data_ptr<float>()),
                         const_cast<float*>(rstd.data_ptr<float>()),
                         nullptr,
                         nullptr,
                         scratch.coef,
                         0.0f};
  if (parts) {
    apply_parts(p, plan, args, x_tail->data_ptr(), x.size(1), current_stream());
  } else {
    apply(p, plan, args, current_stream());
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

Tensors3 backward_cuda(const at::Tensor& dy_in, const at::Tensor& x, const std::optional<at::Tensor>& weight,
                       const std::optional<at::Tensor>& bias, const at::Tensor& mean_in, const at::Tensor& rstd_in,
                       int64_t num_groups, std::string_view activation) {
  const Problem p = check_backward(dy_in, x, weight, bias, mean_in, rstd_in, num_groups, activation);
  check_cuda(x, kBwd, "x");
  const c10::cuda::CUDAGuard guard(x.device());
  // The kernels address dy with x's layout.
  const at::Tensor dy = dy_in.strides() == x.strides() ? dy_in : at::empty_like(x).copy_(dy_in);
  const at::Tensor mean = mean_in.contiguous();
  const at::Tensor rstd = rstd_in.contiguous();
  const at::Tensor w = param_tensor(weight);
  const at::Tensor b = param_tensor(bias);
  at::Tensor dx = new_output(at::empty_like(x));
  const Plan plan = make_plan(p, aligned16(x.data_ptr()) && aligned16(dy.data_ptr()) && aligned16(dx.data_ptr()));
  const auto f32 = x.options().dtype(at::kFloat);
  at::Tensor part = at::empty({2, partial_floats(p, plan)}, f32);
  at::Tensor coef = at::empty({p.N, p.C, 4}, f32);
  at::Tensor sums = at::empty({2, p.N, p.C}, f32);
  const BackwardArgs args{dy.data_ptr(),
                          x.data_ptr(),
                          dx.data_ptr(),
                          param_view(w),
                          param_view(b),
                          mean.data_ptr<float>(),
                          rstd.data_ptr<float>(),
                          part[0].data_ptr<float>(),
                          part[1].data_ptr<float>(),
                          coef.data_ptr<float>(),
                          sums[0].data_ptr<float>(),
                          sums[1].data_ptr<float>()};
  backward(p, plan, args, current_stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // dweight = sum over n of sum(dz * xhat), dbias = sum over n of sum(dz).
  return {dx, sums[1].sum(0), sums[0].sum(0)};
}

}  // namespace ldmopt::group_norm
