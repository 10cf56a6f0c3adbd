// Schemas of every ldmopt._C op and their CUDA and Meta implementations; the Python module ldmopt._C itself.
// The ops are the `cuda` backend of the custom ops in ldmopt/ops/ (same argument conventions as the Triton
// launchers); the Meta implementations run the same argument checks, so the checks are testable without a GPU.
#include <Python.h>
#include <torch/library.h>

#include "adaln_modulate/adaln_modulate.h"
#include "conv_epilogue/conv_epilogue.h"
#include "group_norm/group_norm.h"
#include "group_norm_sums/group_norm_sums.h"
#include "layer_norm/layer_norm.h"
#include "linear_epilogue/linear_epilogue.h"
#include "temporal_attention/temporal_attention.h"

TORCH_LIBRARY_FRAGMENT(ldmopt, m) {
  m.def(
      "group_norm_fwd_cuda(Tensor x, Tensor? weight, Tensor? bias, int num_groups, float eps, str activation) "
      "-> (Tensor y, Tensor mean, Tensor rstd)");
  m.def(
      "group_norm_bwd_cuda(Tensor dy, Tensor x, Tensor? weight, Tensor? bias, Tensor mean, Tensor rstd, "
      "int num_groups, str activation) -> (Tensor dx, Tensor dweight, Tensor dbias)");
  m.def(
      "group_norm_stats_cuda(Tensor x, int num_groups, float eps, Tensor? x_tail=None) -> (Tensor mean, Tensor "
      "rstd)");
  m.def(
      "group_norm_apply_cuda(Tensor x, Tensor mean, Tensor rstd, Tensor? weight, Tensor? bias, int num_groups, "
      "str activation, Tensor? x_tail=None) -> Tensor y");
  m.def(
      "group_norm_stats_from_sums_cuda(Tensor sums, Tensor? sums_tail, int num_groups, float eps, int count, "
      "int frames) -> (Tensor mean, Tensor rstd)");
  m.def("layer_norm_stats_cuda(Tensor x, float eps) -> Tensor stats");
  m.def(
      "layer_norm_apply_cuda(Tensor x, Tensor stats, Tensor? weight, Tensor? bias, Tensor? positions, "
      "int position_rows) -> Tensor h");
  m.def(
      "linear_epilogue_cuda(Tensor z, Tensor(a!) y, Tensor? gate, Tensor? residual, Tensor(b!)? stats, "
      "str activation, bool glu, bool saturate, bool write, float eps) -> ()");
  m.def(
      "conv_epilogue_cuda(Tensor(a!) z, Tensor? shortcut, Tensor? residual, Tensor? temb, Tensor? gate, "
      "float inv_scale, bool write, int groups, bool channel_sums, float eps) -> (Tensor mean, Tensor rstd, "
      "Tensor sums)");
  m.def(
      "adaln_modulate_cuda(Tensor x, Tensor scale, Tensor shift, Tensor? residual, Tensor? gate, float eps, "
      "bool store_sum, bool save) -> (Tensor y, Tensor s, Tensor mean, Tensor rstd)");
  m.def("temporal_attention_fwd_cuda(Tensor q, Tensor k, Tensor v, float scale) -> Tensor out");
  m.def("temporal_attention_fwd_out_cuda(Tensor q, Tensor k, Tensor v, float scale, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(ldmopt, CUDA, m) {
  m.impl("group_norm_fwd_cuda", &ldmopt::group_norm::forward_cuda);
  m.impl("group_norm_bwd_cuda", &ldmopt::group_norm::backward_cuda);
  m.impl("group_norm_stats_cuda", &ldmopt::group_norm::statistics_cuda);
  m.impl("group_norm_apply_cuda", &ldmopt::group_norm::apply_cuda);
  m.impl("group_norm_stats_from_sums_cuda", &ldmopt::group_norm_sums::from_sums_cuda);
  m.impl("layer_norm_stats_cuda", &ldmopt::layer_norm::row_statistics_cuda);
  m.impl("layer_norm_apply_cuda", &ldmopt::layer_norm::apply_cuda);
  m.impl("linear_epilogue_cuda", &ldmopt::linear_epilogue::run_cuda);
  m.impl("conv_epilogue_cuda", &ldmopt::conv_epilogue::run_cuda);
  m.impl("adaln_modulate_cuda", &ldmopt::adaln_modulate::forward_cuda);
  m.impl("temporal_attention_fwd_cuda", &ldmopt::temporal_attention::forward_cuda);
  m.impl("temporal_attention_fwd_out_cuda", &ldmopt::temporal_attention::forward_out_cuda);
}

TORCH_LIBRARY_IMPL(ldmopt, Meta, m) {
  m.impl("group_norm_fwd_cuda", &ldmopt::group_norm::forward_meta);
  m.impl("group_norm_bwd_cuda", &ldmopt::group_norm::backward_meta);
  m.impl("group_norm_stats_cuda", &ldmopt::group_norm::statistics_meta);
  m.impl("group_norm_apply_cuda", &ldmopt::group_norm::apply_meta);
  m.impl("group_norm_stats_from_sums_cuda", &ldmopt::group_norm_sums::from_sums_meta);
  m.impl("layer_norm_stats_cuda", &ldmopt::layer_norm::row_statistics_meta);
  m.impl("layer_norm_apply_cuda", &ldmopt::layer_norm::apply_meta);
  m.impl("linear_epilogue_cuda", &ldmopt::linear_epilogue::run_meta);
  m.impl("conv_epilogue_cuda", &ldmopt::conv_epilogue::run_meta);
  m.impl("adaln_modulate_cuda", &ldmopt::adaln_modulate::forward_meta);
  m.impl("temporal_attention_fwd_cuda", &ldmopt::temporal_attention::forward_meta);
  m.impl("temporal_attention_fwd_out_cuda", &ldmopt::temporal_attention::forward_out_meta);
}

// An empty Python module: importing ldmopt._C loads this library, whose static initialisers register the ops.
PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "ldmopt CUDA kernels (torch.ops.ldmopt.*)", -1, nullptr};
  return PyModule_Create(&module);
}
