// adaLN modulation forward (the DiT / PixArt / SD3 / Flux / Wan norms), host interface: plain pointers and sizes (no
// torch types), so the torch glue (adaln_modulate.cpp) and the CPU emulator tests drive exactly the same launch code.
// The same pass as kernels/adaln_modulate.py's forward, one C++ op call instead of a Triton launch.
//
// Row m of x [M, C] belongs to sample b = m / tokens (tokens = M / B):
//   s = x, or x + residual, or residual + gate[b] * x (fp32, rounded to the dtype as the unfused add stores it),
//   y = (s - mean) * rstd * (1 + scale[b]) + shift[b]      (LayerNorm without affine, fp32, one rounding),
// with mean / rstd = 1 / sqrt(var + eps) of s's row as stored. Outputs: y [M, C] contiguous; s [M, C] contiguous when
// store_sum; mean and rstd [M] fp32 when save. x, residual, y and s share one dtype (fp32/fp16/bf16) and have unit
// column stride and a row stride of their own; scale, shift and gate are [B, C] rows in their own float dtypes.
// One warp a row: the statistics need no atomics or workspace (a deterministic Welford over the row), and the row is
// read twice (statistics, then the output) from global memory, the second time mostly from cache.
#pragma once

#include <cstdint>

#include "common/types.h"

namespace ldmopt::adaln_modulate {

constexpr int kThreads = 256;
constexpr int kRowsPerBlock = kThreads / 32;

// A [B, C] per-sample parameter: unit column stride, rows `row_bytes` bytes apart, in its own dtype; null: absent.
struct SampleRows {
  const void* ptr;
  DType dtype;
  int64_t row_bytes;
};

struct Problem {
  int64_t M, C, tokens;  // rows, channels, rows per sample
  int64_t x_row_stride, residual_row_stride;  // elements
  DType dtype;  // x, residual, y, s
  bool has_residual, has_gate, store_sum, save;
  float eps;
};

struct Args {
  const void* x;
  const void* residual;  // null: none
  SampleRows scale, shift, gate;  // gate.ptr null: none
  void* y;  // [M, C] contiguous
  void* s;  // [M, C] contiguous, or null (store_sum false)
  float* mean;  // [M], or null (save false)
  float* rstd;  // [M], or null
};

struct Plan {
  int vec;  // elements per packed access: max_vec(dtype), or 1 when C, a row stride or a pointer does not allow it
};

// Packed when every row of x, residual, y and s starts 16-byte aligned (pointers and row strides) and C is a multiple
// of the pack; scale, shift and gate are read an element at a time in their own dtypes.
inline Plan make_plan(const Problem& p, bool pointers_aligned) {
  const int v = max_vec(p.dtype);
  const bool strides = p.x_row_stride % v == 0 && p.residual_row_stride % v == 0;
  return {pointers_aligned && strides && p.C % v == 0 ? v : 1};
}

// Enqueue the kernel on stream; launch errors are left for the caller to check.
void forward(const Problem& p, const Plan& plan, const Args& args, Stream stream);

}  // namespace ldmopt::adaln_modulate
