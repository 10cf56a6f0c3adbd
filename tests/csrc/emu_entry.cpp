// C entry points over the kernel launchers, compiled with -DLDMOPT_EMULATE against cuda_emu.h so the tests can run
// the CUDA kernels on CPU tensors through ctypes. Scratch buffers are allocated here as the torch glue would.
#include <exception>
#include <string>
#include <vector>

#include "adaln_modulate/adaln_modulate_kernels.cu"
#include "adaln_modulate/launch.h"
#include "conv_epilogue/conv_epilogue_kernels.cu"
#include "conv_epilogue/launch.h"
#include "group_norm/group_norm_kernels.cu"
#include "group_norm/launch.h"
#include "group_norm_sums/group_norm_sums_kernels.cu"
#include "group_norm_sums/launch.h"
#include "layer_norm/launch.h"
#include "layer_norm/layer_norm_kernels.cu"
#include "linear_epilogue/launch.h"
#include "linear_epilogue/linear_epilogue_kernels.cu"
#include "temporal_attention/launch.h"
#include "temporal_attention/temporal_attention_kernels.cu"

namespace {

thread_local std::string last_error;

template <typename F>
int guarded(F&& f) {
  try {
    f();
    return 0;
  } catch (const std::exception& e) {
    last_error = e.what();
    return 1;
  }
}

ldmopt::group_norm::Problem gn_problem(const int64_t* dims, int channels_last, int dtype, int silu) {
  return {dims[0], dims[1], dims[2], dims[3], channels_last != 0, static_cast<ldmopt::DType>(dtype), silu != 0};
}

ldmopt::AnyVector param(const void* p, int dtype) { return {p, static_cast<ldmopt::DType>(dtype)}; }

// What the GroupNorm apply passes read: given statistics, no partials; coef is the caller's scratch.
ldmopt::group_norm::ForwardArgs apply_args(const void* x, void* y, const void* weight, const void* bias,
                                           const int* affine_dtypes, const float* mean, const float* rstd,
                                           float* coef) {
  return {x,
          y,
          param(weight, affine_dtypes[0]),
          param(bias, affine_dtypes[1]),
          const_cast<float*>(mean),
          const_cast<float*>(rstd),
          nullptr,
          nullptr,
          coef,
          0.0f};
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

void write_plan(const ldmopt::group_norm::Plan& plan, int64_t* out) {
  out[0] = plan.vec;
  out[1] = plan.s_per_chunk;
  out[2] = plan.n_chunks;
  out[3] = plan.tc;
  out[4] = plan.n_cblocks;
}

void write_plan(const ldmopt::temporal_attention::Plan& plan, int64_t* out) {
  out[0] = plan.f_pad;
  out[1] = plan.d_pad;
  out[2] = plan.per_block;
  out[3] = plan.smem_bytes;
  out[4] = plan.blocks;
  out[5] = ldmopt::temporal_attention::kStaticSmemBytes;
}

// The statistics passes' arguments (no output, no affine) with poisoned scratch, handed to ``launch``.
template <class Launch>
void run_statistics(const ldmopt::group_norm::Problem& p, const ldmopt::group_norm::Plan& plan, const void* x,
                    float* mean, float* rstd, float eps, Launch launch) {
  const int64_t n_part = ldmopt::group_norm::partial_floats(p, plan);
  std::vector<float> part_a(n_part, -1e30f), part_b(n_part, -1e30f), coef(p.N * p.C * 2, -1e30f);
  const ldmopt::group_norm::ForwardArgs args{
      x, nullptr, param(nullptr, 0), param(nullptr, 0), mean, rstd, part_a.data(), part_b.data(), coef.data(), eps};
  launch(args);
}

}  // namespace

extern "C" {

const char* emu_last_error() { return last_error.c_str(); }

// The launchers' 1-D grid size (saturating, never wrapping).
unsigned emu_grid_x(int64_t blocks) { return ldmopt::grid_x(blocks); }

// 0: threads of a block run first-to-last between barriers; 1: last-to-first.
void emu_set_reverse_schedule(int reverse) { ldmopt_emu::state().reverse = reverse != 0; }

// dims: N, C, S, G; affine_dtypes: weight's and bias's dtype codes. Pointer alignment decides the packed path, as
// in the torch glue. plan_out: vec, s_per_chunk, n_chunks, tc, n_cblocks.
int emu_group_norm_forward(const int64_t* dims, int channels_last, int dtype, int silu, const void* x, void* y,
                           const void* weight, const void* bias, const int* affine_dtypes, float* mean, float* rstd,
                           float eps, int64_t* plan_out) {
  return guarded([&] {
    const auto p = gn_problem(dims, channels_last, dtype, silu);
    const auto plan = ldmopt::group_norm::make_plan(p, aligned16(x) && aligned16(y));
    write_plan(plan, plan_out);
    const int64_t n_part = ldmopt::group_norm::partial_floats(p, plan);
    std::vector<float> part_a(n_part, -1e30f), part_b(n_part, -1e30f), coef(p.N * p.C * 2, -1e30f);
    const ldmopt::group_norm::ForwardArgs args{x,
                                               y,
                                               param(weight, affine_dtypes[0]),
                                               param(bias, affine_dtypes[1]),
                                               mean,
                                               rstd,
                                               part_a.data(),
                                               part_b.data(),
                                               coef.data(),
                                               eps};
    ldmopt::group_norm::forward(p, plan, args, nullptr);
  });
}

// The forward's statistics passes alone (group_norm_stats_cuda): mean, rstd [N, G].
int emu_group_norm_statistics(const int64_t* dims, int channels_last, int dtype, const void* x, float* mean,
                              float* rstd, float eps, int64_t* plan_out) {
  return guarded([&] {
    const auto p = gn_problem(dims, channels_last, dtype, 0);
    const auto plan = ldmopt::group_norm::make_plan(p, aligned16(x));
    write_plan(plan, plan_out);
    run_statistics(p, plan, x, mean, rstd, eps, [&](const auto& args) {
      ldmopt::group_norm::statistics(p, plan, args, nullptr);
    });
  });
}

// The statistics over two channels-last parts (group_norm_stats_cuda with x_tail): dims = {N, C (both parts), S, G},
// x the head [N, S, c_head], x_tail [N, S, C - c_head]; the plan as the torch glue makes it (make_parts_plan).
int emu_group_norm_statistics_parts(const int64_t* dims, int64_t c_head, int dtype, const void* x, const void* x_tail,
                                    float* mean, float* rstd, float eps, int64_t* plan_out) {
  return guarded([&] {
    const auto p = gn_problem(dims, 1, dtype, 0);
    const auto plan = ldmopt::group_norm::make_parts_plan(p, aligned16(x) && aligned16(x_tail), c_head);
    write_plan(plan, plan_out);
    run_statistics(p, plan, x, mean, rstd, eps, [&](const auto& args) {
      ldmopt::group_norm::statistics_parts(p, plan, args, x_tail, c_head, nullptr);
    });
  });
}

// The forward's elementwise pass from given statistics (group_norm_apply_cuda).
int emu_group_norm_apply(const int64_t* dims, int channels_last, int dtype, int silu, const void* x, void* y,
                         const void* weight, const void* bias, const int* affine_dtypes, const float* mean,
                         const float* rstd, int64_t* plan_out) {
  return guarded([&] {
    const auto p = gn_problem(dims, channels_last, dtype, silu);
    const auto plan = ldmopt::group_norm::make_plan(p, aligned16(x) && aligned16(y));
    write_plan(plan, plan_out);
    std::vector<float> coef(p.N * p.C * 2, -1e30f);
    const auto args = apply_args(x, y, weight, bias, affine_dtypes, mean, rstd, coef.data());
    ldmopt::group_norm::apply(p, plan, args, nullptr);
  });
}

// dims = {N, C (both parts), S, G}; x the head [N, S, c_head], x_tail [N, S, C - c_head], y [N, S, C] channels-last.
// The plan as the torch glue makes it (make_parts_plan).
int emu_group_norm_apply_parts(const int64_t* dims, int64_t c_head, int dtype, int silu, const void* x,
                               const void* x_tail, void* y, const void* weight, const void* bias,
                               const int* affine_dtypes, const float* mean, const float* rstd, int64_t* plan_out) {
  return guarded([&] {
    const auto p = gn_problem(dims, 1, dtype, silu);
    const bool aligned = aligned16(x) && aligned16(x_tail) && aligned16(y);
    const auto plan = ldmopt::group_norm::make_parts_plan(p, aligned, c_head);
    write_plan(plan, plan_out);
    std::vector<float> coef(p.N * p.C * 2, -1e30f);
    const auto args = apply_args(x, y, weight, bias, affine_dtypes, mean, rstd, coef.data());
    ldmopt::group_norm::apply_parts(p, plan, args, x_tail, c_head, nullptr);
  });
}

int emu_group_norm_backward(const int64_t* dims, int channels_last, int dtype, int silu, const void* dy,
                            const void* x, void* dx, const void* weight, const void* bias, const int* affine_dtypes,
                            const float* mean, const float* rstd, float* sum_dz, float* sum_dzx, int64_t* plan_out) {
  return guarded([&] {
    const auto p = gn_problem(dims, channels_last, dtype, silu);
    const auto plan = ldmopt::group_norm::make_plan(p, aligned16(x) && aligned16(dy) && aligned16(dx));
    write_plan(plan, plan_out);
    const int64_t n_part = ldmopt::group_norm::partial_floats(p, plan);
    std::vector<float> part_a(n_part, -1e30f), part_b(n_part, -1e30f), coef(p.N * p.C * 4, -1e30f);
    const ldmopt::group_norm::BackwardArgs args{dy,
                                                x,
                                                dx,
                                                param(weight, affine_dtypes[0]),
                                                param(bias, affine_dtypes[1]),
                                                mean,
                                                rstd,
                                                part_a.data(),
                                                part_b.data(),
                                                coef.data(),
                                                sum_dz,
                                                sum_dzx};
    ldmopt::group_norm::backward(p, plan, args, nullptr);
  });
}

// dims: M, C, row stride (elements). plan_out: vec.
int emu_layer_norm_statistics(const int64_t* dims, int dtype, const void* x, float* stats, float eps,
                              int64_t* plan_out) {
  return guarded([&] {
    const ldmopt::layer_norm::Problem p{dims[0], dims[1], dims[2], static_cast<ldmopt::DType>(dtype)};
    const auto plan = ldmopt::layer_norm::make_plan(p, aligned16(x));
    plan_out[0] = plan.vec;
    ldmopt::layer_norm::row_statistics(p, plan, x, stats, eps, nullptr);
  });
}

// dims: M, C, row stride, P, position row stride, position rows (elements). affine_dtypes: weight's, bias's. plan_out:
// vec.
int emu_layer_norm_apply(const int64_t* dims, int dtype, const void* x, const float* stats, const void* weight,
                         const void* bias, const int* affine_dtypes, const void* positions, void* h,
                         int64_t* plan_out) {
  return guarded([&] {
    namespace ln = ldmopt::layer_norm;
    const ln::ApplyProblem p{dims[0], dims[1], dims[2], dims[3], dims[4], dims[5], static_cast<ldmopt::DType>(dtype)};
    const ln::ApplyArgs args{x, stats, param(weight, affine_dtypes[0]), param(bias, affine_dtypes[1]), positions, h};
    const auto plan = ln::make_apply_plan(
        p, aligned16(x) && aligned16(h) && (positions == nullptr || aligned16(positions)));
    plan_out[0] = plan.vec;
    ln::apply(p, plan, args, nullptr);
  });
}

// dims: M, N, z row stride, y row stride, gate row stride, tokens per gate, residual sample stride, residual row
// stride, residual rows. flags: activation, glu, saturate, write. plan_out: vec.
int emu_linear_epilogue(const int64_t* dims, int dtype, const int* flags, float sat_max, float eps, const void* z,
                        void* y, const void* gate, const void* residual, float* stats, int64_t* plan_out) {
  return guarded([&] {
    namespace le = ldmopt::linear_epilogue;
    const le::Problem p{dims[0], dims[1], dims[2], dims[3], dims[4], dims[5], dims[6], dims[7], dims[8],
                        static_cast<ldmopt::DType>(dtype), static_cast<le::Activation>(flags[0]), flags[1] != 0,
                        flags[2] != 0, flags[3] != 0, sat_max, eps};
    const le::Args args{z, y, gate, residual, stats};
    const bool aligned = aligned16(z) && (y == nullptr || aligned16(y)) && (gate == nullptr || aligned16(gate)) &&
                         (residual == nullptr || aligned16(residual));
    const auto plan = le::make_plan(p, aligned);
    plan_out[0] = plan.vec;
    le::run(p, plan, args, nullptr);
  });
}

// dims: M, C, tokens, x row stride, residual row stride. flags: has_residual, has_gate, store_sum, save.
// params: scale, shift, gate pointers; param_dtypes and param_row_bytes likewise.
int emu_adaln_modulate(const int64_t* dims, int dtype, const int* flags, float eps, const void* x,
                       const void* residual, const void* const* params, const int* param_dtypes,
                       const int64_t* param_row_bytes, void* y, void* s, float* mean, float* rstd,
                       int64_t* plan_out) {
  return guarded([&] {
    namespace am = ldmopt::adaln_modulate;
    const am::Problem p{dims[0], dims[1], dims[2], dims[3], dims[4], static_cast<ldmopt::DType>(dtype),
                        flags[0] != 0, flags[1] != 0, flags[2] != 0, flags[3] != 0, eps};
    am::SampleRows rows[3];
    for (int i = 0; i < 3; ++i) rows[i] = {params[i], static_cast<ldmopt::DType>(param_dtypes[i]), param_row_bytes[i]};
    const am::Args args{x, residual, rows[0], rows[1], rows[2], y, s, mean, rstd};
    const bool aligned = aligned16(x) && aligned16(y) && (residual == nullptr || aligned16(residual)) &&
                         (s == nullptr || aligned16(s));
    const auto plan = am::make_plan(p, aligned);
    plan_out[0] = plan.vec;
    am::forward(p, plan, args, nullptr);
  });
}

// dims: N, S, C, groups, W (OW). strides: z, shortcut, residual (image, pixel each), temb (image, row), gate (image,
// row). flags: write, channel_sums, packable. plan_out: vec, channel tiles, chunks, chunk pixels.
int emu_conv_epilogue(const int64_t* dims, int dtype, const int64_t* strides, const int* flags, float inv_scale,
                      float eps, void* z, const void* shortcut, const void* residual, const void* temb,
                      const float* gate, float* mean, float* rstd, double* sums, int64_t* plan_out) {
  return guarded([&] {
    namespace ce = ldmopt::conv_epilogue;
    const ce::Problem p{dims[0], dims[1], dims[2], static_cast<ldmopt::DType>(dtype), flags[0] != 0, inv_scale,
                        dims[3], flags[1] != 0, eps, dims[4]};
    const ce::Plan plan = ce::make_plan(p, flags[2] != 0);
    std::vector<float> partials(static_cast<size_t>(plan.workspace_floats));
    const ce::Args args{z,    strides[0], strides[1], {shortcut, strides[2], strides[3]},
                        {residual, strides[4], strides[5]}, temb, strides[6], strides[7], gate, strides[8],
                        strides[9], mean, rstd, sums, partials.data()};
    plan_out[0] = plan.vec;
    plan_out[1] = plan.channel_tiles;
    plan_out[2] = plan.chunks;
    plan_out[3] = plan.chunk_pixels;
    ce::run(p, plan, args, nullptr);
  });
}

// dims: N, C_head, C, G, frames, count. tail: the tail's sums, or null.
int emu_group_norm_stats_from_sums(const int64_t* dims, float eps, const double* sums, const double* tail,
                                   float* mean, float* rstd) {
  return guarded([&] {
    const ldmopt::group_norm_sums::Problem p{dims[0], dims[1], dims[2], dims[3], dims[4], dims[5], eps};
    ldmopt::group_norm_sums::statistics(p, sums, tail == nullptr ? sums : tail, mean, rstd, nullptr);
  });
}

// dims: B, F, N, H, D. plan_out: f_pad, d_pad, per_block, smem_bytes, blocks of make_plan and the kernel's static
// shared memory; nothing launched.
int emu_temporal_attention_plan(const int64_t* dims, int dtype, int64_t* plan_out) {
  return guarded([&] {
    namespace ta = ldmopt::temporal_attention;
    const ta::Problem p{dims[0], dims[1], dims[2], dims[3], dims[4], static_cast<ldmopt::DType>(dtype), 1.0f};
    write_plan(ta::make_plan(p), plan_out);
  });
}

// dims: B, F, N, H, D; strides: 4 x 5 elements (q, k, v, out). plan_out: as emu_temporal_attention_plan
int emu_temporal_attention_forward(const int64_t* dims, int dtype, float scale, const void* q, const void* k,
                                   const void* v, void* out, const int64_t* strides, int64_t* plan_out) {
  return guarded([&] {
    namespace ta = ldmopt::temporal_attention;
    const ta::Problem p{dims[0], dims[1], dims[2], dims[3], dims[4], static_cast<ldmopt::DType>(dtype), scale};
    const ta::Plan plan = ta::make_plan(p);
    ta::View views[3] = {{q, {}}, {k, {}}, {v, {}}};
    ta::OutView o{out, {}};
    for (int i = 0; i < 5; ++i) {
      for (int t = 0; t < 3; ++t) views[t].stride[i] = strides[t * 5 + i];
      o.stride[i] = strides[15 + i];
    }
    write_plan(plan, plan_out);
    ta::forward(p, plan, views[0], views[1], views[2], o, nullptr);
  });
}

}  // extern "C"
