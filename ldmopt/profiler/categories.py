"""Operator categories shared by the measured profile and the analytic model.

An operator is classified by its ATen name first (convolution, GEMM, normalisation, copies...). Matmuls and softmax
executed directly inside a diffusers attention module are attention; other ops executed directly inside a
normalisation module (diffusers' RMSNorm is a chain of elementwise ops) are normalisation. Attention is split by the
module that runs it: temporal (module path under a temporal block), cross (keys from ``encoder_hidden_states`` that
are not concatenated with the queries) or spatial self (everything else, including the joint image+text attention of
SD3 and Flux).
"""

from __future__ import annotations

import re

CONV = "convolution"
LINEAR = "linear"
ATTN_SPATIAL = "attention.spatial"
ATTN_CROSS = "attention.cross"
ATTN_TEMPORAL = "attention.temporal"
ATTN_UNATTRIBUTED = "attention.unattributed"
NORM = "normalization"
ELEMENTWISE = "elementwise"
LAYOUT = "layout"
LDMOPT = "ldmopt"
OTHER = "other"

CATEGORIES = (
    CONV,
    LINEAR,
    ATTN_SPATIAL,
    ATTN_CROSS,
    ATTN_TEMPORAL,
    ATTN_UNATTRIBUTED,
    NORM,
    ELEMENTWISE,
    LAYOUT,
    LDMOPT,
    OTHER,
)
ATTENTION = (ATTN_SPATIAL, ATTN_CROSS, ATTN_TEMPORAL, ATTN_UNATTRIBUTED)
LABELS = {
    CONV: "convolution",
    LINEAR: "linear/GEMM",
    ATTN_SPATIAL: "attention: spatial self",
    ATTN_CROSS: "attention: cross",
    ATTN_TEMPORAL: "attention: temporal",
    ATTN_UNATTRIBUTED: "attention: unattributed",
    NORM: "normalisation",
    ELEMENTWISE: "elementwise/activation",
    LAYOUT: "layout conversions and copies",
    LDMOPT: "ldmopt fused kernels",
    OTHER: "other",
}
ATTENTION_KINDS = {"spatial": ATTN_SPATIAL, "cross": ATTN_CROSS, "temporal": ATTN_TEMPORAL}

# Module-path components under which an attention module attends over frames.
TEMPORAL_MARKERS = frozenset(
    {"motion_modules", "temp_attentions", "transformer_in", "temporal_transformer_blocks", "temporal_transformer"}
)

_CONV_OPS = {
    "convolution", "_convolution", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
    "conv_transpose3d", "cudnn_convolution", "cudnn_convolution_transpose", "mkldnn_convolution",
    "_slow_conv2d_forward", "slow_conv3d_forward", "slow_conv_transpose2d", "slow_conv_dilated2d",
    "convolution_backward", "_convolution_double_backward", "cudnn_convolution_add_relu", "_nnpack_spatial_convolution",
    "miopen_convolution", "thnn_conv2d", "convolution_overrideable", "_slow_conv2d_backward",
}  # fmt: skip
_GEMM_OPS = {
    "linear", "addmm", "mm", "bmm", "baddbmm", "matmul", "addmv", "mv", "dot", "_addmm_activation", "addbmm",
    "_scaled_mm", "linear_backward", "einsum", "_int_mm", "tensordot",
}  # fmt: skip
_ATTN_CORE_OPS = {"bmm", "baddbmm", "matmul", "softmax", "_softmax", "_safe_softmax", "_softmax_backward_data"}
_ATTENTION_OPS = re.compile(
    r"^(scaled_dot_product_attention|_scaled_dot_product_\w+|_flash_attention_\w+|_efficient_attention_\w+|"
    r"flex_attention\w*|_fused_sdp_choice|flash_attn\w*|_cudnn_attention\w*)$"
)
_NORM_OPS = re.compile(
    r"^(native_group_norm|group_norm|native_layer_norm|layer_norm|rms_norm|_fused_rms_norm|native_batch_norm|"
    r"batch_norm|_batch_norm_impl_index|_native_batch_norm_legit\w*|instance_norm|cudnn_batch_norm|"
    r"miopen_batch_norm|_batch_norm_with_update|_batch_norm_no_update)(_backward)?$"
)
_LAYOUT_OPS = {
    "copy_", "clone", "contiguous", "_to_copy", "to", "_copy_from", "_copy_from_and_resize", "cat", "stack",
    "constant_pad_nd", "pad", "reflection_pad2d", "replicate_pad2d", "repeat", "repeat_interleave", "roll", "flip",
    "index", "index_select", "gather", "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d",
    "upsample_bilinear2d", "upsample_nearest2d_backward", "upsample_bilinear2d_backward", "_unsafe_index",
    "narrow_copy", "view_copy", "permute_copy", "transpose_copy", "_reshape_alias", "reshape", "view", "permute",
    "transpose", "t", "expand", "as_strided", "slice", "select", "narrow", "split", "split_with_sizes", "chunk",
    "unbind", "squeeze", "unsqueeze", "flatten", "unflatten", "_unsafe_view", "alias", "detach", "view_as",
    "expand_as", "reshape_as", "numpy_T", "movedim", "lift_fresh", "cat_backward", "index_put_", "slice_backward",
    "select_backward", "unfold", "col2im", "im2col", "pixel_shuffle", "pixel_unshuffle", "channel_shuffle",
}  # fmt: skip
_OTHER_OPS = {
    "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "new_zeros", "new_ones", "new_full",
    "zeros", "zeros_like", "ones", "ones_like", "full", "full_like", "arange",
    "linspace", "randn", "randn_like", "rand", "rand_like", "randint", "normal_", "uniform_", "scalar_tensor",
    "lift_fresh_copy", "resize_", "embedding", "embedding_backward", "embedding_dense_backward", "item",
    "_local_scalar_dense", "nonzero", "set_", "record_stream", "is_nonzero", "equal", "allclose", "isinf", "isnan",
    "result_type", "_assert_async", "_assert_tensor_metadata",
}  # fmt: skip


def op_base_name(name: str) -> tuple[str, str]:
    """``"aten::addmm"`` / ``"aten.addmm.default"`` -> ``("aten", "addmm")``."""
    if "::" in name:
        namespace, _, rest = name.partition("::")
        return namespace, rest.split(".")[0]
    parts = name.split(".")
    if len(parts) >= 2:
        return parts[0], parts[1]
    return "", name


def is_norm_op(base: str) -> bool:
    """A normalisation that runs as one native operator (its backward too)."""
    return bool(_NORM_OPS.match(base))


def classify_op(name: str, *, attention_kind: str | None = None, in_norm: bool = False, pointwise: bool = True) -> str:
    """Category of one operator.

    ``attention_kind`` ("spatial"/"cross"/"temporal") is set when the op runs directly in an attention module (not in
    one of its projection layers); ``in_norm`` when it runs directly in a normalisation module (then casts and
    elementwise ops are the normalisation's own). ``pointwise`` tells
    unknown ATen ops that are elementwise or reductions from the rest.
    """
    namespace, base = op_base_name(name)
    if namespace == "ldmopt":
        return ldmopt_category(base)
    if base in _CONV_OPS:
        return CONV
    if _ATTENTION_OPS.match(base):
        return ATTENTION_KINDS.get(attention_kind, ATTN_UNATTRIBUTED)
    if attention_kind is not None and base in _ATTN_CORE_OPS:
        return ATTENTION_KINDS[attention_kind]
    if base in _GEMM_OPS:
        return LINEAR
    if _NORM_OPS.match(base) or in_norm:
        return NORM
    if base in _LAYOUT_OPS:
        return LAYOUT
    if base in _OTHER_OPS:
        return OTHER
    if namespace in ("aten", "prims", "") and pointwise:
        return ELEMENTWISE
    return OTHER


# Kernel names (GPU) for device time that no CPU-side operator launched (CUDA graphs, compiled regions).
_KERNEL_PATTERNS = (
    (re.compile(r"flash|fmha|attention|attn|sdpa", re.I), ATTN_UNATTRIBUTED),
    (re.compile(r"conv|fprop|dgrad|wgrad|implicit_gemm|winograd|cudnn::", re.I), CONV),
    (re.compile(r"group_norm|groupnorm|layer_norm|layernorm|rms_norm|batch_norm|rmsnorm", re.I), NORM),
    (re.compile(r"nchwToNhwc|nhwcToNchw|transpose|permute|copy|cat_|CatArray|memcpy|memset|Memcpy|Memset", re.I),
     LAYOUT),
    (re.compile(r"gemm|cutlass|xmma|cublas|sm\d+_.*mma|matmul|_mm_|triton_tem", re.I), LINEAR),
    (re.compile(r"elementwise|vectorized|reduce|triton_(poi|red|per)|softmax|activation", re.I), ELEMENTWISE),
)  # fmt: skip


def classify_kernel(name: str, ldmopt_kernels: frozenset[str] = frozenset()) -> str:
    """Category of a GPU kernel from its name alone (used when no operator launched it)."""
    if name in ldmopt_kernels:
        return ldmopt_category(name)
    for pattern, category in _KERNEL_PATTERNS:
        if pattern.search(name):
            return category
    return OTHER


def ldmopt_category(name: str) -> str:
    """Category of one of ldmopt's ops or kernels: its temporal attention (forward, backward, the CUDA and Triton
    kernels) is attention over frames, the share the studies report and a patched video model's profile must keep
    showing; every other fused op is "ldmopt fused kernels"."""
    return ATTN_TEMPORAL if "temporal_attention" in name else LDMOPT


def ldmopt_kernel_names() -> frozenset[str]:
    """Names of the Triton kernels (``_``-prefixed jit functions) in ldmopt.kernels; empty without Triton."""
    import importlib
    import pkgutil

    try:
        from triton.runtime.jit import KernelInterface

        import ldmopt.kernels as pkg
    except Exception:
        return frozenset()
    found = set()
    for info in pkgutil.iter_modules(pkg.__path__):
        try:
            module = importlib.import_module(f"ldmopt.kernels.{info.name}")
        except Exception:
            continue
        found.update(a for a, v in vars(module).items() if a.startswith("_") and isinstance(v, KernelInterface))
    return frozenset(found)


def attention_kind_of(path: str, module, args: tuple, kwargs: dict) -> str:
    """ "temporal", "cross" or "spatial" for one call of a diffusers attention module at ``path``.

    Under a temporal path, a context with another sequence length than the queries' is cross-attention (SVD's
    ``attn2`` over its one image-embedding key), not attention over frames."""
    context = kwargs.get("encoder_hidden_states", args[1] if len(args) > 1 else None)
    # Added projections make SD3/Flux's joint attention (context tokens beside the queries'), except in a module
    # that says it is cross-attention: Wan's image-to-video attn2 projects image keys beside the text ones.
    added = getattr(module, "add_k_proj", None) is not None or getattr(module, "add_q_proj", None) is not None
    joint = added and not getattr(module, "is_cross_attention", False)
    cross = context is not None and not joint
    if any(part in TEMPORAL_MARKERS for part in path.split(".")):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        shapes = [getattr(t, "shape", ()) for t in (hidden, context)]
        lengths = [shape[-2] if len(shape) >= 2 else None for shape in shapes]
        return "cross" if cross and None not in lengths and lengths[0] != lengths[1] else "temporal"
    return "cross" if cross else "spatial"


def is_attention_module(module) -> bool:
    """diffusers ``Attention`` and the ``AttentionModuleMixin`` classes (Flux, SD3...), duck-typed."""
    return hasattr(module, "processor") and (hasattr(module, "to_q") or hasattr(module, "to_qkv"))


_NORM_CLASS_NAMES = frozenset(
    {"GroupNorm", "LayerNorm", "RMSNorm", "FP32LayerNorm", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d",
     "InstanceNorm2d", "LlamaRMSNorm", "T5LayerNorm", "MochiRMSNorm"}
)  # fmt: skip


def is_norm_module(module) -> bool:
    """A module whose forward is a normalisation (not an adaLN block with its own projections)."""
    return type(module).__name__ in _NORM_CLASS_NAMES
