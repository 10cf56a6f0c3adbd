"""Fused linear layers at diffusion shapes: ldmopt (both GEMM placements) vs eager vs torch.compile vs cuBLAS alone.

- GEGLU (SD UNets, AnimateDiff): one dual-accumulator GEMM writing I columns vs diffusers' proj -> chunk -> gelu -> mul.
- GELU-tanh projection (PixArt, Flux): bias + GELU epilogue vs F.linear + F.gelu.
- gated residual (DiT/PixArt attention output): ``res + gate[b] * (x W^T + b)`` in the GEMM epilogue.
- two-part input (Flux single-stream ``proj_out``): ``res + gate[b] * ([attn | mlp] W^T + b)`` reading both parts in
  place vs concatenating first (eager, and ldmopt's GEMM on the concatenation).
- adaLN: residual add + LayerNorm + ``x * (1 + scale[b]) + shift[b]`` in one row kernel.
- LayerNorm in the GEMMs' loads (UNet blocks): norm1 -> to_q/to_k/to_v from one statistics pass, and norm3 -> the
  GEGLU projection, vs F.layer_norm then the GEMMs (eager; ldmopt's GEGLU on the written norm).

FLOPs counted: 2*M*K*N per GEMM (x3 for forward+backward). Bytes counted for adaLN: x, residual read and y, s written
(forward); dy, s, ds read and dx written on top (backward), so GB/s is the minimum traffic over time.
Targets (H200): GEGLU >= 1.4x eager at K=320 and >= 1.15x at K=1280; bias+GELU within 10% of the bare cuBLAS GEMM at
the PixArt/Flux shapes; adaLN >= 80% of measured copy bandwidth. ``torch.compile`` runs in max-autotune mode without
CUDA graphs (as the other benchmarks); in quick mode (LDMOPT_BENCH_QUICK=1) only the first case of each op compiles.
The "ldmopt" rows run the default GEMM placement (on GPUs cuBLAS's GEMM, then the epilogue as one Triton pass),
the "ldmopt-triton-gemm" rows ldmopt's Triton GEMM with the epilogue on its accumulator (``LDMOPT_GEMM_PLACEMENT``).
Every forward provider also gets a ``+graph`` row: ten calls captured in one CUDA graph, the GPU time per call
(harness.graphed_time), so a kernel's own speed shows where the eager row is bound by the host's time per call.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.nn.functional as F

import ldmopt
from benchmarks import harness
from ldmopt.ops import linear_cublas
from ldmopt.ops.adaln_modulate import adaln_modulate
from ldmopt.ops.geglu import geglu
from ldmopt.ops.layer_norm_linear import layer_norm_linear, layer_norm_stats
from ldmopt.ops.linear import linear

pytestmark = harness.gpu_only

DEVICE = "cuda"  # tests/benchmarks_dry_run/ runs this benchmark's logic on the CPU
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
MODES = ["fwd", "fwd+bwd"]
GEGLU_CASES = {
    # name: (M, K, I)
    "sd15-l0": (8192, 320, 1280),
    "sdxl": (2048, 1280, 5120),
    "animatediff-temporal": (131072, 320, 1280),
}
GELU_CASES = {
    # name: (M, K, N)
    "pixart": (8192, 1152, 4608),
    "flux": (4608, 3072, 12288),
}
GATED_CASES = {"pixart-attn-out": (2, 4096, 1152, 1152)}  # (B, T, K, N)
CONCAT_CASES = {"flux-single-proj-out": (1, 4608, 3072, 12288, 3072)}  # (B, T, K attention, K mlp, N); Flux runs bf16
ADALN_CASES = {"pixart": (2, 4096, 1152)}  # (B, T, C)
LN_QKV_CASES = {"sd15-l0": (8192, 320), "sdxl-l1": (8192, 640), "sdxl-l2": (2048, 1280)}  # (M, C), batch 2
LN_GEGLU_CASES = {"sdxl-l1": (8192, 640, 2560), "sdxl-l2": (2048, 1280, 5120)}  # (M, C, I)
BLEND_CASES = {"svd-proj-out-l0": (28, 9216, 320), "svd-proj-out-l1": (28, 2304, 640)}  # (frames, tokens, C)


def _quick() -> bool:
    return os.environ.get("LDMOPT_BENCH_QUICK") == "1"


def _within(fn, *contexts):
    """``fn`` inside ``contexts`` (context managers made per call), or ``fn`` itself without any."""
    if not contexts:
        return fn

    def run(*args, **kwargs):
        with contextlib.ExitStack() as stack:
            for context in contexts:
                stack.enter_context(context())
            return fn(*args, **kwargs)

    return run


def _default(fn, *placements):
    """``fn`` as a user runs it: backends chosen automatically (on GPUs, cuBLAS's GEMM and ldmopt._C's pass after it
    where the extension is built), a fall-back to the reference an error (harness.default_backends), within
    ``placements`` where given."""
    return harness.default_backends(_within(fn, *placements))


def _triton(fn, *placements):
    """``fn`` on the Triton backend, within ``placements`` where given."""
    return _within(fn, *placements, lambda: ldmopt.use_backend("triton"))


def _triton_gemm(fn):
    """``fn`` with the GEMM in ldmopt's Triton kernel (the epilogue on its accumulator), where the "ldmopt" row runs
    the default placement, on GPUs cuBLAS's GEMM and then the epilogue pass (ldmopt/ops/linear_cublas.py)."""
    return _triton(fn, lambda: linear_cublas.forced("triton"))


def _gelu_pass(fn):
    """``fn`` with GELU-tanh applied by the epilogue pass after cuBLAS's GEMM, where the "ldmopt" row's inference
    runs it in cuBLASLt's GELU epilogue (ldmopt/ops/linear_cublas.py; training keeps the pass either way)."""
    return _default(fn, lambda: linear_cublas.forced_gelu_epilogue("pass"))


def _with_compile(providers: dict, eager, first_case: bool) -> dict:
    if first_case or not _quick():
        providers["compile"] = harness.compiled(eager, mode="max-autotune-no-cudagraphs")
    else:
        providers["compile"] = None
    return providers


def _step(fn, mode, inputs, grad_inputs):
    """What is timed: the forward without autograd, or forward and the gradients of ``grad_inputs`` for random
    output gradients (drawn on a first call, which compiles a compiled provider: inside the caller's try)."""
    if mode == "fwd":

        def run():
            with torch.no_grad():
                return fn(*inputs)

        return run
    out = fn(*inputs)
    grads_out = [torch.randn_like(o) for o in (out if isinstance(out, tuple) else (out,))]

    def run():
        out = fn(*inputs)
        return torch.autograd.grad(out if isinstance(out, tuple) else (out,), grad_inputs, grads_out, allow_unused=True)

    return run


def _measure(recorder, op, case, dtype_name, mode, providers, inputs, grad_inputs, *, flops=None, nbytes=None):
    """Time every provider on ``inputs``; fwd+bwd differentiates the (first) output w.r.t. ``grad_inputs``."""
    for name, fn in providers.items():
        timing, peak, note = None, None, "skipped in quick mode"
        if fn is not None:
            try:
                run = _step(fn, mode, inputs, grad_inputs)
                timing, note = harness.time_fn(run), ""
                peak = harness.peak_memory(run) if mode == "fwd+bwd" else None
            except Exception as exc:  # an inductor failure, a refused shape: a row with the reason, the others run
                timing, peak, note = None, None, harness.error_note(exc)
        row = dict(op=op, case=case, dtype=dtype_name, mode=mode, flops=flops, bytes=nbytes)
        recorder.record(provider=name, timing=timing, peak_mem=peak, note=note, **row)
        if timing is not None and mode == "fwd":  # GPU time alone: eager rows include the host's time per call
            harness.record_graphed(recorder, run, device=DEVICE, provider=name, **row)


def _params(m, k, n, dtype, grad):
    x = torch.randn(m, k, device=DEVICE, dtype=dtype, requires_grad=grad)
    w = (torch.randn(n, k, device=DEVICE) * k**-0.5).to(dtype).requires_grad_(grad)
    b = (torch.randn(n, device=DEVICE) * 0.1).to(dtype).requires_grad_(grad)
    return x, w, b


def _eager_geglu(x, w, b):
    h, g = F.linear(x, w, b).chunk(2, dim=-1)
    return h * F.gelu(g)


def _bare_gemm(x, w, b):
    return F.linear(x, w)


@pytest.mark.parametrize("case", list(GEGLU_CASES))
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("mode", MODES)
def bench_geglu(case, dtype_name, mode, bench_recorder):
    m, k, i = GEGLU_CASES[case]
    inputs = _params(m, k, 2 * i, DTYPES[dtype_name], mode == "fwd+bwd")
    providers = {"ldmopt": _default(geglu), "ldmopt-triton-gemm": _triton_gemm(geglu), "eager": _eager_geglu}
    providers["cublas-gemm"] = _bare_gemm
    providers = _with_compile(providers, _eager_geglu, case == next(iter(GEGLU_CASES)))
    flops = 2 * m * k * 2 * i * (1 if mode == "fwd" else 3)
    _measure(bench_recorder, "geglu", case, dtype_name, mode, providers, inputs, inputs, flops=flops)


def _eager_gelu_tanh(x, w, b):
    return F.gelu(F.linear(x, w, b), approximate="tanh")


def _ldmopt_gelu_tanh(x, w, b):
    return linear(x, w, b, activation="gelu_tanh")


@pytest.mark.parametrize("case", list(GELU_CASES))
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("mode", MODES)
def bench_linear_gelu_tanh(case, dtype_name, mode, bench_recorder):
    m, k, n = GELU_CASES[case]
    inputs = _params(m, k, n, DTYPES[dtype_name], mode == "fwd+bwd")
    providers = {"ldmopt": _default(_ldmopt_gelu_tanh), "ldmopt-triton-gemm": _triton_gemm(_ldmopt_gelu_tanh)}
    if mode == "fwd":
        providers["ldmopt-gelu-pass"] = _gelu_pass(_ldmopt_gelu_tanh)
    providers.update({"eager": _eager_gelu_tanh, "cublas-gemm": _bare_gemm})
    providers = _with_compile(providers, _eager_gelu_tanh, case == next(iter(GELU_CASES)))
    flops = 2 * m * k * n * (1 if mode == "fwd" else 3)
    _measure(bench_recorder, "linear_gelu_tanh", case, dtype_name, mode, providers, inputs, inputs, flops=flops)


def _eager_gated(x, w, b, gate, res):
    return res + gate[:, None, :] * F.linear(x, w, b)


def _ldmopt_gated(x, w, b, gate, res):
    return linear(x, w, b, gate=gate, residual=res)


@pytest.mark.parametrize("case", list(GATED_CASES))
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("mode", MODES)
def bench_linear_gated_residual(case, dtype_name, mode, bench_recorder):
    bsz, t, k, n = GATED_CASES[case]
    dtype, grad = DTYPES[dtype_name], mode == "fwd+bwd"
    x, w, b = _params(bsz * t, k, n, dtype, grad)
    x = x.detach().view(bsz, t, k).requires_grad_(grad)
    gate = torch.randn(bsz, n, device=DEVICE, dtype=dtype, requires_grad=grad)
    res = torch.randn(bsz, t, n, device=DEVICE, dtype=dtype, requires_grad=grad)
    inputs = (x, w, b, gate, res)
    providers = {"ldmopt": _default(_ldmopt_gated), "ldmopt-triton-gemm": _triton_gemm(_ldmopt_gated)}
    providers["eager"] = _eager_gated
    providers["cublas-gemm"] = lambda x, w, b, gate, res: F.linear(x, w)
    providers = _with_compile(providers, _eager_gated, True)
    flops = 2 * bsz * t * k * n * (1 if mode == "fwd" else 3)
    _measure(bench_recorder, "linear_gated_residual", case, dtype_name, mode, providers, inputs, (x, w, b, gate),
             flops=flops)  # fmt: skip


def _eager_concat_gated(attn, mlp, w, b, gate, res):
    return res + gate[:, None, :] * F.linear(torch.cat([attn, mlp], dim=-1), w, b)


def _ldmopt_concat_gated(attn, mlp, w, b, gate, res):
    return linear((attn, mlp), w, b, gate=gate, residual=res)


def _ldmopt_gated_on_cat(attn, mlp, w, b, gate, res):
    return linear(torch.cat([attn, mlp], dim=-1), w, b, gate=gate, residual=res)


@pytest.mark.parametrize("case", list(CONCAT_CASES))
@pytest.mark.parametrize("dtype_name", ["bf16"])
@pytest.mark.parametrize("mode", MODES)
def bench_linear_concat_gated(case, dtype_name, mode, bench_recorder):
    bsz, t, k_attn, k_mlp, n = CONCAT_CASES[case]
    dtype, grad = DTYPES[dtype_name], mode == "fwd+bwd"
    _, w, b = _params(1, k_attn + k_mlp, n, dtype, grad)
    attn = torch.randn(bsz, t, k_attn, device=DEVICE, dtype=dtype, requires_grad=grad)
    mlp = torch.randn(bsz, t, k_mlp, device=DEVICE, dtype=dtype, requires_grad=grad)
    gate = torch.randn(bsz, n, device=DEVICE, dtype=dtype, requires_grad=grad)
    res = torch.randn(bsz, t, n, device=DEVICE, dtype=dtype, requires_grad=grad)
    inputs = (attn, mlp, w, b, gate, res)
    providers = {
        "ldmopt": _default(_ldmopt_concat_gated),
        "ldmopt-triton-gemm": _triton_gemm(_ldmopt_concat_gated),
        "ldmopt-on-cat": _default(_ldmopt_gated_on_cat),
        "eager": _eager_concat_gated,
    }
    providers = _with_compile(providers, _eager_concat_gated, True)
    flops = 2 * bsz * t * (k_attn + k_mlp) * n * (1 if mode == "fwd" else 3)
    _measure(bench_recorder, "linear_concat_gated", case, dtype_name, mode, providers, inputs, inputs, flops=flops)


def _eager_blend(spatial, temporal, w, b, alpha, res):
    a = alpha[:, None, None].to(spatial.dtype)  # diffusers' AlphaBlender, then proj_out and the container's add
    return F.linear(a * spatial + (1.0 - a) * temporal, w, b) + res


def _ldmopt_blend(spatial, temporal, w, b, alpha, res):
    return linear((spatial, temporal), w, b, residual=res, mix=alpha)


def _ldmopt_on_blend(spatial, temporal, w, b, alpha, res):
    a = alpha[:, None, None].to(spatial.dtype)
    return linear(a * spatial + (1.0 - a) * temporal, w, b, residual=res)


@pytest.mark.parametrize("case", list(BLEND_CASES))
@pytest.mark.parametrize("dtype_name", ["fp16"])
@pytest.mark.parametrize("mode", MODES)
def bench_linear_blend(case, dtype_name, mode, bench_recorder):
    """SVD's container proj_out: the AlphaBlender mix formed in the GEMM's loads vs blending first."""
    frames, t, c = BLEND_CASES[case]
    dtype, grad = DTYPES[dtype_name], mode == "fwd+bwd"
    _, w, b = _params(1, c, c, dtype, grad)
    spatial, temporal, res = (
        torch.randn(frames, t, c, device=DEVICE, dtype=dtype, requires_grad=grad) for _ in range(3)
    )
    alpha = torch.rand(frames, device=DEVICE, requires_grad=grad)
    inputs = (spatial, temporal, w, b, alpha, res)
    providers = {
        "ldmopt": _default(_ldmopt_blend),
        "ldmopt-on-blend": _default(_ldmopt_on_blend),
        "eager": _eager_blend,
    }
    providers = _with_compile(providers, _eager_blend, True)
    flops = 2 * frames * t * c * c * (1 if mode == "fwd" else 3)
    _measure(bench_recorder, "linear_blend", case, dtype_name, mode, providers, inputs, inputs, flops=flops)


def _eager_adaln(x, scale, shift, res):
    s = x + res
    return F.layer_norm(s, s.shape[-1:], eps=1e-6) * (1 + scale[:, None]) + shift[:, None], s


def _ldmopt_adaln(x, scale, shift, res):
    return adaln_modulate(x, scale, shift, residual=res, return_residual=True)


@pytest.mark.parametrize("case", list(ADALN_CASES))
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("mode", MODES)
def bench_adaln_modulate(case, dtype_name, mode, bench_recorder):
    bsz, t, c = ADALN_CASES[case]
    dtype, grad = DTYPES[dtype_name], mode == "fwd+bwd"
    x, res = (torch.randn(bsz, t, c, device=DEVICE, dtype=dtype, requires_grad=grad) for _ in range(2))
    # scale/shift as strided chunks of one embedding, as AdaLayerNormZero hands them over.
    emb = torch.randn(bsz, 6 * c, device=DEVICE, dtype=dtype)
    shift, scale = (t.requires_grad_(grad) for t in emb.chunk(6, dim=1)[:2])
    # "ldmopt": the backend ldmopt chooses itself, ldmopt._C's kernel (forward) where the extension is built
    providers = {"ldmopt": _default(_ldmopt_adaln), "ldmopt-triton-pass": _triton(_ldmopt_adaln), "eager": _eager_adaln}
    providers = _with_compile(providers, _eager_adaln, True)
    elem = x.numel() * x.element_size()
    nbytes = 4 * elem if mode == "fwd" else 8 * elem
    _measure(bench_recorder, "adaln_modulate", case, dtype_name, mode, providers, (x, scale, shift, res),
             (x, scale, shift, res), nbytes=nbytes)  # fmt: skip


def _norm_params(c, dtype, grad):
    nw = (1 + 0.2 * torch.randn(c, device=DEVICE)).to(dtype).requires_grad_(grad)
    nb = (0.1 * torch.randn(c, device=DEVICE)).to(dtype).requires_grad_(grad)
    return nw, nb


def _eager_ln_qkv(x, nw, nb, wq, wk, wv):
    h = F.layer_norm(x, x.shape[-1:], nw, nb)
    return F.linear(h, wq), F.linear(h, wk), F.linear(h, wv)


def _ldmopt_ln_qkv(x, nw, nb, wq, wk, wv):
    stats = layer_norm_stats(x)
    return tuple(layer_norm_linear(x, nw, nb, w, stats=stats) for w in (wq, wk, wv))


@pytest.mark.parametrize("case", list(LN_QKV_CASES))
@pytest.mark.parametrize("dtype_name", ["fp16"])
@pytest.mark.parametrize("mode", MODES)
def bench_layer_norm_qkv(case, dtype_name, mode, bench_recorder):
    """A UNet block's norm1 -> to_q, to_k, to_v (no bias): the norm read in the three GEMMs' loads."""
    m, c = LN_QKV_CASES[case]
    dtype, grad = DTYPES[dtype_name], mode == "fwd+bwd"
    x = torch.randn(m, c, device=DEVICE, dtype=dtype, requires_grad=grad)
    weights = [_params(1, c, c, dtype, grad)[1] for _ in range(3)]
    inputs = (x, *_norm_params(c, dtype, grad), *weights)
    providers = {"ldmopt": _default(_ldmopt_ln_qkv), "ldmopt-triton-gemm": _triton_gemm(_ldmopt_ln_qkv)}
    providers["eager"] = _eager_ln_qkv
    providers = _with_compile(providers, _eager_ln_qkv, case == next(iter(LN_QKV_CASES)))
    flops = 3 * 2 * m * c * c * (1 if mode == "fwd" else 3)
    _measure(bench_recorder, "layer_norm_qkv", case, dtype_name, mode, providers, inputs, inputs, flops=flops)


def _eager_ln_geglu(x, nw, nb, w, b):
    return _eager_geglu(F.layer_norm(x, x.shape[-1:], nw, nb), w, b)


def _ldmopt_ln_geglu(x, nw, nb, w, b):
    return layer_norm_linear(x, nw, nb, w, b, activation="geglu")


def _ldmopt_geglu_after_ln(x, nw, nb, w, b):
    return geglu(F.layer_norm(x, x.shape[-1:], nw, nb), w, b)


@pytest.mark.parametrize("case", list(LN_GEGLU_CASES))
@pytest.mark.parametrize("dtype_name", ["fp16"])
@pytest.mark.parametrize("mode", MODES)
def bench_layer_norm_geglu(case, dtype_name, mode, bench_recorder):
    """A UNet block's norm3 -> GEGLU: the norm read in the dual-accumulator GEMM's loads vs written first."""
    m, c, i = LN_GEGLU_CASES[case]
    dtype, grad = DTYPES[dtype_name], mode == "fwd+bwd"
    x, w, b = _params(m, c, 2 * i, dtype, grad)
    inputs = (x, *_norm_params(c, dtype, grad), w, b)
    providers = {
        "ldmopt": _default(_ldmopt_ln_geglu),
        "ldmopt-triton-gemm": _triton_gemm(_ldmopt_ln_geglu),
        "ldmopt-geglu-after-norm": _default(_ldmopt_geglu_after_ln),
        "eager": _eager_ln_geglu,
    }
    providers = _with_compile(providers, _eager_ln_geglu, case == next(iter(LN_GEGLU_CASES)))
    flops = 2 * m * c * 2 * i * (1 if mode == "fwd" else 3)
    _measure(bench_recorder, "layer_norm_geglu", case, dtype_name, mode, providers, inputs, inputs, flops=flops)
