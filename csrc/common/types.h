// Torch-free types shared by the kernel launchers (.cu), the torch glue (.cpp) and the CPU emulator tests.
#pragma once

#include <cstdint>

struct CUstream_st;  // the same incomplete type cudaStream_t points to

namespace ldmopt {

using Stream = CUstream_st*;

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// A per-channel parameter vector (weight, bias) in fp32/fp16/bf16, read in its own dtype on the device
// (param_at in compat.cuh); a null pointer means the parameter is absent.
struct AnyVector {
  const void* ptr;
  DType dtype;
};

inline int dtype_bytes(DType d) { return d == DType::kFloat32 ? 4 : 2; }

// Elements per 16-byte packed access.
inline int max_vec(DType d) { return 16 / dtype_bytes(d); }

template <typename T>
constexpr T ceil_div(T a, T b) {
  return (a + b - 1) / b;
}

// A 1-D grid size for dim3: saturates instead of wrapping, so a count past CUDA's grid.x limit (2^31 - 1) makes the
// launch fail with an invalid-configuration error the caller reports, never a smaller grid that silently skips work.
constexpr unsigned grid_x(int64_t blocks) {
  return blocks < 0 ? 0u : (blocks > int64_t{0xFFFFFFFF} ? 0xFFFFFFFFu : static_cast<unsigned>(blocks));
}

}  // namespace ldmopt
