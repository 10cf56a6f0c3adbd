// Device building blocks shared by every kernel: CUDA headers, packed fp32 conversions, reductions, launches.
// nvcc compiles this for the extension; with -DLDMOPT_EMULATE a host C++ compiler compiles the same kernels against
// tests/csrc/cuda_emu.h, which runs each CUDA thread as a fiber so the CPU tests can execute them.
#pragma once

#ifdef LDMOPT_EMULATE
#include "cuda_emu.h"
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#endif

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <stdexcept>
#include <type_traits>
#include <utility>

#include "common/types.h"

#ifdef LDMOPT_EMULATE
#define LDMOPT_DYNAMIC_SMEM(name) unsigned char* name = ::ldmopt_emu::dynamic_smem()
#else
#define LDMOPT_DYNAMIC_SMEM(name) extern __shared__ __align__(128) unsigned char name[]
#endif

namespace ldmopt {

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;

// ------------------------------------------------------------------------------------------ dtype <-> fp32

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v) {
  if constexpr (std::is_same_v<T, __half>) {
    return __float2half_rn(v);
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __float2bfloat16_rn(v);
  } else {
    return v;
  }
}

// VEC elements read or written with one aligned access of VEC * sizeof(T) bytes.
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

// ptr as a Pack pointer. Packed accesses must be aligned to the pack size (a GPU faults otherwise); the emulator
// checks it.
template <typename P, typename T>
__device__ __forceinline__ P* as_pack(T* ptr) {
#ifdef LDMOPT_EMULATE
  ::ldmopt_emu::check_aligned(ptr, alignof(P));
#endif
  return reinterpret_cast<P*>(ptr);
}

// Loads VEC elements at ptr (aligned to the pack size when VEC > 1) and widens them to fp32; 16-bit types are
// converted a __half2 / __nv_bfloat162 pair at a time.
template <typename T, int VEC>
__device__ __forceinline__ void load_float(const T* ptr, float (&out)[VEC]) {
  const Pack<T, VEC> p = *as_pack<const Pack<T, VEC>>(ptr);
  if constexpr (VEC % 2 == 0 && std::is_same_v<T, __half>) {
#pragma unroll
    for (int i = 0; i < VEC; i += 2) {
      const float2 f = __half22float2(__halves2half2(p.v[i], p.v[i + 1]));
      out[i] = f.x;
      out[i + 1] = f.y;
    }
  } else if constexpr (VEC % 2 == 0 && std::is_same_v<T, __nv_bfloat16>) {
#pragma unroll
    for (int i = 0; i < VEC; i += 2) {
      const float2 f = __bfloat1622float2(__halves2bfloat162(p.v[i], p.v[i + 1]));
      out[i] = f.x;
      out[i + 1] = f.y;
    }
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) out[i] = to_float(p.v[i]);
  }
}

template <typename T, int VEC>
__device__ __forceinline__ void store_float(T* ptr, const float (&in)[VEC]) {
  Pack<T, VEC> p;
  if constexpr (VEC % 2 == 0 && std::is_same_v<T, __half>) {
#pragma unroll
    for (int i = 0; i < VEC; i += 2) {
      const __half2 h = __floats2half2_rn(in[i], in[i + 1]);
      p.v[i] = __low2half(h);
      p.v[i + 1] = __high2half(h);
    }
  } else if constexpr (VEC % 2 == 0 && std::is_same_v<T, __nv_bfloat16>) {
#pragma unroll
    for (int i = 0; i < VEC; i += 2) {
      const __nv_bfloat162 h = __floats2bfloat162_rn(in[i], in[i + 1]);
      p.v[i] = __low2bfloat16(h);
      p.v[i + 1] = __high2bfloat16(h);
    }
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) p.v[i] = from_float<T>(in[i]);
  }
  *as_pack<Pack<T, VEC>>(ptr) = p;
}

// Element i of a per-channel parameter in fp32, or `absent` when there is none. The dtype switch is a uniform
// branch: cheaper than a cast kernel on the host, and no extra template axis.
__device__ __forceinline__ float param_at(const AnyVector& v, int64_t i, float absent) {
  if (v.ptr == nullptr) return absent;
  switch (v.dtype) {
    case DType::kFloat16:
      return to_float(static_cast<const __half*>(v.ptr)[i]);
    case DType::kBFloat16:
      return to_float(static_cast<const __nv_bfloat16*>(v.ptr)[i]);
    default:
      return static_cast<const float*>(v.ptr)[i];
  }
}

// ------------------------------------------------------------------------------------------ reductions

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int m = kWarpSize / 2; m > 0; m >>= 1) v += __shfl_xor_sync(kFullMask, v, m);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int m = kWarpSize / 2; m > 0; m >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, m));
  return v;
}

// Sum over the block, returned to every thread. Deterministic (fixed tree); `scratch` holds one float per warp and
// may be reused by the next call (the trailing barrier protects it). blockDim.x must be a multiple of 32.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int n_warps = blockDim.x / kWarpSize;
  v = warp_sum(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < n_warps; ++w) total += scratch[w];
  __syncthreads();
  return total;
}

// Welford / Chan running statistics: count, mean, sum of squared deviations.
struct Welford {
  float count = 0.0f;
  float mean = 0.0f;
  float m2 = 0.0f;

  __device__ __forceinline__ void add(float x) {
    count += 1.0f;
    const float d = x - mean;
    mean += __fdividef(d, count);
    m2 += d * (x - mean);
  }

  __device__ __forceinline__ void merge(const Welford& o) {
    const float n = count + o.count;
    if (o.count == 0.0f) return;
    const float d = o.mean - mean;
    const float f = __fdividef(o.count, n);
    mean += d * f;
    // An empty side takes o as it is: d * d * 0 would be NaN where d * d overflows (|mean| > ~1.8e19)
    m2 += o.m2 + (count == 0.0f ? 0.0f : d * d * count * f);
    count = n;
  }

  __device__ __forceinline__ Welford shfl_xor(int m) const {
    Welford o;
    o.count = __shfl_xor_sync(kFullMask, count, m);
    o.mean = __shfl_xor_sync(kFullMask, mean, m);
    o.m2 = __shfl_xor_sync(kFullMask, m2, m);
    return o;
  }
};

// ------------------------------------------------------------------------------------------ activations

struct Identity {
  __device__ __forceinline__ static float fwd(float z) { return z; }
  __device__ __forceinline__ static float grad(float /*z*/, float dy) { return dy; }
};

struct Silu {
  __device__ __forceinline__ static float sigmoid(float z) { return 1.0f / (1.0f + __expf(-z)); }
  __device__ __forceinline__ static float fwd(float z) { return z * sigmoid(z); }
  // d/dz z*s(z) = s(z) * (1 + z * (1 - s(z))), evaluated at the affine-transformed value z.
  __device__ __forceinline__ static float grad(float z, float dy) {
    const float s = sigmoid(z);
    return dy * s * (1.0f + z * (1.0f - s));
  }
};

// The GELUs of the linear epilogue (forward only): erf's exact form (diffusers' GELU, GEGLU) and the tanh
// approximation (GELU(approximate="tanh"): DiT, PixArt, SD3, Flux feed-forwards).
struct GeluErf {
  __device__ __forceinline__ static float fwd(float z) { return 0.5f * z * (1.0f + erff(z * 0.70710678118654752f)); }
};

struct GeluTanh {
  // tanh through exp, as the Triton kernels: under --use_fast_math tanhf becomes tanh.approx.f32 (relative error
  // ~5e-4, visible in fp32 outputs); exp(-2|u|) only underflows to 0, so large |u| stay exact.
  __device__ __forceinline__ static float fwd(float z) {
    const float u = 0.79788456080286536f * (z + 0.044715f * z * z * z);
    const float e = __expf(-2.0f * fabsf(u));
    const float t = (1.0f - e) / (1.0f + e);
    return 0.5f * z * (1.0f + (u >= 0.0f ? t : -t));
  }
};

// ------------------------------------------------------------------------------------------ launches

#ifndef LDMOPT_EMULATE
// The dynamic shared memory each (kernel, device) has been allowed so far. Keyed by the kernel itself: kernels with
// one parameter list share a launch_kernel instantiation, while the attribute belongs to each kernel.
inline std::mutex& smem_limits_mutex() {
  static std::mutex mutex;
  return mutex;
}
inline std::map<std::pair<const void*, int>, size_t>& smem_limits() {
  static std::map<std::pair<const void*, int>, size_t> limits;
  return limits;
}

// Launches kernel on stream. A kernel with dynamic shared memory gets its limit raised to `smem` first: the 48 KB
// default also counts the kernel's static shared memory, so a budget just under 48 KB could otherwise fail. The
// attribute is per (kernel, device) and only ever raised, so it is set once per new high-water mark rather than on
// every launch (a driver call of a few microseconds); a failed raise is not recorded and surfaces at the launch.
template <typename... KArgs, typename... Args>
inline void launch_kernel(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, Stream stream,
                          Args&&... args) {
  if (smem > 0) {
    const void* function = reinterpret_cast<const void*>(kernel);
    int device = 0;
    const bool known = cudaGetDevice(&device) == cudaSuccess;
    std::lock_guard<std::mutex> lock(smem_limits_mutex());
    size_t& raised = smem_limits()[{function, known ? device : -1}];
    if (!known || smem > raised) {
      const cudaError_t status =
          cudaFuncSetAttribute(function, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
      if (known && status == cudaSuccess) raised = smem;
    }
  }
  kernel<<<grid, block, smem, reinterpret_cast<cudaStream_t>(stream)>>>(static_cast<KArgs>(args)...);
}
#else
using ::ldmopt_emu::launch_kernel;
#endif

// Calls `launch.template operator()<T>()` with T the element type of `dtype` (float, __half, __nv_bfloat16): the one
// switch every launcher's dtype dispatch goes through, as `with_element_type(p.dtype, [&]<typename T>() { ... });`.
template <class F>
void with_element_type(DType dtype, F&& launch) {
  switch (dtype) {
    case DType::kFloat32:
      return launch.template operator()<float>();
    case DType::kFloat16:
      return launch.template operator()<__half>();
    case DType::kBFloat16:
      return launch.template operator()<__nv_bfloat16>();
  }
  throw std::invalid_argument("ldmopt: a DType value that is none of fp32, fp16, bf16");  // never launch nothing
}

}  // namespace ldmopt
