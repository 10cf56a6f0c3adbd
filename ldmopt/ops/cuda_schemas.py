"""The schema of every ldmopt._C op (csrc/ops.cpp), as the Python callers in ldmopt/ops/ call them.

An extension built from older sources can hold an op of the same name with another schema (an editable install updated
and not rebuilt): ``_refusals.stale_schema`` (through ``cuda_extension_refusals``) compares each op against this table
before its cuda backend takes a call, so such an op sends the call to the Triton backend, with the reason, instead of
raising; the build test asserts the built schemas equal these. Change an op's schema here and in ops.cpp together."""

CUDA_SCHEMAS = {
    "group_norm_fwd_cuda": (
        "ldmopt::group_norm_fwd_cuda(Tensor x, Tensor? weight, Tensor? bias, int num_groups, float eps, str "
        "activation) -> (Tensor y, Tensor mean, Tensor rstd)"
    ),
    "group_norm_bwd_cuda": (
        "ldmopt::group_norm_bwd_cuda(Tensor dy, Tensor x, Tensor? weight, Tensor? bias, Tensor mean, Tensor "
        "rstd, int num_groups, str activation) -> (Tensor dx, Tensor dweight, Tensor dbias)"
    ),
    "group_norm_stats_cuda": (
        "ldmopt::group_norm_stats_cuda(Tensor x, int num_groups, float eps, Tensor? x_tail=None) -> (Tensor mean, "
        "Tensor rstd)"
    ),
    "group_norm_apply_cuda": (
        "ldmopt::group_norm_apply_cuda(Tensor x, Tensor mean, Tensor rstd, Tensor? weight, Tensor? bias, int "
        "num_groups, str activation, Tensor? x_tail=None) -> Tensor y"
    ),
    "group_norm_stats_from_sums_cuda": (
        "ldmopt::group_norm_stats_from_sums_cuda(Tensor sums, Tensor? sums_tail, int num_groups, float eps, "
        "int count, int frames) -> (Tensor mean, Tensor rstd)"
    ),
    "layer_norm_stats_cuda": "ldmopt::layer_norm_stats_cuda(Tensor x, float eps) -> Tensor stats",
    "layer_norm_apply_cuda": (
        "ldmopt::layer_norm_apply_cuda(Tensor x, Tensor stats, Tensor? weight, Tensor? bias, Tensor? "
        "positions, int position_rows) -> Tensor h"
    ),
    "linear_epilogue_cuda": (
        "ldmopt::linear_epilogue_cuda(Tensor z, Tensor(a!) y, Tensor? gate, Tensor? residual, Tensor(b!)? "
        "stats, str activation, bool glu, bool saturate, bool write, float eps) -> ()"
    ),
    "conv_epilogue_cuda": (
        "ldmopt::conv_epilogue_cuda(Tensor(a!) z, Tensor? shortcut, Tensor? residual, Tensor? temb, Tensor? "
        "gate, float inv_scale, bool write, int groups, bool channel_sums, float eps) -> (Tensor mean, Tensor "
        "rstd, Tensor sums)"
    ),
    "adaln_modulate_cuda": (
        "ldmopt::adaln_modulate_cuda(Tensor x, Tensor scale, Tensor shift, Tensor? residual, Tensor? gate, "
        "float eps, bool store_sum, bool save) -> (Tensor y, Tensor s, Tensor mean, Tensor rstd)"
    ),
    "temporal_attention_fwd_cuda": (
        "ldmopt::temporal_attention_fwd_cuda(Tensor q, Tensor k, Tensor v, float scale) -> Tensor out"
    ),
    "temporal_attention_fwd_out_cuda": (
        "ldmopt::temporal_attention_fwd_out_cuda(Tensor q, Tensor k, Tensor v, float scale, Tensor(a!) out) -> ()"
    ),
}
