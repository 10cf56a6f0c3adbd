// LayerNorm row kernels, host interface: plain pointers and sizes (no torch types), so the torch glue (layer_norm.cpp)
// and the CPU emulator tests drive exactly the same launch code. One warp per row in both.
//
// Row statistics (what the GEMMs that read a LayerNorm in their loads need): x is [M, C] rows with unit column stride
// and a row stride of its own; stats is [2, M] fp32 (row means, then rstd = 1 / sqrt(var + eps), biased variance).
// Welford over the lanes' packed loads, Chan's merge across the warp, so a row far from zero mean keeps its variance.
//
// Apply (what cuBLAS's GEMM reads under the "cublas" placement, and the backward's recomputed A operand): from those
// statistics, h = (x - mean) * rstd * weight + bias + positions[(m / position_rows) % P], rounded once to x's dtype,
// into a contiguous [M, C].
#pragma once

#include <cstdint>

#include "common/types.h"

namespace ldmopt::layer_norm {

// Threads per block; one warp a row.
constexpr int kThreads = 256;
constexpr int kRowsPerBlock = kThreads / 32;

struct Problem {
  int64_t M, C, row_stride;  // row_stride in elements
  DType dtype;
};

struct Plan {
  int vec;  // elements per packed load: max_vec(dtype), or 1 when the row stride, C or the pointer do not allow it
};

// The packed path needs every row start 16-byte aligned (pointer and row stride) and C a multiple of the pack.
inline Plan make_plan(const Problem& p, bool pointer_aligned) {
  const int v = max_vec(p.dtype);
  const bool packed = pointer_aligned && p.C % v == 0 && p.row_stride % v == 0;
  return {packed ? v : 1};
}

// Enqueue the kernel on stream; launch errors are left for the caller to check.
void row_statistics(const Problem& p, const Plan& plan, const void* x, float* stats, float eps, Stream stream);

struct ApplyProblem {
  int64_t M, C, row_stride;  // x, as Problem
  int64_t P, position_stride, position_rows;  // positions [P, C] (row stride in elements), P = 0 when absent
  DType dtype;  // x, positions and h
};

struct ApplyArgs {
  const void* x;
  const float* stats;  // [2, M]
  AnyVector weight, bias;  // [C] in their own dtypes, or null
  const void* positions;  // [P, C], unit column stride, or null
  void* h;  // [M, C] contiguous
};

// Packed when x's, the positions' and h's rows all start 16-byte aligned and C is a multiple of the pack.
inline Plan make_apply_plan(const ApplyProblem& p, bool pointers_aligned) {
  const int v = max_vec(p.dtype);
  const bool packed = pointers_aligned && p.C % v == 0 && p.row_stride % v == 0 && p.position_stride % v == 0;
  return {packed ? v : 1};
}

void apply(const ApplyProblem& p, const Plan& plan, const ApplyArgs& args, Stream stream);

}  // namespace ldmopt::layer_norm
