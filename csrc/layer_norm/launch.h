// LayerNorm row statistics (what the GEMMs that read a LayerNorm in their loads need), host interface: plain
// pointers and sizes (no torch types), so the torch glue (layer_norm.cpp) and the CPU emulator tests drive exactly the
// same launch code.
//
// x is [M, C] rows with unit column stride and a row stride of its own; stats is [2, M] fp32 (row means, then
// rstd = 1 / sqrt(var + eps), biased variance). One warp per row: Welford over the lanes' packed loads, Chan's merge
// across the warp, so a row far from zero mean keeps its variance.
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

}  // namespace ldmopt::layer_norm
