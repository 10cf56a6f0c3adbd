// The conv epilogue after a cuDNN conv: shortcut, time embedding and residual adds, the output scale, the rounding,
// and the output's GroupNorm statistics or channel sums. Dtypes fp32/fp16/bf16; fp32 math; offsets in int64.
#include "common/compat.cuh"
#include "conv_epilogue/launch.h"

namespace ldmopt::conv_epilogue {
namespace {

template <typename T, int VEC>
__device__ __forceinline__ void add_pack(const Operand& o, int64_t n, int64_t pixel, int64_t c, float (&v)[VEC]) {
  float r[VEC];
  load_float<T, VEC>(static_cast<const T*>(o.ptr) + n * o.image_stride + pixel * o.pixel_stride + c, r);
#pragma unroll
  for (int i = 0; i < VEC; ++i) v[i] += r[i];
}

// Block (chunk of image n's pixels) x (tile of 32 * VEC channels): each lane owns VEC channels, each warp every
// kWarps-th pixel of the chunk. STATS: a lane's running (mean, m2) per channel over its pixels (one count for all),
// merged across the warps in shared memory into the chunk's partials.
template <typename T, int VEC, bool STATS>
__global__ __launch_bounds__(kThreads) void epilogue_kernel(Problem p, Plan plan, Args a) {
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int64_t chunk = blockIdx.x % plan.chunks;
  const int64_t n = blockIdx.x / plan.chunks;
  const int64_t c = (int64_t{blockIdx.y} * kWarpSize + lane) * VEC;
  const bool active = c < p.C;  // C % VEC == 0 when VEC > 1, so a lane's channels are all in or all out
  const int64_t begin = chunk * plan.chunk_pixels;
  const int64_t end = begin + plan.chunk_pixels < p.S ? begin + plan.chunk_pixels : p.S;
  const bool temb_rows = a.temb != nullptr && a.temb_row_stride != 0;  // one vector per output row (frame)
  float temb[VEC] = {};
  if (active && a.temb != nullptr && !temb_rows) {
    load_float<T, VEC>(static_cast<const T*>(a.temb) + n * a.temb_image_stride + c, temb);
  }
  float count = 0.0f;
  float mean[VEC] = {};
  float m2[VEC] = {};
  if (active) {
    T* z = static_cast<T*>(a.z) + n * a.z_image_stride + c;
    for (int64_t pixel = begin + warp; pixel < end; pixel += kWarps) {
      float v[VEC];
      load_float<T, VEC>(z + pixel * a.z_pixel_stride, v);
      if (p.write) {
        // The Triton pass's order: the shortcut, the time embedding, the gate, the residual, then the scale.
        if (a.shortcut.ptr != nullptr) add_pack<T, VEC>(a.shortcut, n, pixel, c, v);
        // 32-bit: a 64-bit division is a call with a stack frame (the glue refuses rows past 2^31 pixels)
        const int64_t row = temb_rows || a.gate != nullptr ? static_cast<uint32_t>(pixel) / static_cast<uint32_t>(p.W)
                                                           : 0;
        if (temb_rows) {
          load_float<T, VEC>(static_cast<const T*>(a.temb) + n * a.temb_image_stride + row * a.temb_row_stride + c,
                             temb);
        }
#pragma unroll
        for (int i = 0; i < VEC; ++i) v[i] += temb[i];
        if (a.gate != nullptr) {
          const float g = a.gate[n * a.gate_image_stride + row * a.gate_row_stride];
#pragma unroll
          for (int i = 0; i < VEC; ++i) v[i] *= g;
        }
        if (a.residual.ptr != nullptr) add_pack<T, VEC>(a.residual, n, pixel, c, v);
#pragma unroll
        for (int i = 0; i < VEC; ++i) v[i] *= p.inv_scale;
        store_float<T, VEC>(z + pixel * a.z_pixel_stride, v);
      }
      if constexpr (STATS) {
        count += 1.0f;
        const float inv = __fdividef(1.0f, count);
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const float x = p.write ? to_float(from_float<T>(v[i])) : v[i];  // the values as stored
          const float d = x - mean[i];
          mean[i] += d * inv;
          m2[i] += d * (x - mean[i]);
        }
      }
    }
  }
  if constexpr (STATS) {
    // Every warp's statistics of every channel of the tile, then one thread per channel merges the warps'.
    __shared__ float s_mean[kWarps][kWarpSize * VEC];
    __shared__ float s_m2[kWarps][kWarpSize * VEC];
    __shared__ float s_count[kWarps];
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      s_mean[warp][lane * VEC + i] = mean[i];
      s_m2[warp][lane * VEC + i] = m2[i];
    }
    if (lane == 0) s_count[warp] = count;
    __syncthreads();
    for (int j = threadIdx.x; j < kWarpSize * VEC; j += kThreads) {
      const int64_t channel = int64_t{blockIdx.y} * kWarpSize * VEC + j;
      if (channel >= p.C) continue;
      Welford w;
      for (int k = 0; k < kWarps; ++k) w.merge(Welford{s_count[k], s_mean[k][j], s_m2[k][j]});
      float* out = a.partials + ((n * plan.chunks + chunk) * p.C + channel) * 2;
      out[0] = w.mean;
      out[1] = w.m2;
    }
  }
}

// A channel's statistics over all of image n's pixels from its chunks' partials, on every lane of the calling warp:
// the lanes take chunks lane, lane + 32, ... (independent loads in flight together), then a fixed butterfly merges
// the lanes (deterministic).
__device__ __forceinline__ Welford merge_chunks(const Problem& p, const Plan& plan, const float* partials, int64_t n,
                                                int64_t c, int lane) {
  Welford w;
  for (int64_t k = lane; k < plan.chunks; k += kWarpSize) {
    const float* part = partials + ((n * plan.chunks + k) * p.C + c) * 2;
    const int64_t rows = std::min<int64_t>(plan.chunk_pixels, p.S - k * plan.chunk_pixels);
    w.merge(Welford{static_cast<float>(rows), part[0], part[1]});
  }
#pragma unroll
  for (int m = kWarpSize / 2; m > 0; m >>= 1) w.merge(w.shfl_xor(m));
  return w;
}

// Block (image n, blockIdx.y): with groups, group blockIdx.y, its channels merged one per warp, then the group from
// its channels; without, channels [8 blockIdx.y, 8 blockIdx.y + 8), one per warp, for the channel sums alone. Many
// small blocks, each a few L2 round trips deep: the partials' merge is latency-bound, not a long serial chain.
__global__ __launch_bounds__(kThreads) void finalize_kernel(Problem p, Plan plan, Args a) {
  LDMOPT_DYNAMIC_SMEM(smem);
  float* c_mean = reinterpret_cast<float*>(smem);  // [channels of the block]
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int64_t n = blockIdx.x;
  const int64_t per_block = p.groups > 0 ? p.C / p.groups : kWarps;
  float* c_m2 = c_mean + per_block;
  const int64_t first = int64_t{blockIdx.y} * per_block;
  const int64_t last = std::min<int64_t>(first + per_block, p.C);
  for (int64_t c = first + warp; c < last; c += kWarps) {
    const Welford w = merge_chunks(p, plan, a.partials, n, c, lane);
    if (lane == 0) {
      c_mean[c - first] = w.mean;
      c_m2[c - first] = w.m2;
      if (a.sums != nullptr) {  // sum and sum of squares in fp64, as the Triton pass's workspace holds them
        const double s = static_cast<double>(w.mean) * static_cast<double>(p.S);
        a.sums[(n * p.C + c) * 2] = s;
        a.sums[(n * p.C + c) * 2 + 1] = static_cast<double>(w.m2) + s * (s / static_cast<double>(p.S));
      }
    }
  }
  if (p.groups == 0) return;  // uniform across the launch
  __syncthreads();
  if (threadIdx.x != 0) return;
  Welford w;
  for (int64_t c = 0; c < per_block; ++c) w.merge(Welford{static_cast<float>(p.S), c_mean[c], c_m2[c]});
  const float var = w.m2 / w.count;
  a.mean[n * p.groups + blockIdx.y] = w.mean;
  a.rstd[n * p.groups + blockIdx.y] = rsqrtf((var < 0.0f ? 0.0f : var) + p.eps);  // NaN stays NaN
}

template <typename T, int VEC>
void launch_pass(const Problem& p, const Plan& plan, const Args& args, Stream stream) {
  const dim3 grid(grid_x(p.N * plan.chunks), static_cast<unsigned>(plan.channel_tiles));
  if (statistics(p)) {
    launch_kernel(epilogue_kernel<T, VEC, true>, grid, dim3(kThreads), 0, stream, p, plan, args);
  } else {
    launch_kernel(epilogue_kernel<T, VEC, false>, grid, dim3(kThreads), 0, stream, p, plan, args);
  }
}

template <typename T>
void launch_typed(const Problem& p, const Plan& plan, const Args& args, Stream stream) {
  if (plan.vec == 1) {
    launch_pass<T, 1>(p, plan, args, stream);
  } else {
    launch_pass<T, 16 / sizeof(T)>(p, plan, args, stream);
  }
}

}  // namespace

// The finalize kernel's blocks per image (a group each, or 8 channels each) and dynamic shared memory (each of the
// block's channels' merged mean and m2).
inline int64_t finalize_blocks(const Problem& p) { return p.groups > 0 ? p.groups : ceil_div<int64_t>(p.C, kWarps); }
inline size_t finalize_smem_bytes(const Problem& p) {
  return static_cast<size_t>(p.groups > 0 ? p.C / p.groups : kWarps) * 2 * sizeof(float);
}

void run(const Problem& p, const Plan& plan, const Args& args, Stream stream) {
  if (p.N == 0 || p.S == 0 || !(p.write || statistics(p))) return;  // nothing to write or sum: no launch
  with_element_type(p.dtype, [&]<typename T>() { launch_typed<T>(p, plan, args, stream); });
  if (statistics(p)) {
    const dim3 grid(grid_x(p.N), static_cast<unsigned>(finalize_blocks(p)));
    launch_kernel(finalize_kernel, grid, dim3(kThreads), finalize_smem_bytes(p), stream, p, plan, args);
  }
}

}  // namespace ldmopt::conv_epilogue
