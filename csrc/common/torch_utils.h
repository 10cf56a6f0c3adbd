// Host helpers for the torch glue: dtype mapping, argument checks with messages that name the argument, the value
// and what is supported, output allocation (NaN-poisoned under LDMOPT_POISON_OUTPUTS=1, like the Triton path).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "common/types.h"

namespace ldmopt {

inline DType dtype_of(const at::Tensor& t, const char* op, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return DType::kFloat32;
    case at::kHalf:
      return DType::kFloat16;
    case at::kBFloat16:
      return DType::kBFloat16;
    default:
      TORCH_CHECK_TYPE(false, op, ": ", name, " has dtype ", t.scalar_type(),
                       "; supported: Float, Half, BFloat16");
  }
  return DType::kFloat32;
}

inline void check_same_device(const at::Tensor& t, const at::Tensor& like, const char* op, const char* name,
                              const char* like_name) {
  TORCH_CHECK(t.device() == like.device(), op, ": ", name, " is on ", t.device(), " but ", like_name, " is on ",
              like.device(), "; all tensors must be on one device");
}

inline void check_cuda(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.is_cuda(), op, ": ", name, " is on ", t.device(), "; this kernel runs CUDA tensors");
}

inline bool poison_outputs() {
  const char* v = std::getenv("LDMOPT_POISON_OUTPUTS");
  return v != nullptr && std::strcmp(v, "1") == 0;
}

// A freshly allocated output: filled with NaN when LDMOPT_POISON_OUTPUTS=1 so elements a kernel misses show up.
inline at::Tensor new_output(at::Tensor t) {
  if (poison_outputs() && t.is_floating_point()) t.fill_(std::numeric_limits<double>::quiet_NaN());
  return t;
}

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace ldmopt
