// GroupNorm(+SiLU) forward and backward kernels for channels-first and channels-last (N, C, S) tensors.
// Dtypes fp32/fp16/bf16 in and out; statistics, coefficients and all accumulation in fp32; offsets in int64.
// One template per pass: the partial reduction is shared by forward (Welford) and backward (sums of dz, dz * xhat)
// through a reducer policy, and one elementwise kernel applies y = act(a x + b) or dx = a dz + q x + r.
#include "common/compat.cuh"
#include "group_norm/launch.h"

namespace ldmopt::group_norm {
namespace {

// Everything the per-(n, group) passes read and write; independent of the data dtype.
struct Stats {
  AnyVector weight;  // [C] or null
  AnyVector bias;    // [C] or null
  const float* mean;    // [N, G]
  const float* rstd;    // [N, G]
  float* part_a;        // [N, n_chunks, C]
  float* part_b;        // [N, n_chunks, C]
  float* coef;          // [N, C, 2] forward, [N, C, 4] backward
  float* sum_dz;        // [N, C] (backward)
  float* sum_dzx;       // [N, C] (backward)
  int64_t N, C, S, G, s_per_chunk, n_chunks;
  float eps;
};

template <typename T>
struct Tensors {
  const T* x;
  const T* dy;  // backward only
  T* out;       // y or dx
  Stats s;
  // The forward statistics over two channels-last parts cat([x, x_tail], 1): x holds channels [0, c_head) as
  // [N, S, c_head], x_tail the rest as [N, S, C - c_head]; null for one tensor.
  const T* x_tail = nullptr;
  int64_t c_head = 0;
};

// ------------------------------------------------------------------------------------------ reducers

// Forward statistics: Welford (count, mean, M2) of x per channel; partials are (mean, M2), counts are implied by
// the chunk length.
struct StatsReducer {
  static constexpr bool kNeedsDy = false;
  struct Param {};
  using State = Welford;
  __device__ __forceinline__ static Param param(const Stats&, int64_t, int64_t) { return {}; }
  __device__ __forceinline__ static void update(State& st, const Param&, float x, float) { st.add(x); }
  __device__ __forceinline__ static float out_a(const State& st) { return st.mean; }
  __device__ __forceinline__ static float out_b(const State& st) { return st.m2; }
};

// Backward: sums of dz and dz * xhat per channel, with dz = act'(z) * dy at z = a * x + b (the affine-transformed
// value the forward activation saw).
template <class Act>
struct GradReducer {
  static constexpr bool kNeedsDy = true;
  struct Param {
    float a, b, rstd, shift;  // z = a x + b; xhat = rstd x + shift
  };
  struct State {
    float dz = 0.0f;
    float dzx = 0.0f;
    __device__ __forceinline__ void merge(const State& o) {
      dz += o.dz;
      dzx += o.dzx;
    }
    __device__ __forceinline__ State shfl_xor(int m) const {
      return {__shfl_xor_sync(kFullMask, dz, m), __shfl_xor_sync(kFullMask, dzx, m)};
    }
  };
  __device__ __forceinline__ static Param param(const Stats& s, int64_t n, int64_t c) {
    const int64_t ng = n * s.G + c / (s.C / s.G);
    const float mean = s.mean[ng];
    const float rstd = s.rstd[ng];
    const float w = param_at(s.weight, c, 1.0f);
    const float b = param_at(s.bias, c, 0.0f);
    return {w * rstd, b - w * rstd * mean, rstd, -mean * rstd};
  }
  __device__ __forceinline__ static void update(State& st, const Param& p, float x, float dy) {
    const float dz = Act::grad(p.a * x + p.b, dy);
    st.dz += dz;
    st.dzx += dz * (p.rstd * x + p.shift);
  }
  __device__ __forceinline__ static float out_a(const State& st) { return st.dz; }
  __device__ __forceinline__ static float out_b(const State& st) { return st.dzx; }
};

// ------------------------------------------------------------------------------------------ partial reductions

// Channels-last: block = (n, chunk of S, block of channels). Threads are laid out as rows x channel packs, walk the
// chunk's rows with packed loads along C, then merge their rows per channel in shared memory.
template <typename T, int VEC, class R>
__global__ __launch_bounds__(kThreads) void partial_cl_kernel(Tensors<T> t, int64_t tc, int64_t n_cblocks) {
  using State = typename R::State;
  // Raw storage: __shared__ variables cannot have constructors.
  __shared__ __align__(16) unsigned char raw[kThreads * VEC * sizeof(State)];
  State* merged = reinterpret_cast<State*>(raw);
  const Stats& s = t.s;
  const int64_t tid = threadIdx.x;
  const int64_t rows = kThreads / tc;
  const int64_t lane_c = tid % tc;
  const int64_t row = tid / tc;
  const int64_t blk = blockIdx.x;
  const int64_t cb = blk % n_cblocks;
  const int64_t chunk = (blk / n_cblocks) % s.n_chunks;
  const int64_t n = blk / (n_cblocks * s.n_chunks);
  const int64_t c0 = (cb * tc + lane_c) * VEC;
  // When VEC > 1, C is a multiple of VEC, so c0 < C means the whole pack is inside the row.
  const bool active = row < rows && c0 < s.C;
  const int64_t s_begin = chunk * s.s_per_chunk;
  const int64_t s_end = std::min(s_begin + s.s_per_chunk, s.S);
  // The part this thread's channels lie in (a pack never straddles the parts: the plan's pack divides both).
  const bool in_tail = t.x_tail != nullptr && c0 >= t.c_head;
  const T* src = in_tail ? t.x_tail : t.x;
  const int64_t src_c = t.x_tail == nullptr ? s.C : (in_tail ? s.C - t.c_head : t.c_head);
  const int64_t src_c0 = in_tail ? c0 - t.c_head : c0;

  State st[VEC];
  if (active) {
    typename R::Param prm[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) prm[j] = R::param(s, n, c0 + j);
    for (int64_t sp = s_begin + row; sp < s_end; sp += rows) {
      float x[VEC];
      float dy[VEC] = {};
      load_float<T, VEC>(src + (n * s.S + sp) * src_c + src_c0, x);
      if constexpr (R::kNeedsDy) load_float<T, VEC>(t.dy + (n * s.S + sp) * s.C + c0, dy);
#pragma unroll
      for (int j = 0; j < VEC; ++j) R::update(st[j], prm[j], x[j], dy[j]);
    }
  }
  // Pairwise tree over the rows (log2(rows) steps, every thread busy): better rounding than a running merge.
  if (row < rows) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) merged[tid * VEC + j] = st[j];
  }
  __syncthreads();
  for (int64_t step = 1; step < rows; step *= 2) {
    if (row % (2 * step) == 0 && row + step < rows) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        st[j].merge(merged[(tid + step * tc) * VEC + j]);
        merged[tid * VEC + j] = st[j];
      }
    }
    __syncthreads();
  }
  if (row == 0 && active) {
    const int64_t out = (n * s.n_chunks + chunk) * s.C + c0;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      s.part_a[out + j] = R::out_a(st[j]);
      s.part_b[out + j] = R::out_b(st[j]);
    }
  }
}

// Channels-first: one warp per (n, chunk, c) item, a contiguous run of S; lanes stride it with packed loads and
// merge through shuffles.
template <typename T, int VEC, class R>
__global__ __launch_bounds__(kThreads) void partial_cf_kernel(Tensors<T> t) {
  const Stats& s = t.s;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t item = int64_t{blockIdx.x} * (kThreads / kWarpSize) + threadIdx.x / kWarpSize;
  const int64_t c = item % s.C;
  const int64_t chunk = (item / s.C) % s.n_chunks;
  const int64_t n = item / (s.C * s.n_chunks);
  // The whole warp shares `item`, so it is active or idle as one, and every lane reaches the shuffles.
  const bool active = item < s.N * s.n_chunks * s.C;
  typename R::State st;
  if (active) {
    const typename R::Param prm = R::param(s, n, c);
    const int64_t row = (n * s.C + c) * s.S;
    const int64_t s_end = std::min((chunk + 1) * s.s_per_chunk, s.S);
    for (int64_t sp = chunk * s.s_per_chunk + lane * VEC; sp < s_end; sp += kWarpSize * VEC) {
      float x[VEC];
      float dy[VEC] = {};
      load_float<T, VEC>(t.x + row + sp, x);
      if constexpr (R::kNeedsDy) load_float<T, VEC>(t.dy + row + sp, dy);
#pragma unroll
      for (int j = 0; j < VEC; ++j) R::update(st, prm, x[j], dy[j]);
    }
  }
#pragma unroll
  for (int m = kWarpSize / 2; m > 0; m >>= 1) st.merge(st.shfl_xor(m));
  if (active && lane == 0) {
    s.part_a[item] = R::out_a(st);
    s.part_b[item] = R::out_b(st);
  }
}

// ------------------------------------------------------------------------------------------ per-group finalize

// One block per (n, g): Chan's merge of the partials in two passes (the count-weighted mean, then
// M2 = sum(M2_k + count_k * (mean_k - mean)^2), both corrected by the residual), then a = w * rstd and
// b = bias - a * mean per channel.
__global__ __launch_bounds__(kFinalizeThreads) void finalize_forward_kernel(Stats s, float* mean_out,
                                                                            float* rstd_out) {
  __shared__ float scratch[kFinalizeThreads / kWarpSize];
  const int64_t ng = blockIdx.x;
  const int64_t n = ng / s.G;
  const int64_t g = ng % s.G;
  const int64_t cpg = s.C / s.G;
  const int64_t items = s.n_chunks * cpg;
  const float total = static_cast<float>(s.S * cpg);
  float acc = 0.0f;
  for (int64_t i = threadIdx.x; i < items; i += blockDim.x) {
    const int64_t k = i / cpg;
    const float count = static_cast<float>(std::min(s.S - k * s.s_per_chunk, s.s_per_chunk));
    acc += count * s.part_a[(n * s.n_chunks + k) * s.C + g * cpg + i % cpg];
  }
  const float first = block_sum(acc, scratch) / total;
  // The first mean rounds away from a constant group's value, and that rounding would count as variance: the
  // partial means' residual around it corrects both (kernels/_common.py's row_moments does the same).
  acc = 0.0f;
  float residual = 0.0f;
  for (int64_t i = threadIdx.x; i < items; i += blockDim.x) {
    const int64_t k = i / cpg;
    const float count = static_cast<float>(std::min(s.S - k * s.s_per_chunk, s.s_per_chunk));
    const int64_t off = (n * s.n_chunks + k) * s.C + g * cpg + i % cpg;
    const float d = s.part_a[off] - first;
    acc += s.part_b[off] + count * d * d;
    residual += count * d;
  }
  const float residual_sum = block_sum(residual, scratch);
  const float mean = first + residual_sum / total;
  const float m2 = (block_sum(acc, scratch) - residual_sum * (residual_sum / total)) / total;
  const float var = m2 < 0.0f ? 0.0f : m2;  // not fmaxf: a NaN in the group keeps rstd NaN
  const float rstd = rsqrtf(var + s.eps);
  if (threadIdx.x == 0) {
    mean_out[ng] = mean;
    rstd_out[ng] = rstd;
  }
  for (int64_t j = threadIdx.x; j < cpg; j += blockDim.x) {
    const int64_t c = g * cpg + j;
    const float a = param_at(s.weight, c, 1.0f) * rstd;
    s.coef[(n * s.C + c) * 2] = a;
    s.coef[(n * s.C + c) * 2 + 1] = param_at(s.bias, c, 0.0f) - a * mean;
  }
}

// One block per (n, g): per-channel sums over chunks (kept for dweight/dbias; a warp per channel, lanes over chunks),
// then with M = S * cpg, c1 = sum_c w dz, c2 = sum_c w dz xhat:
// dx = rstd * (w dz - (c1 + xhat c2) / M) = a dz + q x + r, q = -rstd^2 c2 / M, r = rstd (rstd c2 mean - c1) / M.
__global__ __launch_bounds__(kFinalizeThreads) void finalize_backward_kernel(Stats s) {
  constexpr int kWarps = kFinalizeThreads / kWarpSize;
  __shared__ float scratch[kWarps];
  const int64_t ng = blockIdx.x;
  const int64_t n = ng / s.G;
  const int64_t g = ng % s.G;
  const int64_t cpg = s.C / s.G;
  const int lane = threadIdx.x % kWarpSize;
  float local_c1 = 0.0f;
  float local_c2 = 0.0f;
  for (int64_t j = threadIdx.x / kWarpSize; j < cpg; j += kWarps) {
    const int64_t c = g * cpg + j;
    float dz = 0.0f;
    float dzx = 0.0f;
    for (int64_t k = lane; k < s.n_chunks; k += kWarpSize) {
      const int64_t off = (n * s.n_chunks + k) * s.C + c;
      dz += s.part_a[off];
      dzx += s.part_b[off];
    }
    dz = warp_sum(dz);
    dzx = warp_sum(dzx);
    if (lane == 0) {
      s.sum_dz[n * s.C + c] = dz;
      s.sum_dzx[n * s.C + c] = dzx;
      const float w = param_at(s.weight, c, 1.0f);
      local_c1 += w * dz;
      local_c2 += w * dzx;
    }
  }
  const float c1 = block_sum(local_c1, scratch);
  const float c2 = block_sum(local_c2, scratch);
  const float mean = s.mean[ng];
  const float rstd = s.rstd[ng];
  const float inv_m = 1.0f / static_cast<float>(s.S * cpg);
  const float q = -rstd * rstd * c2 * inv_m;
  const float r = rstd * (rstd * c2 * mean - c1) * inv_m;
  for (int64_t j = threadIdx.x; j < cpg; j += blockDim.x) {
    const int64_t c = g * cpg + j;
    const float a = param_at(s.weight, c, 1.0f) * rstd;
    float* out = s.coef + (n * s.C + c) * 4;
    out[0] = a;
    out[1] = param_at(s.bias, c, 0.0f) - a * mean;
    out[2] = q;
    out[3] = r;
  }
}

// One thread per (n, c): the coefficients a = w * rstd, b = bias - a * mean of given statistics (apply).
__global__ __launch_bounds__(kThreads) void coef_forward_kernel(Stats s) {
  const int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;  // n * C + c
  if (i >= s.N * s.C) return;
  const int64_t c = i % s.C;
  const int64_t ng = (i / s.C) * s.G + c / (s.C / s.G);
  const float a = param_at(s.weight, c, 1.0f) * s.rstd[ng];
  s.coef[i * 2] = a;
  s.coef[i * 2 + 1] = param_at(s.bias, c, 0.0f) - a * s.mean[ng];
}

// ------------------------------------------------------------------------------------------ elementwise

template <class Act>
struct ForwardOp {
  static constexpr int kCoef = 2;
  static constexpr bool kNeedsDy = false;
  __device__ __forceinline__ static float apply(const float* k, float x, float) { return Act::fwd(k[0] * x + k[1]); }
};

template <class Act>
struct BackwardOp {
  static constexpr int kCoef = 4;
  static constexpr bool kNeedsDy = true;
  __device__ __forceinline__ static float apply(const float* k, float x, float dy) {
    return k[0] * Act::grad(k[0] * x + k[1], dy) + k[2] * x + k[3];
  }
};

// Grid-stride loop over packs of VEC elements along the contiguous axis; per-(n, c) coefficients from `coef`.
template <typename T, int VEC, class Op>
__global__ __launch_bounds__(kThreads) void elementwise_kernel(Tensors<T> t, bool channels_last) {
  const Stats& s = t.s;
  const int64_t cs = s.C * s.S;
  const int64_t n_packs = s.N * cs / VEC;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n_packs; i += stride) {
    const int64_t e = i * VEC;
    const int64_t n = e / cs;
    const int64_t c = channels_last ? e % s.C : (e / s.S) % s.C;
    float x[VEC];
    float dy[VEC] = {};
    float out[VEC];
    load_float<T, VEC>(t.x + e, x);
    if constexpr (Op::kNeedsDy) load_float<T, VEC>(t.dy + e, dy);
    const float* k = s.coef + (n * s.C + c) * Op::kCoef;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      // Channels-last packs span VEC channels; channels-first packs share one.
      const Pack<float, Op::kCoef> kj = *as_pack<const Pack<float, Op::kCoef>>(k + (channels_last ? j * Op::kCoef : 0));
      out[j] = Op::apply(kj.v, x[j], dy[j]);
    }
    store_float<T, VEC>(t.out + e, out);
  }
}

// y = act(a x + b) over cat([x, x_tail], 1) of channels-last parts: y's packs in order, each read from the part its
// channels lie in (a pack never straddles the parts: both channel counts are multiples of VEC).
template <typename T, int VEC, class Act>
__global__ __launch_bounds__(kThreads) void elementwise_parts_kernel(Tensors<T> t, const T* x_tail, int64_t c_head) {
  const Stats& s = t.s;
  const int64_t c_tail = s.C - c_head;
  const int64_t n_packs = s.N * s.S * s.C / VEC;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n_packs; i += stride) {
    const int64_t e = i * VEC;
    const int64_t row = e / s.C;  // n * S + s
    const int64_t c = e - row * s.C;
    const int64_t n = row / s.S;
    float x[VEC];
    float out[VEC];
    if (c < c_head) {
      load_float<T, VEC>(t.x + row * c_head + c, x);
    } else {
      load_float<T, VEC>(x_tail + row * c_tail + (c - c_head), x);
    }
    const float* k = s.coef + (n * s.C + c) * 2;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const Pack<float, 2> kj = *as_pack<const Pack<float, 2>>(k + j * 2);
      out[j] = ForwardOp<Act>::apply(kj.v, x[j], 0.0f);
    }
    store_float<T, VEC>(t.out + e, out);
  }
}

// ------------------------------------------------------------------------------------------ launches

Stats make_stats(const Problem& p, const Plan& plan) {
  Stats s{};
  s.N = p.N;
  s.C = p.C;
  s.S = p.S;
  s.G = p.G;
  s.s_per_chunk = plan.s_per_chunk;
  s.n_chunks = plan.n_chunks;
  return s;
}

template <typename T, int VEC, class R>
void launch_partial(const Problem& p, const Plan& plan, const Tensors<T>& t, Stream stream) {
  if (p.channels_last) {
    const dim3 grid(grid_x(p.N * plan.n_chunks * plan.n_cblocks));
    launch_kernel(partial_cl_kernel<T, VEC, R>, grid, dim3(kThreads), 0, stream, t, plan.tc, plan.n_cblocks);
  } else {
    const dim3 grid(grid_x(ceil_div<int64_t>(p.N * plan.n_chunks * p.C, kThreads / kWarpSize)));
    launch_kernel(partial_cf_kernel<T, VEC, R>, grid, dim3(kThreads), 0, stream, t);
  }
}

template <typename T, int VEC, class Op>
void launch_elementwise(const Problem& p, const Tensors<T>& t, Stream stream) {
  const int64_t packs = p.N * p.C * p.S / VEC;
  const dim3 grid(grid_x(std::min<int64_t>(ceil_div<int64_t>(packs, kThreads), int64_t{1} << 16)));
  launch_kernel(elementwise_kernel<T, VEC, Op>, grid, dim3(kThreads), 0, stream, t, p.channels_last);
}

// What the forward passes read and write, from the host arguments.
template <typename T>
Tensors<T> forward_tensors(const Problem& p, const Plan& plan, const ForwardArgs& a) {
  Tensors<T> t{static_cast<const T*>(a.x), nullptr, static_cast<T*>(a.y), make_stats(p, plan)};
  t.s.weight = a.weight;
  t.s.bias = a.bias;
  t.s.mean = a.mean;
  t.s.rstd = a.rstd;
  t.s.part_a = a.part_a;
  t.s.part_b = a.part_b;
  t.s.coef = a.coef;
  t.s.eps = a.eps;
  return t;
}

template <typename T, int VEC>
void statistics_impl(const Problem& p, const Plan& plan, const Tensors<T>& t, const ForwardArgs& a, Stream stream) {
  launch_partial<T, VEC, StatsReducer>(p, plan, t, stream);
  launch_kernel(finalize_forward_kernel, dim3(grid_x(p.N * p.G)), dim3(kFinalizeThreads), 0, stream,
                t.s, a.mean, a.rstd);
}

template <typename T, int VEC>
void elementwise_forward(const Problem& p, const Tensors<T>& t, Stream stream) {
  if (p.silu) {
    launch_elementwise<T, VEC, ForwardOp<Silu>>(p, t, stream);
  } else {
    launch_elementwise<T, VEC, ForwardOp<Identity>>(p, t, stream);
  }
}

// kind: 0 forward (statistics, then the elementwise pass), 1 statistics alone, 2 apply (given statistics).
template <typename T, int VEC>
void forward_impl(const Problem& p, const Plan& plan, const ForwardArgs& a, int kind, Stream stream) {
  const Tensors<T> t = forward_tensors<T>(p, plan, a);
  if (kind != 2) statistics_impl<T, VEC>(p, plan, t, a, stream);
  if (kind == 2) {
    const dim3 grid(grid_x(ceil_div<int64_t>(p.N * p.C, kThreads)));
    launch_kernel(coef_forward_kernel, grid, dim3(kThreads), 0, stream, t.s);
  }
  if (kind != 1) elementwise_forward<T, VEC>(p, t, stream);
}

template <typename T, int VEC>
void apply_parts_impl(const Problem& p, const Plan& plan, const ForwardArgs& a, const void* x_tail, int64_t c_head,
                      Stream stream) {
  const Tensors<T> t = forward_tensors<T>(p, plan, a);
  launch_kernel(coef_forward_kernel, dim3(grid_x(ceil_div<int64_t>(p.N * p.C, kThreads))), dim3(kThreads), 0, stream,
                t.s);
  const int64_t packs = p.N * p.C * p.S / VEC;
  const dim3 grid(grid_x(std::min<int64_t>(ceil_div<int64_t>(packs, kThreads), int64_t{1} << 16)));
  const T* tail = static_cast<const T*>(x_tail);
  if (p.silu) {
    launch_kernel(elementwise_parts_kernel<T, VEC, Silu>, grid, dim3(kThreads), 0, stream, t, tail, c_head);
  } else {
    launch_kernel(elementwise_parts_kernel<T, VEC, Identity>, grid, dim3(kThreads), 0, stream, t, tail, c_head);
  }
}

template <typename T>
void statistics_parts_typed(const Problem& p, const Plan& plan, const ForwardArgs& a, const void* x_tail,
                            int64_t c_head, Stream stream) {
  Tensors<T> t = forward_tensors<T>(p, plan, a);
  t.x_tail = static_cast<const T*>(x_tail);
  t.c_head = c_head;
  if (plan.vec == 1) {
    statistics_impl<T, 1>(p, plan, t, a, stream);
  } else {
    statistics_impl<T, 16 / sizeof(T)>(p, plan, t, a, stream);
  }
}

template <typename T>
void apply_parts_typed(const Problem& p, const Plan& plan, const ForwardArgs& a, const void* x_tail, int64_t c_head,
                       Stream stream) {
  if (plan.vec == 1) {
    apply_parts_impl<T, 1>(p, plan, a, x_tail, c_head, stream);
  } else {
    apply_parts_impl<T, 16 / sizeof(T)>(p, plan, a, x_tail, c_head, stream);
  }
}

template <typename T, int VEC, class Act>
void backward_impl(const Problem& p, const Plan& plan, const BackwardArgs& a, Stream stream) {
  Tensors<T> t{static_cast<const T*>(a.x), static_cast<const T*>(a.dy), static_cast<T*>(a.dx), make_stats(p, plan)};
  t.s.weight = a.weight;
  t.s.bias = a.bias;
  t.s.mean = a.mean;
  t.s.rstd = a.rstd;
  t.s.part_a = a.part_a;
  t.s.part_b = a.part_b;
  t.s.coef = a.coef;
  t.s.sum_dz = a.sum_dz;
  t.s.sum_dzx = a.sum_dzx;
  launch_partial<T, VEC, GradReducer<Act>>(p, plan, t, stream);
  launch_kernel(finalize_backward_kernel, dim3(grid_x(p.N * p.G)), dim3(kFinalizeThreads), 0,
                stream, t.s);
  launch_elementwise<T, VEC, BackwardOp<Act>>(p, t, stream);
}

template <typename T>
void forward_typed(const Problem& p, const Plan& plan, const ForwardArgs& a, int kind, Stream stream) {
  if (plan.vec == 1) {
    forward_impl<T, 1>(p, plan, a, kind, stream);
  } else {
    forward_impl<T, 16 / sizeof(T)>(p, plan, a, kind, stream);
  }
}

void forward_kind(const Problem& p, const Plan& plan, const ForwardArgs& args, int kind, Stream stream) {
  with_element_type(p.dtype, [&]<typename T>() { forward_typed<T>(p, plan, args, kind, stream); });
}

template <typename T, class Act>
void backward_act(const Problem& p, const Plan& plan, const BackwardArgs& a, Stream stream) {
  if (plan.vec == 1) {
    backward_impl<T, 1, Act>(p, plan, a, stream);
  } else {
    backward_impl<T, 16 / sizeof(T), Act>(p, plan, a, stream);
  }
}

template <typename T>
void backward_typed(const Problem& p, const Plan& plan, const BackwardArgs& a, Stream stream) {
  if (p.silu) {
    backward_act<T, Silu>(p, plan, a, stream);
  } else {
    backward_act<T, Identity>(p, plan, a, stream);
  }
}

}  // namespace

void forward(const Problem& p, const Plan& plan, const ForwardArgs& args, Stream stream) {
  forward_kind(p, plan, args, 0, stream);
}

void statistics(const Problem& p, const Plan& plan, const ForwardArgs& args, Stream stream) {
  forward_kind(p, plan, args, 1, stream);
}

void apply(const Problem& p, const Plan& plan, const ForwardArgs& args, Stream stream) {
  forward_kind(p, plan, args, 2, stream);
}

void statistics_parts(const Problem& p, const Plan& plan, const ForwardArgs& args, const void* x_tail,
                      int64_t c_head, Stream stream) {
  with_element_type(p.dtype, [&]<typename T>() { statistics_parts_typed<T>(p, plan, args, x_tail, c_head, stream); });
}

void apply_parts(const Problem& p, const Plan& plan, const ForwardArgs& args, const void* x_tail, int64_t c_head,
                 Stream stream) {
  with_element_type(p.dtype, [&]<typename T>() { apply_parts_typed<T>(p, plan, args, x_tail, c_head, stream); });
}

void backward(const Problem& p, const Plan& plan, const BackwardArgs& args, Stream stream) {
  with_element_type(p.dtype, [&]<typename T>() { backward_typed<T>(p, plan, args, stream); });
}

}  // namespace ldmopt::group_norm
