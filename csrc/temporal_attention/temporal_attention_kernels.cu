// Temporal attention forward: softmax(Q K^T * scale) V over the frame axis of strided (B, F, N, H, D) views.
// fp16/bf16 multiply on tensor cores (WMMA 16x16x16, fp32 accumulate); fp32 uses exact FMA tiles. Scores and softmax
// in fp32; P is rounded to the input dtype before P V (as the Triton kernel does). Offsets in int64.
#include "common/compat.cuh"
#include "temporal_attention/launch.h"

#ifndef LDMOPT_EMULATE
#include <mma.h>
#endif

namespace ldmopt::temporal_attention {
namespace {

constexpr int kTile = 16;
constexpr int kWarps = kThreads / kWarpSize;

template <typename T>
struct Params {
  const T* q;
  const T* k;
  const T* v;
  T* out;
  int64_t sq[5], sk[5], sv[5], so[5];
  int64_t n_seq, N, H;
  int F, D, f_pad, d_pad, ld_qkv, ld_s, ld_p, ld_o, per_block;
  float qk_scale_log2;  // scale * log2(e): the softmax uses exp2
  bool pack_q, pack_k, pack_v, pack_o;
};

// out (16 x 16, fp32, pitch ldo) = A (16 x k_len, pitch lda) times B, where B is k_len x 16 read as rows of b
// (B_TRANSPOSED: b holds 16 rows of length k_len, i.e. K for Q K^T) or as k_len rows of 16 (V for P V).
// Executed by one whole warp.
template <typename T, bool B_TRANSPOSED>
__device__ __forceinline__ void tile_product(float* out, int ldo, const T* a, int lda, const T* b, int ldb,
                                             int k_len) {
  if constexpr (std::is_same_v<T, float>) {
    // Lane owns row lane / 2 and 8 columns; exact fp32 FMAs like the IEEE-precision Triton path.
    const int lane = threadIdx.x % kWarpSize;
    const int r = lane >> 1;
    const int c0 = (lane & 1) * 8;
    float acc[8] = {};
    for (int kk = 0; kk < k_len; ++kk) {
      const float av = a[r * lda + kk];
#pragma unroll
      for (int c = 0; c < 8; ++c) {
        acc[c] = fmaf(av, B_TRANSPOSED ? b[(c0 + c) * ldb + kk] : b[kk * ldb + c0 + c], acc[c]);
      }
    }
#pragma unroll
    for (int c = 0; c < 8; ++c) out[r * ldo + c0 + c] = acc[c];
  } else {
    namespace wmma = nvcuda::wmma;
    using BLayout = std::conditional_t<B_TRANSPOSED, wmma::col_major, wmma::row_major>;
    wmma::fragment<wmma::accumulator, kTile, kTile, kTile, float> acc;
    wmma::fragment<wmma::matrix_a, kTile, kTile, kTile, T, wmma::row_major> fa;
    wmma::fragment<wmma::matrix_b, kTile, kTile, kTile, T, BLayout> fb;
    wmma::fill_fragment(acc, 0.0f);
    for (int kk = 0; kk < k_len; kk += kTile) {
      wmma::load_matrix_sync(fa, a + kk, lda);
      wmma::load_matrix_sync(fb, B_TRANSPOSED ? b + kk : b + kk * ldb, ldb);
      wmma::mma_sync(acc, fa, fb, acc);
    }
    wmma::store_matrix_sync(out, acc, ldo, wmma::mem_row_major);
  }
}

// Copies rows f < F, columns d < D of the block's sequences into dst [per_block][f_pad][ld_qkv], zero elsewhere
// (padding must be 0, not garbage: 0 * NaN would poison P V). Consecutive threads walk d, then the sequence
// (neighbouring heads, adjacent in memory), then f.
template <typename T, int VEC>
__device__ __forceinline__ void stage(T* dst, const T* src, const int64_t* stride, const int64_t* base, bool packed,
                                      const Params<T>& p, int64_t seq0) {
  const int packs_per_row = p.d_pad / VEC;
  const int total = p.per_block * p.f_pad * packs_per_row;
  for (int idx = threadIdx.x; idx < total; idx += blockDim.x) {
    const int dp = idx % packs_per_row;
    const int rest = idx / packs_per_row;
    const int sb = rest % p.per_block;
    const int f = rest / p.per_block;
    const int d0 = dp * VEC;
    T* d = dst + (sb * p.f_pad + f) * p.ld_qkv + d0;
    const bool valid = seq0 + sb < p.n_seq && f < p.F && d0 < p.D;
    const T* row = src + base[sb] + f * stride[1];
    if (valid && packed) {
      *as_pack<Pack<T, VEC>>(d) = *as_pack<const Pack<T, VEC>>(row + d0);
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        d[j] = (valid && d0 + j < p.D) ? row[(d0 + j) * stride[4]] : from_float<T>(0.0f);
      }
    }
  }
}

template <typename T>
__global__ __launch_bounds__(kThreads) void forward_kernel(Params<T> p) {
  constexpr int VEC = 16 / sizeof(T);
  LDMOPT_DYNAMIC_SMEM(smem);
  __shared__ int64_t base[4][kMaxPerBlock];  // q, k, v, out offsets of each sequence
  static_assert(sizeof(base) == kStaticSmemBytes, "launch.h's kStaticSmemBytes must count this array");
  const int tid = threadIdx.x;
  const int warp = tid / kWarpSize;
  const int64_t seq0 = int64_t{blockIdx.x} * p.per_block;
  const int rows = p.per_block * p.f_pad;
  T* qs = reinterpret_cast<T*>(smem);
  T* ks = qs + rows * p.ld_qkv;
  T* vs = ks + rows * p.ld_qkv;
  float* ss = reinterpret_cast<float*>(vs + rows * p.ld_qkv);
  T* ps = std::is_same_v<T, float> ? reinterpret_cast<T*>(ss) : reinterpret_cast<T*>(ss + rows * p.ld_s);
  float* os = reinterpret_cast<float*>(smem);  // reuses Q and K once the scores exist

  if (tid < p.per_block) {
    const int64_t seq = std::min(seq0 + tid, p.n_seq - 1);  // clamped: rows of missing sequences are never read
    const int64_t h = seq % p.H;
    const int64_t n = (seq / p.H) % p.N;
    const int64_t b = seq / (p.H * p.N);
    base[0][tid] = b * p.sq[0] + n * p.sq[2] + h * p.sq[3];
    base[1][tid] = b * p.sk[0] + n * p.sk[2] + h * p.sk[3];
    base[2][tid] = b * p.sv[0] + n * p.sv[2] + h * p.sv[3];
    base[3][tid] = b * p.so[0] + n * p.so[2] + h * p.so[3];
  }
  __syncthreads();
  stage<T, VEC>(qs, p.q, p.sq, base[0], p.pack_q, p, seq0);
  stage<T, VEC>(ks, p.k, p.sk, base[1], p.pack_k, p, seq0);
  stage<T, VEC>(vs, p.v, p.sv, base[2], p.pack_v, p, seq0);
  __syncthreads();

  // S = Q K^T, one 16 x 16 tile per warp at a time.
  const int nf = p.f_pad / kTile;
  for (int t = warp; t < p.per_block * nf * nf; t += kWarps) {
    const int sb = t / (nf * nf);
    const int i = (t / nf) % nf;
    const int j = t % nf;
    tile_product<T, true>(ss + (sb * p.f_pad + i * kTile) * p.ld_s + j * kTile, p.ld_s,
                          qs + (sb * p.f_pad + i * kTile) * p.ld_qkv, p.ld_qkv,
                          ks + (sb * p.f_pad + j * kTile) * p.ld_qkv, p.ld_qkv, p.d_pad);
  }
  __syncthreads();

  // Softmax of each row in fp32 (the whole row, no online rescaling; --use_fast_math makes exp2f the hardware's
  // ex2.approx, ~2 ulp, as FlashAttention uses), one thread per row; padded keys and padded query rows get P = 0.
  for (int r = tid; r < rows; r += blockDim.x) {
    const float* srow = ss + r * p.ld_s;
    T* prow = ps + r * p.ld_p;
    const int valid = (r % p.f_pad) < p.F ? p.F : 0;
    if (valid) {
      float m = -INFINITY;
      for (int j = 0; j < valid; ++j) m = fmaxf(m, srow[j] * p.qk_scale_log2);
      float sum = 0.0f;
      for (int j = 0; j < valid; ++j) sum += exp2f(srow[j] * p.qk_scale_log2 - m);
      const float inv = 1.0f / sum;
      // In place for fp32 (prow == srow): each element is read before it is overwritten.
      for (int j = 0; j < valid; ++j) prow[j] = from_float<T>(exp2f(srow[j] * p.qk_scale_log2 - m) * inv);
    }
    for (int j = valid; j < p.f_pad; ++j) prow[j] = from_float<T>(0.0f);
  }
  __syncthreads();

  // O = P V into fp32 tiles over the freed Q/K space.
  const int nd = p.d_pad / kTile;
  for (int t = warp; t < p.per_block * nf * nd; t += kWarps) {
    const int sb = t / (nf * nd);
    const int i = (t / nd) % nf;
    const int dt = t % nd;
    tile_product<T, false>(os + (sb * p.f_pad + i * kTile) * p.ld_o + dt * kTile, p.ld_o,
                           ps + (sb * p.f_pad + i * kTile) * p.ld_p, p.ld_p, vs + sb * p.f_pad * p.ld_qkv + dt * kTile,
                           p.ld_qkv, p.f_pad);
  }
  __syncthreads();

  // Write rows f < F, columns d < D in the output dtype.
  const int packs_per_row = p.d_pad / VEC;
  for (int idx = tid; idx < rows * packs_per_row; idx += blockDim.x) {
    const int dp = idx % packs_per_row;
    const int rest = idx / packs_per_row;
    const int sb = rest % p.per_block;
    const int f = rest / p.per_block;
    const int d0 = dp * VEC;
    if (seq0 + sb >= p.n_seq || f >= p.F || d0 >= p.D) continue;
    const float* orow = os + (sb * p.f_pad + f) * p.ld_o + d0;
    T* dst = p.out + base[3][sb] + f * p.so[1];
    if (p.pack_o) {
      float vals[VEC];
#pragma unroll
      for (int j = 0; j < VEC; ++j) vals[j] = orow[j];
      store_float<T, VEC>(dst + d0, vals);
    } else {
      for (int j = 0; j < VEC && d0 + j < p.D; ++j) dst[(d0 + j) * p.so[4]] = from_float<T>(orow[j]);
    }
  }
}

template <typename T>
void forward_typed(const Problem& pr, const Plan& plan, const View& q, const View& k, const View& v,
                   const OutView& out, Stream stream) {
  Params<T> p{};
  p.q = static_cast<const T*>(q.ptr);
  p.k = static_cast<const T*>(k.ptr);
  p.v = static_cast<const T*>(v.ptr);
  p.out = static_cast<T*>(out.ptr);
  for (int i = 0; i < 5; ++i) {
    p.sq[i] = q.stride[i];
    p.sk[i] = k.stride[i];
    p.sv[i] = v.stride[i];
    p.so[i] = out.stride[i];
  }
  p.n_seq = pr.B * pr.N * pr.H;
  p.N = pr.N;
  p.H = pr.H;
  p.F = static_cast<int>(pr.F);
  p.D = static_cast<int>(pr.D);
  p.f_pad = plan.f_pad;
  p.d_pad = plan.d_pad;
  p.ld_qkv = plan.ld_qkv;
  p.ld_s = plan.ld_s;
  p.ld_p = plan.ld_p;
  p.ld_o = plan.ld_o;
  p.per_block = plan.per_block;
  p.qk_scale_log2 = pr.scale * 1.4426950408889634f;
  p.pack_q = packable(q, pr);
  p.pack_k = packable(k, pr);
  p.pack_v = packable(v, pr);
  p.pack_o = packable(out, pr);
  launch_kernel(forward_kernel<T>, dim3(grid_x(plan.blocks)), dim3(kThreads),
                static_cast<size_t>(plan.smem_bytes), stream, p);
}

}  // namespace

void forward(const Problem& p, const Plan& plan, const View& q, const View& k, const View& v, const OutView& out,
             Stream stream) {
  with_element_type(p.dtype, [&]<typename T>() { forward_typed<T>(p, plan, q, k, v, out, stream); });
}

}  // namespace ldmopt::temporal_attention
