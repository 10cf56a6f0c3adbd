// The fused convolution's epilogue after a cuDNN conv (the "cudnn" placement), host interface: plain pointers and
// sizes (no torch types), so the torch glue (conv_epilogue.cpp) and the CPU emulator tests drive exactly the same
// launch code. The same pass as kernels/conv_epilogue.py for what Stable Diffusion's UNets and VAEs hand it, one C++
// op call instead of a Triton launch and a zeroing one.
//
// Over the conv output z [N, C, OH, OW], channels-last with its pixels at one stride (pixel p of image n at
// n * image_stride + p * pixel_stride, unit channel stride), in place:
//   y = (residual + gate[n, oh] * (z + shortcut + temb[n(, oh)])) * inv_scale,   rounded once to the dtype,
// (a video model's temporal conv hands a time embedding and an fp32 gate per output row oh, a frame),
// and, from the values as stored, the per-(n, group) GroupNorm statistics of y for the next GroupNorm and/or the
// per-(n, channel) fp64 sums (sum, sum of squares) a later two-part GroupNorm finalises.
// Two kernels: the pass, whose blocks each take a chunk of one image's pixels and a tile of channels (a lane keeps
// Welford statistics of its channels over the chunk, merged across the block's warps), then the finalisation, a
// block per (image, group) (or per 8 channels for the sums alone) whose warps merge a channel's chunks across their
// lanes (Chan, a fixed butterfly) and then the group's channels: no atomics, deterministic.
#pragma once

#include <algorithm>
#include <cstdint>

#include "common/types.h"

namespace ldmopt::conv_epilogue {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// An [N, S, C] operand: image and pixel strides in elements (unit channel stride); a null pointer when absent.
struct Operand {
  const void* ptr;
  int64_t image_stride, pixel_stride;
};

struct Problem {
  int64_t N, S, C;  // S = OH * OW pixels
  DType dtype;  // z, shortcut, residual, temb
  bool write;  // false: z is read only (nothing to add, a scale of 1)
  float inv_scale;
  int64_t groups;  // > 0: GroupNorm statistics [N, groups] of y
  bool channel_sums;  // per-(n, c) fp64 sums [N, C, 2] of y
  float eps;
  int64_t W;  // OW: pixel p is in output row p / W (for a per-row temb or gate)
};

struct Args {
  void* z;  // y, written in place
  int64_t z_image_stride, z_pixel_stride;
  Operand shortcut, residual;
  const void* temb;  // [N, C] rows temb_image_stride apart, or [N, C, OH] (temb_row_stride != 0), or null
  int64_t temb_image_stride, temb_row_stride;
  const float* gate;  // [N, OH] (or [N, 1]: gate_row_stride 0), or null
  int64_t gate_image_stride, gate_row_stride;
  float* mean;  // [N, groups]
  float* rstd;  // [N, groups]
  double* sums;  // [N, C, 2], or null
  float* partials;  // [N, chunks, C, 2] (mean, m2 of each chunk's pixels), plan.workspace_floats
};

struct Plan {
  int vec;  // channels per lane: max_vec(dtype), or 1 when C, a stride or a pointer does not allow packed accesses
  int64_t channel_tiles;  // ceil(C / (32 * vec))
  int64_t chunks;  // pixel chunks per image
  int64_t chunk_pixels;  // pixels per chunk (the last may have fewer)
  int64_t workspace_floats;  // for Args::partials (0 without statistics)
};

inline bool statistics(const Problem& p) { return p.groups > 0 || p.channel_sums; }

// Enough blocks to fill a large GPU several times over, chunks of at least 64 pixels.
inline Plan make_plan(const Problem& p, bool packable) {
  const int v = packable && p.C % max_vec(p.dtype) == 0 ? max_vec(p.dtype) : 1;
  const int64_t tiles = ceil_div<int64_t>(p.C, int64_t{32} * v);
  const int64_t per_image = std::max<int64_t>(1, ceil_div<int64_t>(1024, std::max<int64_t>(1, p.N * tiles)));
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(per_image, ceil_div<int64_t>(p.S, 64)));
  const int64_t chunk_pixels = std::max<int64_t>(1, ceil_div<int64_t>(p.S, chunks));
  const int64_t used = ceil_div<int64_t>(p.S, chunk_pixels);  // no empty chunk
  return {v, tiles, used, chunk_pixels, statistics(p) ? p.N * used * p.C * 2 : 0};
}

// Enqueue the kernels on stream; launch errors are left for the caller to check.
void run(const Problem& p, const Plan& plan, const Args& args, Stream stream);

}  // namespace ldmopt::conv_epilogue
