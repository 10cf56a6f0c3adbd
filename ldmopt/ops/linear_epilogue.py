"""The fused linear layers' epilogue pass after a GEMM cuBLAS ran (the "cublas" placement, ops/linear_cublas.py).

``y = residual + gate[row // T] * act(z)`` or GEGLU's ``z[:, :N] * gelu(z[:, N:])``, Flux's fp16 clamp, and the
LayerNorm statistics of y's rows for the norm that reads y next, in one pass over the GEMM output z. Internal: a
step of the linear, GEGLU and normalised-GEMM ops' triton backends (never traced by itself), chosen like any op:

- cuda: ldmopt._C's ``linear_epilogue_cuda`` (csrc/linear_epilogue), one C++ op call, a fraction of a Triton launch's
  host time; one warp a row, so the statistics need no fp64 workspace, no atomics and no zeroing launches. It takes
  one dtype for every tensor (z, y, gate, residual) with unit column strides, and a GLU only with GELU;
- triton: kernels/linear_epilogue.py's launch, any of those.

Both compute in fp32 and round once, and take the statistics from the values as stored; they agree to rounding (the
statistics: a warp's fp32 Welford against column tiles' fp64 sums).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._dispatch import Backend, BackendTable, cuda_extension_refusals

#: what ldmopt._C's kernel takes (csrc/linear_epilogue/launch.h)
CUDA_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
CUDA_ACTIVATIONS = (None, "silu", "gelu", "gelu_tanh")


def writes(activation: str | None, gate, residual, dtype: torch.dtype, z: Tensor, glu: bool, saturate: bool) -> bool:
    """Whether the pass writes y at all: without anything to apply it only reads z's statistics (or is not run)."""
    return glu or activation is not None or gate is not None or residual is not None or saturate or dtype != z.dtype


def _epilogue_triton(z, activation, gate, residual, dtype, glu, saturate, in_place, out_stats, out_eps):
    from ldmopt.kernels.linear_epilogue import linear_epilogue as launch

    return launch(z, activation, gate, residual, dtype, glu=glu, saturate=saturate, in_place=in_place,
                  out_stats=out_stats, out_eps=out_eps)  # fmt: skip


def _epilogue_cuda(z, activation, gate, residual, dtype, glu, saturate, in_place, out_stats, out_eps):
    from ldmopt.kernels._common import new_output  # the triton backend calling this pass has Triton

    m = z.shape[0]
    n = z.shape[1] // 2 if glu else z.shape[1]
    write = writes(activation, gate, residual, dtype, z, glu, saturate)
    if in_place and glu:
        raise ValueError("linear_epilogue: a GLU's output cannot be written into its [M, 2N] input")
    y = z if in_place or not write else new_output((m, n), device=z.device, dtype=dtype)
    torch.ops.ldmopt.linear_epilogue_cuda(
        z, y, gate, residual, out_stats, activation or "", glu, saturate, write, float(out_eps)
    )
    return y


def _unit_columns(t: Tensor) -> bool:
    return t.shape[-1] <= 1 or t.stride(-1) == 1


def cuda_refusals(z, activation, gate, residual, dtype, glu, saturate, in_place, out_stats, out_eps) -> list[str]:
    """What csrc/linear_epilogue refuses (its TORCH_CHECKs stay as the last guard)."""
    reasons = cuda_extension_refusals("linear_epilogue_cuda", z, gate, residual, out_stats)
    if reasons:
        return reasons
    if z.dtype not in CUDA_DTYPES:
        reasons.append(f"z dtype {z.dtype} (the CUDA kernel serves fp32/fp16/bf16)")
    if dtype != z.dtype:
        reasons.append(f"output dtype {dtype} differs from the GEMM output's {z.dtype} (the CUDA kernel keeps z's)")
    for name, t in (("gate", gate), ("residual", residual)):
        if t is not None and t.dtype != z.dtype:
            reasons.append(f"{name} dtype {t.dtype} differs from the GEMM output's {z.dtype}")
    for name, t in (("z", z), ("gate", gate), ("residual", residual)):
        if t is not None and not _unit_columns(t):
            reasons.append(f"{name} strides {t.stride()}: the CUDA kernel reads rows with unit column stride")
    if activation not in CUDA_ACTIVATIONS or (glu and activation != "gelu"):
        reasons.append(f"activation {activation!r}{' with a GLU' if glu else ''} (the CUDA kernel: none, silu, gelu, "
                       "gelu_tanh; a GLU with gelu)")  # fmt: skip
    if out_stats is not None and (out_stats.dtype != torch.float32 or not out_stats.is_contiguous()):
        reasons.append(f"statistics buffer {out_stats.dtype} with strides {out_stats.stride()} (contiguous fp32)")
    return reasons


EPILOGUE = BackendTable(
    "linear_epilogue",
    [Backend("cuda", _epilogue_cuda, cuda_refusals), Backend("triton", _epilogue_triton)],
)


def linear_epilogue(z: Tensor, activation: str | None, gate: Tensor | None, residual: Tensor | None,
                    dtype: torch.dtype, *, glu: bool = False, saturate: bool = False, in_place: bool = False,
                    out_stats: Tensor | None = None, out_eps: float = 1e-5) -> Tensor:  # fmt: skip
    """y [M, N] in ``dtype`` from the GEMM output z (see kernels/linear_epilogue.linear_epilogue, which this
    dispatches to or stands in for); z itself when there is nothing to apply and no statistics to take."""
    if not writes(activation, gate, residual, dtype, z, glu, saturate) and out_stats is None:
        return z
    return EPILOGUE(z, activation, gate, residual, dtype, glu, saturate, in_place, out_stats, out_eps)
