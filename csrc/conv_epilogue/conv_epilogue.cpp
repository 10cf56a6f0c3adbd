// Torch glue of the conv epilogue kernels: argument checks (shared by the CUDA and Meta implementations), the
// outputs and the workspace, and the launches on the current stream.
#include "conv_epilogue/conv_epilogue.h"

#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cmath>

#include "common/torch_utils.h"

namespace ldmopt::conv_epilogue {
namespace {

constexpr const char* kOp = "ldmopt.conv_epilogue_cuda";

bool present(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

// (image stride, pixel stride) of an [N, C, OH, OW] tensor whose pixels are rows of unit-stride channels, pixel
// p = oh * OW + ow at p * pixel_stride (channels-last with its pixels at one stride: what cuDNN writes); refused
// otherwise.
std::pair<int64_t, int64_t> pixel_rows(const at::Tensor& t, const char* name) {
  const int64_t c = t.size(1), oh = t.size(2), ow = t.size(3);
  TORCH_CHECK(c == 1 || t.stride(1) == 1, kOp, ": ", name, " must be channels-last (unit channel stride), got ",
              "strides ", t.strides(), " for shape ", t.sizes());
  int64_t pixel = ow > 1 ? t.stride(3) : (oh > 1 ? t.stride(2) : c);
  TORCH_CHECK(oh == 1 || ow == 1 || t.stride(2) == ow * t.stride(3), kOp, ": ", name, " must have its pixels at ",
              "one stride (stride over H = W x stride over W), got strides ", t.strides(), " for shape ", t.sizes());
  return {t.size(0) > 1 ? t.stride(0) : 0, pixel};
}

void check_like_z(const at::Tensor& t, const at::Tensor& z, const char* name) {
  TORCH_CHECK(t.sizes() == z.sizes(), kOp, ": ", name, " must have z's shape ", z.sizes(), ", got ", t.sizes());
  TORCH_CHECK_TYPE(t.scalar_type() == z.scalar_type(), kOp, ": ", name, " has dtype ", t.scalar_type(),
                   "; supported: z's dtype ", z.scalar_type());
  check_same_device(t, z, kOp, name, "z");
}

struct Checked {
  Problem problem;
  Args args;
};

Checked check(const at::Tensor& z, const std::optional<at::Tensor>& shortcut,
              const std::optional<at::Tensor>& residual, const std::optional<at::Tensor>& temb,
              const std::optional<at::Tensor>& gate, double inv_scale, bool write, int64_t groups, bool channel_sums,
              double eps) {
  TORCH_CHECK(z.dim() == 4, kOp, ": z must be a 4-D [N, C, OH, OW] conv output, got shape ", z.sizes());
  const DType dtype = dtype_of(z, kOp, "z");
  const int64_t n = z.size(0), c = z.size(1), s = z.size(2) * z.size(3);
  TORCH_CHECK(c > 0, kOp, ": z has no channels (shape ", z.sizes(), ")");
  const auto [z_image, z_pixel] = pixel_rows(z, "z");
  const int64_t oh = z.size(2);
  Args args{z.data_ptr(), z_image, z_pixel, {nullptr, 0, 0}, {nullptr, 0, 0}, nullptr, 0, 0, nullptr, 0, 0,
            nullptr, nullptr, nullptr, nullptr};
  if (present(shortcut)) {
    check_like_z(*shortcut, z, "shortcut");
    const auto [image, pixel] = pixel_rows(*shortcut, "shortcut");
    args.shortcut = {shortcut->data_ptr(), image, pixel};
  }
  if (present(residual)) {
    check_like_z(*residual, z, "residual");
    const auto [image, pixel] = pixel_rows(*residual, "residual");
    args.residual = {residual->data_ptr(), image, pixel};
  }
  if (present(temb)) {
    const bool per_row = temb->dim() == 3;
    TORCH_CHECK((temb->dim() == 2 || (per_row && temb->size(2) == oh)) && temb->size(0) == n && temb->size(1) == c,
                kOp, ": temb must have shape [N, C] = [", n, ", ", c, "] (one vector per image) or [N, C, OH] = [", n,
                ", ", c, ", ", oh, "] (one per output row), got ", temb->sizes());
    TORCH_CHECK_TYPE(temb->scalar_type() == z.scalar_type(), kOp, ": temb has dtype ", temb->scalar_type(),
                     "; supported: z's dtype ", z.scalar_type());
    TORCH_CHECK(c == 1 || temb->stride(1) == 1, kOp, ": temb must have unit channel stride, got strides ",
                temb->strides());
    check_same_device(*temb, z, kOp, "temb", "z");
    args.temb = temb->data_ptr();
    args.temb_image_stride = n > 1 ? temb->stride(0) : 0;
    args.temb_row_stride = per_row && oh > 1 ? temb->stride(2) : 0;
  }
  if (present(gate)) {
    TORCH_CHECK(gate->dim() == 2 && gate->size(0) == n && (gate->size(1) == 1 || gate->size(1) == oh), kOp,
                ": gate must have shape [N, 1] or [N, OH] = [", n, ", ", oh, "], got ", gate->sizes());
    TORCH_CHECK_TYPE(gate->scalar_type() == at::kFloat, kOp, ": gate has dtype ", gate->scalar_type(),
                     "; supported: float32");
    check_same_device(*gate, z, kOp, "gate", "z");
    args.gate = static_cast<const float*>(gate->data_ptr());  // untyped: a meta tensor has no typed pointer
    args.gate_image_stride = n > 1 ? gate->stride(0) : 0;
    args.gate_row_stride = gate->size(1) > 1 ? gate->stride(1) : 0;
  }
  TORCH_CHECK((args.temb_row_stride == 0 && !present(gate)) || s <= INT32_MAX, kOp,
              ": a per-row temb or gate over ", s, " pixels per image is not supported; supported: up to 2^31 - 1");
  TORCH_CHECK(std::isfinite(inv_scale), kOp, ": inv_scale must be finite, got ", inv_scale);
  TORCH_CHECK(write || (!present(shortcut) && !present(residual) && !present(temb) && !present(gate) &&
                        inv_scale == 1.0),
              kOp, ": write=False only reads z (no shortcut, residual, temb or gate, inv_scale 1)");
  TORCH_CHECK(groups >= 0 && (groups == 0 || c % groups == 0), kOp, ": groups=", groups, " must be 0 (none) or ",
              "divide C=", c);
  TORCH_CHECK((groups == 0 && !channel_sums) || c <= kMaxChannels, kOp, ": statistics of C=", c,
              " channels are not supported; supported: C <= ", kMaxChannels);
  TORCH_CHECK(std::isfinite(eps) && eps >= 0.0, kOp, ": eps must be a finite number >= 0, got ", eps);
  const Problem p{n, s, c, dtype, write, static_cast<float>(inv_scale), groups, channel_sums,
                  static_cast<float>(eps), z.size(3)};
  return {p, args};
}

bool packable(const Problem& p, const Args& a) {
  const int64_t v = max_vec(p.dtype);
  auto fits = [v](const void* ptr, int64_t image, int64_t pixel) {
    return ptr == nullptr || (aligned16(ptr) && image % v == 0 && pixel % v == 0);
  };
  return fits(a.z, a.z_image_stride, a.z_pixel_stride) &&
         fits(a.shortcut.ptr, a.shortcut.image_stride, a.shortcut.pixel_stride) &&
         fits(a.residual.ptr, a.residual.image_stride, a.residual.pixel_stride) &&
         fits(a.temb, a.temb_image_stride, a.temb_row_stride);
}

Outputs new_outputs(const at::Tensor& z, const Problem& p) {
  const auto f32 = z.options().dtype(at::kFloat);
  return {new_output(at::empty({p.N, p.groups}, f32)), new_output(at::empty({p.N, p.groups}, f32)),
          new_output(at::empty({p.N, p.channel_sums ? p.C : 0, 2}, z.options().dtype(at::kDouble)))};
}

}  // namespace

Outputs run_meta(const at::Tensor& z, const std::optional<at::Tensor>& shortcut,
                 const std::optional<at::Tensor>& residual, const std::optional<at::Tensor>& temb,
                 const std::optional<at::Tensor>& gate, double inv_scale, bool write, int64_t groups,
                 bool channel_sums, double eps) {
  const Checked c = check(z, shortcut, residual, temb, gate, inv_scale, write, groups, channel_sums, eps);
  return new_outputs(z, c.problem);
}

Outputs run_cuda(const at::Tensor& z, const std::optional<at::Tensor>& shortcut,
                 const std::optional<at::Tensor>& residual, const std::optional<at::Tensor>& temb,
                 const std::optional<at::Tensor>& gate, double inv_scale, bool write, int64_t groups,
                 bool channel_sums, double eps) {
  Checked c = check(z, shortcut, residual, temb, gate, inv_scale, write, groups, channel_sums, eps);
  check_cuda(z, kOp, "z");
  const c10::cuda::CUDAGuard guard(z.device());
  Outputs out = new_outputs(z, c.problem);
  const Plan plan = make_plan(c.problem, packable(c.problem, c.args));
  const at::Tensor workspace = at::empty({plan.workspace_floats}, z.options().dtype(at::kFloat));
  c.args.mean = std::get<0>(out).data_ptr<float>();
  c.args.rstd = std::get<1>(out).data_ptr<float>();
  c.args.sums = channel_sums ? std::get<2>(out).data_ptr<double>() : nullptr;
  c.args.partials = workspace.data_ptr<float>();
  run(c.problem, plan, c.args, reinterpret_cast<Stream>(c10::cuda::getCurrentCUDAStream().stream()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace ldmopt::conv_epilogue
