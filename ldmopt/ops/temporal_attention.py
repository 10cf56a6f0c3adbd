"""Temporal attention: ``softmax(q k^T * scale) v`` along the frame axis F of (B, F, N, H, D) strided views.

Custom ops (all tagged ``needs_exact_strides``: compiled graphs hand them the strides they were traced with):

- ``ldmopt::temporal_attention_fwd(Tensor q, Tensor k, Tensor v, float scale) -> Tensor``
- ``ldmopt::temporal_attention_fwd_out(Tensor q, Tensor k, Tensor v, float scale, Tensor(a!) out) -> ()``
- ``ldmopt::temporal_attention_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, float scale) -> (Tensor, Tensor, Tensor)``

Backends: forward cuda (ldmopt._C) -> triton (kernels/temporal_attention.py) -> torch (reference: explicit math in
fp32, fp64 for fp64 inputs); backward triton -> torch.

The CUDA forward stages each sequence's Q, K, V in shared memory. Its backend refuses (and the call runs on triton)
when that plan, ``cuda_smem_bytes`` (a mirror of launch.h's ``make_plan``), exceeds the device's opt-in limit per
block, read when first needed for each device, never at import: fp32 with F=64 and head_dim=256 needs 217,600 bytes,
over an A100's 166,912 but within an H100/H200's 232,448; fp16/bf16 need 128,000 at most (over sm_86/sm_89's 101,376).
The C++ launch still checks the limit itself.

Conventions every backend follows (the CUDA kernels in csrc/ must match them exactly):

- ``q``, ``k``, ``v``: 5-D, one shape (B, F, N, H, D) (batch, frames = the attention axis, pixels, heads,
  head_dim), one dtype (fp32, fp16 or bf16; fp64 only on the torch backend), one device, ANY strides -- including
  non-dense views such as ``qkv.view(B*N, F, 3, H, D)[:, :, 0:1]`` and a non-unit head-dim stride. Inputs are read
  in place, never copied. The kernels serve F <= 64 and D <= 256 (``MAX_FRAMES``, ``MAX_HEAD_DIM``).
- ``scale``: a Python float, already resolved (the public function turns None into ``D ** -0.5``).
- Forward result: ``out = torch.empty_like(q)`` (ATen ``at::empty_like(q)``, preserve_format: q's strides when q is
  non-overlapping and dense, otherwise the contiguous (B, F, N, H, D) layout), dtype q.dtype, every element written.
  ``torch.ops.ldmopt.temporal_attention_fwd_cuda(q, k, v, scale) -> Tensor`` returns exactly that tensor.
  The optional ``torch.ops.ldmopt.temporal_attention_fwd_out_cuda(q, k, v, scale, out) -> ()`` writes into a
  caller-provided ``out`` of the same shape/dtype/device and any strides; when it is absent, ``out=`` runs on triton.
- Backward result: ``(dq, dk, dv)`` = ``empty_like(q)``, ``empty_like(k)``, ``empty_like(v)``; ``dout`` any strides.
- Math: scores, softmax and accumulation in fp32; fp16/bf16 operands go through the tensor cores with the
  probabilities rounded to the input dtype before the P V product (as FlashAttention does); one rounding of the
  result to the output dtype. Backward rounds the score gradients dS to the input dtype before dQ = dS K and
  dK = dS^T Q (as FlashAttention does): in fp16, where |dS| passes 65504 (output gradients near 2^13 with large
  values), dq and dk overflow sooner than under SDPA's fp32 math backend, and GradScaler skips that step and lowers its
  scale. Grid limits: none in B*N*H (the Triton kernel puts every sequence on grid axis 0).
"""

from __future__ import annotations

import functools
import math
import numbers

import torch
from torch import Tensor

from ._autocast import autocast_operands
from ._checks import check_tensor
from ._dispatch import (
    Backend,
    BackendTable,
    call,
    cuda_extension_refusals,
    register_autograd_keeping_backend,
    register_eager,
    tensors_in,
    triton_refusals,
)

MAX_FRAMES = 64
MAX_HEAD_DIM = 256
#: B*N*H: the Triton kernels index sequences in int32 (program id * sequences per program); kept clear of 2^31.
MAX_SEQUENCES = 2**31 - 1024
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_TAGS = (torch.Tag.needs_exact_strides,)


def _compute_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


# ------------------------------------------------------------------------------------------------ torch reference


def _probs(q, k, scale):
    """(q, k, probabilities) in (B, N, H, F, *) order and the compute dtype."""
    cd = _compute_dtype(q)
    qf, kf = (t.to(cd).permute(0, 2, 3, 1, 4) for t in (q, k))
    return qf, kf, torch.softmax(torch.matmul(qf, kf.transpose(-1, -2)) * scale, dim=-1)


def _fwd_torch_into(q, k, v, scale, out):
    _qf, _kf, p = _probs(q, k, scale)
    o = torch.matmul(p, v.to(p.dtype).permute(0, 2, 3, 1, 4))
    out.copy_(o.permute(0, 3, 1, 2, 4))
    return out


def _fwd_torch(q, k, v, scale):
    return _fwd_torch_into(q, k, v, scale, torch.empty_like(q))


def _bwd_torch(dout, q, k, v, scale):
    qf, kf, p = _probs(q, k, scale)
    vf, dof = (t.to(p.dtype).permute(0, 2, 3, 1, 4) for t in (v, dout))
    dv = torch.matmul(p.transpose(-1, -2), dof)
    dp = torch.matmul(dof, vf.transpose(-1, -2))
    ds = p * (dp - (p * dp).sum(-1, keepdim=True)) * scale
    dq, dk = torch.matmul(ds, kf), torch.matmul(ds.transpose(-1, -2), qf)
    grads = []
    for g, like in ((dq, q), (dk, k), (dv, v)):
        out = torch.empty_like(like)
        out.copy_(g.permute(0, 3, 1, 2, 4))
        grads.append(out)
    return tuple(grads)


# ------------------------------------------------------------------------------------------------ triton / cuda


def _kernel_refusals(*args) -> list[str]:
    """Reasons shared by the triton and cuda kernels (args: q first, then any tensors and floats): dtype, sizes."""
    tensors = tensors_in(args)
    q = tensors[0]
    if q.dim() != 5:  # a direct torch.ops call; the public function checks the rank first
        return [f"q of shape {tuple(q.shape)} (kernels serve 5-D (B, F, N, heads, head_dim))"]
    _b, f, _n, _h, d = q.shape
    reasons = []  # both kernels address in int64: any strides
    if q.dtype not in _KERNEL_DTYPES:
        reasons.append(f"dtype {q.dtype} (kernels serve fp32/fp16/bf16)")
    if f > MAX_FRAMES:
        reasons.append(f"F={f} frames (kernels serve F <= {MAX_FRAMES})")
    if d > MAX_HEAD_DIM:
        reasons.append(f"head_dim={d} (kernels serve head_dim <= {MAX_HEAD_DIM})")
    if _b * _n * _h > MAX_SEQUENCES:
        reasons.append(f"B*N*H={_b * _n * _h} sequences (kernels serve at most {MAX_SEQUENCES})")
    return reasons


def _triton_refuse(q, k, v, *args) -> list[str]:
    return triton_refusals(q, k, v, dtypes=_KERNEL_DTYPES, matmul=True) or _kernel_refusals(q, k, v, *args)


def _bwd_triton_refuse(dout, q, k, v, scale) -> list[str]:
    reasons = _triton_refuse(q, k, v, dout)
    if dout.dtype != q.dtype:  # a direct torch.ops call; autograd hands dout in the output's (q's) dtype
        reasons.append(f"dout of dtype {dout.dtype} with q of {q.dtype} (the kernel multiplies them in one dtype)")
    return reasons


def _fwd_triton(q, k, v, scale):
    from ldmopt.kernels.temporal_attention import temporal_attention_fwd

    return temporal_attention_fwd(q, k, v, scale)


def _fwd_out_triton(q, k, v, scale, out):
    from ldmopt.kernels.temporal_attention import temporal_attention_fwd

    return temporal_attention_fwd(q, k, v, scale, out)


def _bwd_triton(dout, q, k, v, scale):
    from ldmopt.kernels.temporal_attention import temporal_attention_bwd

    return temporal_attention_bwd(dout, q, k, v, scale)


def cuda_smem_bytes(f: int, d: int, dtype: torch.dtype, n_seq: int) -> int:
    """Dynamic shared memory per block of the CUDA forward for F=f, head_dim=d, B*N*H=n_seq sequences (f, d >= 1).

    MUST match ``Plan::smem_bytes`` of ``make_plan`` in csrc/temporal_attention/launch.h (Q, K, V tiles, fp32 scores
    and, for 16-bit types, a separate P, all with padded pitches; as many sequences per block as fit 48 KiB, at most
    16); tests/csrc/test_emulated_kernels.py compares the two over every F and head_dim.
    """
    elem = dtype.itemsize
    pad16 = 16 // elem
    f_pad, d_pad = -(-f // 16) * 16, -(-d // 16) * 16
    per_seq = 3 * f_pad * (d_pad + pad16) * elem + f_pad * (f_pad + 4) * 4
    if elem != 4:
        per_seq += f_pad * (f_pad + pad16) * elem
    per_block = min(max(48 * 1024 // per_seq, 1), 16, max(n_seq, 1))
    return per_seq * per_block


#: The CUDA forward's static shared memory per block (``kStaticSmemBytes`` in launch.h: four int64 offsets for each
#: of up to 16 sequences); it counts against the per-block limit with the dynamic part.
CUDA_STATIC_SMEM_BYTES = 4 * 16 * 8


def cuda_smem_refusals(f: int, d: int, dtype: torch.dtype, n_seq: int, limit: int) -> list[str]:
    """The cuda backend's shared-memory rule: its plan, dynamic and static shared memory together, must fit
    ``limit`` bytes per block (the device's opt-in)."""
    need = cuda_smem_bytes(f, d, dtype, n_seq) + CUDA_STATIC_SMEM_BYTES
    if need <= limit:
        return []
    return [
        f"F={f}, head_dim={d} in {dtype} needs {need} bytes of shared memory per block in the CUDA kernel; this GPU "
        f"allows {limit}"
    ]


@functools.cache
def smem_optin_limit(index: int) -> int:
    """cudaDevAttrMaxSharedMemoryPerBlockOptin of CUDA device ``index``: read on the first call for that device."""
    return torch.cuda.get_device_properties(index).shared_memory_per_block_optin


def _cuda_refusals(symbol, q, k, v, *args) -> list[str]:
    reasons = cuda_extension_refusals(symbol, q, k, v) or _kernel_refusals(q, k, v, *args)
    # The extension rejects a non-finite scale outright (the others return the reference's NaN): let them take it.
    reasons += [f"scale={a} (the CUDA kernel takes finite scales)" for a in args[:1] if not math.isfinite(a)]
    if q.dim() == 5 and (q.shape[1] < 1 or q.shape[4] < 1):  # the extension checks these before its empty return
        reasons.append(f"q of shape {tuple(q.shape)}: the CUDA kernel takes F >= 1 frames and head_dim >= 1")
    if reasons or q.numel() == 0:  # an empty launch returns before the plan is used
        return reasons
    b, f, n, h, d = q.shape
    return cuda_smem_refusals(f, d, q.dtype, b * n * h, smem_optin_limit(q.get_device()))


def _cuda_refuse(symbol):
    return lambda q, k, v, *args: _cuda_refusals(symbol, q, k, v, *args)


FORWARD = BackendTable(
    "temporal_attention",
    [
        Backend("cuda", lambda q, k, v, scale: torch.ops.ldmopt.temporal_attention_fwd_cuda(q, k, v, scale),
                _cuda_refuse("temporal_attention_fwd_cuda")),
        Backend("triton", _fwd_triton, _triton_refuse),
        Backend("torch", _fwd_torch),
    ],
)  # fmt: skip
FORWARD_OUT = BackendTable(
    "temporal_attention_out",
    [
        Backend("cuda", lambda *a: torch.ops.ldmopt.temporal_attention_fwd_out_cuda(*a),
                _cuda_refuse("temporal_attention_fwd_out_cuda")),
        Backend("triton", _fwd_out_triton, _triton_refuse),
        Backend("torch", _fwd_torch_into),
    ],
)  # fmt: skip
BACKWARD = BackendTable(
    "temporal_attention_backward",
    [
        Backend("triton", _bwd_triton, _bwd_triton_refuse),
        Backend("torch", _bwd_torch),
    ],
)


# ------------------------------------------------------------------------------------------------ custom ops


@torch.library.custom_op("ldmopt::temporal_attention_fwd", mutates_args=(), tags=_TAGS)
def temporal_attention_fwd(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """softmax(q k^T * scale) v along dim 1 of (B, F, N, H, D) views; the result is ``torch.empty_like(q)``."""
    return FORWARD(q, k, v, scale)


@temporal_attention_fwd.register_fake
def _(q, k, v, scale):
    return torch.empty_like(q)


@torch.library.custom_op("ldmopt::temporal_attention_fwd_out", mutates_args=("out",), tags=_TAGS)
def temporal_attention_fwd_out(q: Tensor, k: Tensor, v: Tensor, scale: float, out: Tensor) -> None:
    """Like temporal_attention_fwd, written into ``out`` (any strides)."""
    FORWARD_OUT(q, k, v, scale, out)


@temporal_attention_fwd_out.register_fake
def _(q, k, v, scale, out):
    return None


@torch.library.custom_op("ldmopt::temporal_attention_bwd", mutates_args=(), tags=_TAGS)
def temporal_attention_bwd(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv), each ``torch.empty_like`` its input; the F x F scores are recomputed, nothing is saved."""
    dq, dk, dv = BACKWARD(dout, q, k, v, scale)
    return dq, dk, dv


@temporal_attention_bwd.register_fake
def _(dout, q, k, v, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, scale = inputs
    ctx.save_for_backward(q, k, v)
    ctx.scale = scale


def _backward(ctx, dout):
    q, k, v = ctx.saved_tensors
    dq, dk, dv = call(temporal_attention_bwd, dout, q, k, v, ctx.scale)
    return dq, dk, dv, None


register_autograd_keeping_backend(temporal_attention_fwd, _backward, _setup_context)
register_eager(temporal_attention_fwd_out, mutated=(4,))
register_eager(temporal_attention_bwd)


# ------------------------------------------------------------------------------------------------ public function


def _check_inputs(q, k, v, scale, out) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, ndim=(5,))
    for name, t in (("k", k), ("v", v)):
        if t.shape != q.shape:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)} but q has {tuple(q.shape)}; q, k, v must share one shape "
                "(B, F, N, heads, head_dim) (self-attention over F, or cross-attention with as many keys as queries)"
            )
        if t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but q has {q.dtype}; q, k, v must share one dtype")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)):
        raise TypeError(f"scale must be a float or None (head_dim ** -0.5), got {scale!r}")
    if out is None:
        return
    check_tensor("out", out, ndim=(5,))
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(
            f"out has shape {tuple(out.shape)}, {out.dtype} on {out.device}; expected {tuple(q.shape)}, {q.dtype} "
            f"on {q.device}"
        )
    # 1: some elements share memory (a stride-0 expand), so every writer of one would race (a kernel writes each once)
    if not torch.compiler.is_compiling() and torch._debug_has_internal_overlap(out) == 1:
        raise ValueError(
            f"out (strides {out.stride()}) has elements that share memory; pass a tensor with one location per element"
        )
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, out)):
        raise RuntimeError(
            "temporal_attention(..., out=...) does not support automatic differentiation: q, k or v requires grad; "
            "call it without out= (the result is then torch.empty_like(q)) or under torch.no_grad()"
        )


def temporal_attention(
    q: Tensor, k: Tensor, v: Tensor, *, scale: float | None = None, out: Tensor | None = None
) -> Tensor:
    """Attention over frames: ``out[b, :, n, h] = softmax(q[b, :, n, h] @ k[b, :, n, h]^T * scale) @ v[b, :, n, h]``.

    q, k, v are (B, F, N, heads, head_dim) tensors with any strides, read in place (no ``.contiguous()`` copies):
    diffusers' (B*N, F, C) activations as ``x.view(B*N, F, 1, heads, head_dim)``, a (B, F, N, C) activation as
    ``x.view(B, F, N, heads, head_dim)``, a fused to_qkv output as ``qkv.view(B*N, F, 3, heads, head_dim)`` sliced
    with ``[:, :, i:i+1]``. ``scale`` defaults to ``head_dim ** -0.5``. The result is written into ``out`` when
    given (any layout; no autograd), else into ``torch.empty_like(q)`` -- q's layout when q is dense, else the
    contiguous (B, F, N, heads, head_dim) layout. Differentiable in q, k, v.

    Kernels serve F <= 64, head_dim <= 256, fp32/fp16/bf16 on CUDA (or CPU with TRITON_INTERPRET=1); other inputs run
    on the torch reference. Scores, softmax and accumulation are fp32. Tolerance versus an fp64 reference: within
    2x the error of PyTorch's own F.scaled_dot_product_attention in the input dtype (plus a small floor). Under
    torch.autocast q, k and v are first cast to the autocast dtype, as F.scaled_dot_product_attention casts them (q/k
    from an fp32 norm beside an fp16 v, say).
    """
    q, k, v = autocast_operands(q, k, v)
    _check_inputs(q, k, v, scale, out)
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    if out is None:
        return call(temporal_attention_fwd, q, k, v, scale)
    call(temporal_attention_fwd_out, q, k, v, scale, out)
    return out
