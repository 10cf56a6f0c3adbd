"""Where the fused linear layers run their GEMM: in ldmopt's Triton GEMM, or in cuBLAS with the epilogue as one pass.

"triton": one Triton GEMM with the epilogue on its fp32 accumulator (kernels/linear.py, kernels/geglu.py), and a
LayerNorm, a blend or a two-part input read in its loads. "cublas": PyTorch's GEMM (cuBLAS on GPUs, in the input's
dtype with the bias, as nn.Linear runs it), then one pass for the rest (ops/linear_epilogue.py: ldmopt._C's kernel
where the extension is built, else kernels/linear_epilogue.py's Triton launch): GEGLU's gelu and product, the
activation, the gate and the residual, Flux's fp16 clamp, the next LayerNorm's row statistics.
A LayerNorm before the GEMM is applied by its own pass first (ops/layer_norm_apply.py, from the statistics already
taken), a two-part input is two GEMMs into one output (16-bit; a concatenation otherwise). The blend of SVD's
AlphaBlender stays in the Triton GEMM's loads under either placement (one projection per block).

Why "cublas" is auto's choice on GPUs: the measured Triton GEMMs ran slower than cuBLAS at diffusion shapes
(benchmarks/RESULTS.md, H200, 2026-12-04: the GEGLU GEMM 0.320 ms against cuBLAS's 0.082 at SDXL's feed-forward, the
linear + GELU-tanh 0.205 against 0.135 at PixArt's), while the elementwise tail the fusion removes is memory-bound
and fuses as well in a pass after the GEMM. It rounds the GEMM's output to the input dtype before the epilogue (one
rounding more than the Triton GEMM, as the unfused modules round), and costs one launch and one write and read of
the GEMM's output more than "triton" (none more than the unfused modules, which run two to four passes there).
``LDMOPT_GEMM_PLACEMENT`` = auto (default) | triton | cublas overrides the choice; benchmarks time both. On CPU
tensors (the Triton interpreter, tests) auto keeps the Triton GEMM, whose code the tests cover; they force "cublas"
to cover it. Flux's fp16 clamp: the cuBLAS GEMM's fp16 output is already infinite where |x W^T + b| > 65504 (as in
the unfused Flux block), so the clamp gives +-65504 there whatever the residual; the Triton GEMM clamps the fp32 sum.

A bias + GELU-tanh projection with nothing else to apply (the feed-forward's first GEMM of DiT, PixArt, SD3 and Flux,
in inference) needs no pass at all on a GPU: ``torch._addmm_activation(bias, x, W^T, use_gelu=True)`` runs cuBLASLt's
GELU_BIAS epilogue on the fp32 accumulator (PyTorch's CUDA kernel applies the tanh form whether or not it takes the
cuBLASLt route; its CPU kernel applies the erf form, so this stays CUDA-only; torch/_decomp/decompositions.py's
decomposition of the op states both). One rounding, as the Triton GEMM. When
the caller keeps the pre-activation for backward, the pass writes both. ``LDMOPT_GEMM_GELU=pass`` keeps the pass.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _env
from ._autocast import autocast_off
from ._placement import PlacementSwitch
from .linear_epilogue import linear_epilogue

ENV = "LDMOPT_GEMM_PLACEMENT"
PLACEMENTS = ("auto", "triton", "cublas")
_SWITCH = PlacementSwitch(ENV, PLACEMENTS)
#: placement -> number of fused GEMM calls on the Triton backend that used it in this process
placement_counts = _SWITCH.counts
#: The placement ``LDMOPT_GEMM_PLACEMENT`` asks for ("auto" when unset), read at each call.
requested_placement = _SWITCH.requested
#: Within the block, fused GEMMs use the given placement (one of PLACEMENTS), for benchmarks and checks.
forced = _SWITCH.forced


GELU_ENV = "LDMOPT_GEMM_GELU"
#: auto: cuBLASLt's GELU epilogue where it applies (module docstring); pass: kernels/linear_epilogue.py's pass always
_GELU_SWITCH = PlacementSwitch(GELU_ENV, ("auto", "pass"))
#: "cublaslt" / "pass" -> number of bias + GELU-tanh GEMMs under the cublas placement that ran it (see above)
gelu_epilogue_counts = _GELU_SWITCH.counts
#: Within the block, the GELU-tanh epilogue runs as asked ("auto" or "pass"), for benchmarks and checks.
forced_gelu_epilogue = _GELU_SWITCH.forced
#: device types whose torch._addmm_activation(use_gelu=True) applies GELU's tanh form (CPU's applies the erf form)
TANH_GELU_DEVICES = ("cuda",)


def gemm_placement(device: torch.device, blend: bool = False) -> str:
    """ "triton" or "cublas" for a fused GEMM on ``device`` (see the module docstring). ``blend``: the input is a
    per-sample blend of two tensors, formed in the Triton GEMM's loads only. Under deterministic algorithms without
    ``CUBLAS_WORKSPACE_CONFIG`` auto keeps the Triton GEMM: PyTorch refuses to run cuBLAS then (a stock nn.Linear
    would raise too, but the fused layer has a GEMM that need not)."""
    requested = requested_placement()
    if blend:
        return "triton"
    if requested != "auto":
        return requested
    if device.type != "cuda":
        return "triton"
    if torch.are_deterministic_algorithms_enabled() and not os.environ.get("CUBLAS_WORKSPACE_CONFIG"):
        return "triton"
    return "cublas"


@_env.dynamo_constant
def cublas_gemms(device_type: str) -> bool:
    """Whether a fused GEMM on ``device_type`` tensors runs cuBLAS's GEMM now: for Python decisions around the ops
    (traced by torch.compile, which takes the answer as a constant)."""
    return gemm_placement(torch.device(device_type)) == "cublas"


def choose_gemm_placement(device: torch.device, blend: bool = False) -> str:
    """:func:`gemm_placement`, counted in placement_counts (call it once per op call that runs a GEMM)."""
    placement = gemm_placement(device, blend)
    placement_counts[placement] += 1
    return placement


def gemm(x: Tensor, weight: Tensor, bias: Tensor | None, x_tail: Tensor | None = None) -> Tensor:
    """x W^T + bias [M, N] in x's dtype by PyTorch (cuBLAS on GPUs); with x_tail [M, K2], of the input [x | x_tail]:
    16-bit parts as two GEMMs into one output (the second accumulating in place, so the concatenation is never
    written; the first product, bias included, is rounded before the second is added), fp32 ones by concatenating
    (their products follow the matmul precision setting either way; one GEMM keeps one rounding)."""
    # Inside an op the operands were already cast for autocast; a nested F.linear must not cast them again.
    with autocast_off(x.device.type):
        if x_tail is None:
            return F.linear(x, weight, bias)
        k = x.shape[1]
        if x.dtype == torch.float32:
            return F.linear(torch.cat([x, x_tail], dim=1), weight, bias)
        out = F.linear(x, weight[:, :k], bias)
        return out.addmm_(x_tail, weight[:, k:].t())


def linear_then_epilogue(x, weight, bias, gate, residual, activation, save_pre, dtype, x_tail=None, *, glu=False,
                         saturate=False, out_stats=None, out_eps=1e-5):  # fmt: skip
    """(y, pre) as the Triton GEMMs' launchers return them (kernels/linear.linear_fwd, kernels/geglu.geglu_fwd with
    ``glu``): the GEMM by PyTorch (:func:`gemm`), then ops/linear_epilogue.py's pass, in place into the GEMM's
    output where that output is not also kept as ``pre`` and y has its dtype."""
    if activation == "gelu_tanh" and gate is None and residual is None and out_stats is None and not glu:
        if gelu_in_gemm(x, bias, save_pre, dtype, x_tail, saturate):
            gelu_epilogue_counts["cublaslt"] += 1
            with autocast_off(x.device.type):
                return torch._addmm_activation(bias, x, weight.t(), use_gelu=True), x.new_empty((0,))
        gelu_epilogue_counts["pass"] += 1
    z = gemm(x, weight, bias, x_tail)
    in_place = not save_pre and not glu and dtype == z.dtype
    y = linear_epilogue(z, activation, gate, residual, dtype, glu=glu, saturate=saturate, in_place=in_place,
                        out_stats=out_stats, out_eps=out_eps)  # fmt: skip
    if not save_pre:
        return y, x.new_empty((0,))
    return (y.clone() if y is z else y), z  # an op's outputs must not alias (only a direct call asks this)


def gelu_in_gemm(x: Tensor, bias: Tensor | None, save_pre: bool, dtype: torch.dtype, x_tail: Tensor | None,
                 saturate: bool) -> bool:  # fmt: skip
    """Whether a bias + GELU-tanh GEMM with no gate, residual or statistics runs GELU in cuBLASLt's epilogue (module
    docstring): :func:`cublaslt_gelu`, with one input tensor, the output in its dtype and no clamp."""
    plain = x_tail is None and not saturate and dtype == x.dtype
    return plain and cublaslt_gelu(x.device.type, bias is not None, save_pre)


def cublaslt_gelu(device_type: str, bias: bool, save_pre: bool) -> bool:
    """The part of :func:`gelu_in_gemm` that needs no tensor (the profiler's projection asks it for a device type):
    a device whose _addmm_activation has the tanh form, a bias, no pre-activation to keep, and LDMOPT_GEMM_GELU not
    "pass"."""
    return device_type in TANH_GELU_DEVICES and bias and not save_pre and _GELU_SWITCH.requested() == "auto"
