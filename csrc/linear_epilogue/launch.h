// The fused linear layer's epilogue after a cuBLAS GEMM (the "cublas" placement), host interface: plain pointers and
// sizes (no torch types), so the torch glue (linear_epilogue.cpp) and the CPU emulator tests drive exactly the same
// launch code. The same pass as kernels/linear_epilogue.py, one C++ op call instead of a Triton launch.
//
// Over the GEMM output z [M, N] (its bias added; [M, 2N] for a GLU), row m:
//   y = residual[m] + gate[m / tokens_per_gate] * act(z)   or, GLU (GEGLU):  y = z[:, :N] * gelu(z[:, N:]),
// then the clamp to +-sat_max (Flux's fp16 stream, NaN kept), rounded once to the dtype; and, from the values as
// stored, the LayerNorm statistics of y's rows (mean, rstd = 1 / sqrt(var + eps)) for the norm that reads y next.
// y may be z itself (each lane reads its pack before writing it); with nothing to write, only z's statistics.
// Every tensor shares one dtype and has unit column stride; residual row m sits at
// (m / residual_rows) * residual_sample_stride + (m % residual_rows) * residual_row_stride ([M, N] or [B', T', N]).
// One warp a row, so the statistics need no atomics and no workspace: a deterministic Welford over the row.
#pragma once

#include <cstdint>

#include "common/types.h"

namespace ldmopt::linear_epilogue {

constexpr int kThreads = 256;
constexpr int kRowsPerBlock = kThreads / 32;

enum class Activation : int { kNone = 0, kSilu = 1, kGelu = 2, kGeluTanh = 3 };

struct Problem {
  int64_t M, N;
  int64_t z_row_stride, y_row_stride;  // elements
  int64_t gate_row_stride, tokens_per_gate;  // gate [B, N]: row m reads gate row m / tokens_per_gate
  int64_t residual_sample_stride, residual_row_stride, residual_rows;
  DType dtype;
  Activation activation;
  bool glu;  // y = z[:, :N] * gelu(z[:, N:]) (activation kGelu)
  bool saturate;
  bool write;  // false: only the statistics of z as it is
  float sat_max;  // the dtype's largest finite value
  float eps;
};

struct Args {
  const void* z;
  void* y;  // z itself when written in place; unused when !write
  const void* gate;  // null: none
  const void* residual;  // null: none
  float* stats;  // [2, M] (means, then rstds), or null: none
};

struct Plan {
  int vec;  // elements per packed access: max_vec(dtype), or 1 when a stride, N or a pointer does not allow it
};

// Packed when every row of every tensor starts 16-byte aligned (pointers and row strides) and N is a multiple of
// the pack (so a GLU's second half starts aligned too).
inline Plan make_plan(const Problem& p, bool pointers_aligned) {
  const int64_t v = max_vec(p.dtype);
  const bool strides = p.z_row_stride % v == 0 && p.y_row_stride % v == 0 && p.gate_row_stride % v == 0 &&
                       p.residual_sample_stride % v == 0 && p.residual_row_stride % v == 0;
  return {pointers_aligned && strides && p.N % v == 0 ? static_cast<int>(v) : 1};
}

// Enqueue the kernel on stream; launch errors are left for the caller to check. Throws std::invalid_argument for a
// GLU with another activation than GELU (the only GLU diffusers has).
void run(const Problem& p, const Plan& plan, const Args& args, Stream stream);

}  // namespace ldmopt::linear_epilogue
