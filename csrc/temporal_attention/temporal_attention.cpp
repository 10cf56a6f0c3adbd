// Torch glue of the temporal attention kernel: argument checks (shared by the CUDA and Meta implementations), the
// output (torch.empty_like(q), as the Triton launcher does, or a caller's `out` with any strides) and the launch on
// the current stream.
#include "temporal_attention/temporal_attention.h"

#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <cmath>

#include "common/torch_utils.h"

namespace ldmopt::temporal_attention {
namespace {

constexpr const char* kOp = "ldmopt.temporal_attention_fwd_cuda";
constexpr const char* kOutOp = "ldmopt.temporal_attention_fwd_out_cuda";

void check_out(const at::Tensor& out, const at::Tensor& q) {
  constexpr const char* op = kOutOp;
  TORCH_CHECK(out.sizes() == q.sizes(), op, ": out must have q's shape ", q.sizes(), ", got ", out.sizes());
  TORCH_CHECK_TYPE(out.scalar_type() == q.scalar_type(), op, ": out has dtype ", out.scalar_type(), " but q has ",
                   q.scalar_type(), "; they must match");
  check_same_device(out, q, op, "out", "q");
}

template <typename Ptr>
ViewT<Ptr> view_of(const at::Tensor& t, Ptr ptr) {
  ViewT<Ptr> v{ptr, {}};
  for (int i = 0; i < 5; ++i) v.stride[i] = t.stride(i);
  return v;
}

// The opt-in shared memory limit per block of a device, queried once per device (a launch then costs no query).
int64_t smem_limit_of(int device) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cached[kMaxDevices] = {};  // 0: not queried yet
  if (device >= 0 && device < kMaxDevices) {
    const int known = cached[device].load(std::memory_order_relaxed);
    if (known > 0) return known;
  }
  int limit = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  if (device >= 0 && device < kMaxDevices) cached[device].store(limit, std::memory_order_relaxed);
  return limit;
}

void launch(const char* op, const Problem& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
            const at::Tensor& out) {
  if (out.numel() == 0) return;
  const Plan plan = make_plan(p);
  const int64_t smem_limit = smem_limit_of(q.get_device());
  const int64_t smem_needed = plan.smem_bytes + kStaticSmemBytes;
  TORCH_CHECK(smem_needed <= smem_limit, op, ": F=", p.F, ", head_dim=", p.D, " in ", q.scalar_type(), " needs ",
              smem_needed, " bytes of shared memory per block; this GPU allows ", smem_limit,
              " (float16/bfloat16 inputs need less)");
  const auto in = [](const at::Tensor& t) { return view_of<const void*>(t, t.data_ptr()); };
  forward(p, plan, in(q), in(k), in(v), view_of<void*>(out, out.data_ptr()),
          reinterpret_cast<Stream>(c10::cuda::getCurrentCUDAStream().stream()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

Problem check_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, const char* op) {
  TORCH_CHECK(q.dim() == 5, op, ": q must be a 5-D (B, F, N, H, head_dim) view, got shape ", q.sizes());
  TORCH_CHECK(k.sizes() == q.sizes(), op, ": k must have q's shape ", q.sizes(), ", got ", k.sizes());
  TORCH_CHECK(v.sizes() == q.sizes(), op, ": v must have q's shape ", q.sizes(), ", got ", v.sizes());
  const DType dtype = dtype_of(q, op, "q");
  TORCH_CHECK_TYPE(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), op,
                   ": q, k, v must share one dtype, got ", q.scalar_type(), ", ", k.scalar_type(), ", ",
                   v.scalar_type());
  check_same_device(k, q, op, "k", "q");
  check_same_device(v, q, op, "v", "q");
  const int64_t F = q.size(1);
  const int64_t D = q.size(4);
  TORCH_CHECK(F >= 1 && F <= kMaxFrames, op, ": F=", F, " frames (q shape ", q.sizes(),
              ") is not supported; supported: 1 <= F <= ", kMaxFrames);
  TORCH_CHECK(D >= 1 && D <= kMaxHeadDim, op, ": head_dim=", D, " (q shape ", q.sizes(),
              ") is not supported; supported: 1 <= head_dim <= ", kMaxHeadDim);
  TORCH_CHECK(std::isfinite(scale), op, ": scale must be finite, got ", scale);
  const Problem p{q.size(0), F, q.size(2), q.size(3), D, dtype, static_cast<float>(scale)};
  const int64_t blocks = make_plan(p).blocks;
  TORCH_CHECK(blocks <= std::numeric_limits<int32_t>::max(), op, ": B*N*H=", p.B * p.N * p.H,
              " sequences need ", blocks, " blocks, over grid axis x's limit 2^31 - 1");
  return p;
}

at::Tensor forward_meta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  check_forward(q, k, v, scale, kOp);
  return at::empty_like(q);
}

void forward_out_meta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                      const at::Tensor& out) {
  check_forward(q, k, v, scale, kOutOp);
  check_out(out, q);
}

at::Tensor forward_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  const Problem p = check_forward(q, k, v, scale, kOp);
  check_cuda(q, kOp, "q");
  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor out = new_output(at::empty_like(q));
  launch(kOp, p, q, k, v, out);
  return out;
}

void forward_out_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                      const at::Tensor& out) {
  const Problem p = check_forward(q, k, v, scale, kOutOp);
  check_out(out, q);
  check_cuda(q, kOutOp, "q");
  const c10::cuda::CUDAGuard guard(q.device());
  launch(kOutOp, p, q, k, v, out);
}

}  // namespace ldmopt::temporal_attention
