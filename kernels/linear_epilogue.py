"""The fused linear layer's epilogue as a pass of its own, after a GEMM cuBLAS ran (the "cublas" GEMM placement).

``y = residual + gate[row // T] * act(z)`` over a GEMM output z [M, N] (its bias already added), or, for a gated
linear unit (GLU: GEGLU), ``y = z[:, :N] * act(z[:, N:])`` over z [M, 2N]; then the clamp of Flux's fp16 stream
(SATURATE) and, from the values as stored, the LayerNorm statistics of y's rows for the norm that reads y next. y may
be z itself (written in place: each program reads its tile before it writes it). With nothing to apply, a producer
asking only for statistics, the pass only reads. The gate, residual, clamp and statistics code is the fused GEMM's own
(kernels/linear.gated_residual, kernels/_gemm.row_statistics), so both placements round and sum alike after the GEMM.

Why a separate pass at all: the measured Triton GEMMs ran slower than cuBLAS at diffusion shapes (benchmarks/
RESULTS.md, H200, 2026-12-04: the GEGLU GEMM 0.26x cuBLAS at SDXL's feed-forward, the linear + GELU 0.66x at
PixArt's), so on GPUs the GEMM stays cuBLAS's and ldmopt fuses what follows it: one elementwise pass where diffusers
runs two to four (GEGLU's gelu and product; the gate's product and the residual's add; a statistics pass).
fp32/fp16/bf16; fp32 math; int64 row offsets.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ldmopt._env import interpreter_enabled
from ldmopt.ops.linear_epilogue import writes

from ._common import ACTIVATIONS, LAUNCH_OPTIONS, cdiv, new_output, next_power_of_2
from ._gemm import int64_columns, row_statistics, row_stats_workspace
from .linear import gate_residual_args, gated_residual

#: elements per tile: 32 fp32 values per thread at 4 warps
_TILE = 4096


@triton.jit
def _linear_epilogue_kernel(
    y_ptr,  # [M, N] (row stride stride_ym, unit column stride); z itself when written in place
    z_ptr,  # [M, N] or, GLU, [M, 2N] (row stride stride_zm, unit column stride): the GEMM's output, bias included
    gate_ptr,  # [B, N] (strides)
    res_ptr,  # [M, N] or [B', T', N] (strides)
    ws_ptr,  # [M, 2] fp64 (OUT_STATS): per-row sums, zeroed by the launcher
    counter_ptr,  # [cdiv(M, BLOCK_M)] int32 (OUT_STATS): finished column tiles per row tile, zeroed by the launcher
    out_stats_ptr,  # [2, M] fp32 (OUT_STATS): the output rows' LayerNorm mean, then their rstd
    stride_ym,
    stride_zm,
    stride_gb,
    stride_gn,
    stride_rb,
    stride_rt,
    stride_rn,
    M,
    N,
    T,  # rows per gate row
    RES_T,  # residual rows per stride_rb step (RESIDUAL_3D)
    sat_max,
    out_eps,
    ACTIVATION: tl.constexpr,
    GLU: tl.constexpr,  # y = z[:, :N] * ACTIVATION(z[:, N:])
    HAS_GATE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    RESIDUAL_3D: tl.constexpr,
    SATURATE: tl.constexpr,
    WRITE: tl.constexpr,  # False: only the statistics of z as it is
    OUT_STATS: tl.constexpr,
    INT64_COLS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    n_nt = tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    pid_m = pid // n_nt
    pid_n = pid % n_nt
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    mask = m_ok[:, None] & (rn < N)[None, :]
    rm64 = rm.to(tl.int64)
    z_ptrs = z_ptr + rm64[:, None] * stride_zm + rn[None, :]
    z = tl.load(z_ptrs, mask=mask, other=0.0).to(tl.float32)
    if GLU:  # the value half times the activated gate half, as diffusers' GEGLU
        out = z * ACTIVATION(tl.load(z_ptrs + N, mask=mask, other=0.0).to(tl.float32))
    else:
        out = ACTIVATION(z)
    # the gate row by an int32 division (rows < 2^31): an int64 one takes a stack frame on sm_90 here
    sample = (rm // T).to(tl.int64)
    out = gated_residual(out, rm, rn, sample, mask, gate_ptr, stride_gb, stride_gn, res_ptr, stride_rb, stride_rt,
                         stride_rn, RES_T, sat_max, HAS_GATE, HAS_RESIDUAL, RESIDUAL_3D, SATURATE,
                         INT64_COLS)  # fmt: skip
    out = out.to(y_ptr.dtype.element_ty)
    if WRITE:
        tl.store(y_ptr + rm64[:, None] * stride_ym + rn[None, :], out, mask=mask)
    if OUT_STATS:
        row_statistics(out, mask, rm, m_ok, pid_m, pid_n, ws_ptr, counter_ptr, out_stats_ptr, M, N, out_eps, BLOCK_N)


def _gpu_tile(n: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) on a GPU: a row's columns in few tiles (its statistics need every one), the rows filling the
    rest of _TILE."""
    block_n = min(next_power_of_2(n), 128)
    return max(16, _TILE // block_n), block_n


def _tile(n: int) -> tuple[int, int]:
    """:func:`_gpu_tile`, or one larger tile in the interpreter, whose cost is per program."""
    block_m, block_n = _gpu_tile(n)
    return (min(block_m * 4, 256), block_n) if interpreter_enabled() else (block_m, block_n)


def linear_epilogue(
    z: torch.Tensor,
    activation: str | None,
    gate: torch.Tensor | None,
    residual: torch.Tensor | None,
    dtype: torch.dtype,
    *,
    glu: bool = False,
    saturate: bool = False,
    in_place: bool = False,
    out_stats: torch.Tensor | None = None,
    out_eps: float = 1e-5,
) -> torch.Tensor:
    """y = residual + gate[row // T] * act(z) (or, ``glu``, z[:, :N] * act(z[:, N:])) as [M, N] in ``dtype``, from
    the GEMM output z [M, N] ([M, 2N] with glu; unit column stride), written into z when ``in_place`` (same dtype, not
    glu); gate [B, N] with M % B == 0 and residual [M, N] or [B', T', N] as kernels/linear.linear_fwd takes them.
    saturate: y clamped to its dtype's finite range before the rounding. out_stats: a [2, M] fp32 tensor (row stride
    M) that receives y's rows' LayerNorm mean and rstd (``out_eps``). Nothing to apply and no statistics: z itself."""
    m = z.shape[0]
    n = z.shape[1] // 2 if glu else z.shape[1]
    if z.stride(1) != 1:
        z = z.contiguous()  # cuBLAS's output has unit column stride already
    write = writes(activation, gate, residual, dtype, z, glu, saturate)
    if not write and out_stats is None:
        return z
    if in_place and (glu or dtype != z.dtype):
        raise ValueError(f"linear_epilogue: in place needs y in z's dtype {z.dtype} and no GLU (dtype {dtype})")
    y = z if in_place or not write else new_output((m, n), device=z.device, dtype=dtype)
    block_m, block_n = _tile(n)
    if out_stats is not None:
        ws, counters = row_stats_workspace(z.device, m, cdiv(m, block_m))
    else:
        ws = counters = out_stats = torch.empty(0, device=z.device)
    gs, rs, tokens, res_t = gate_residual_args(m, gate, residual)
    _linear_epilogue_kernel[(cdiv(m, block_m) * cdiv(n, block_n),)](
        y, z, gate if gate is not None else z, residual if residual is not None else z, ws, counters, out_stats,
        y.stride(0), z.stride(0), gs[0], gs[1], rs[0], rs[1], rs[2], m, n,
        tokens, res_t, torch.finfo(y.dtype).max, float(out_eps),
        ACTIVATION=ACTIVATIONS[activation][0], GLU=glu, HAS_GATE=gate is not None, HAS_RESIDUAL=residual is not None,
        RESIDUAL_3D=residual is not None and residual.dim() == 3, SATURATE=saturate, WRITE=write,
        OUT_STATS=out_stats.numel() > 0, INT64_COLS=int64_columns(gate, residual), BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=4,
        **LAUNCH_OPTIONS,
    )  # fmt: skip
    return y


def _spec(name: str, dtype: str, n: int, activation: str | None, **flags) -> dict:
    from ._gemm import divisibility_attrs

    block_m, block_n = _gpu_tile(n)
    ptr = f"*{dtype}"
    signature = {
        "y_ptr": ptr, "z_ptr": ptr, "gate_ptr": ptr, "res_ptr": ptr, "ws_ptr": "*fp64", "counter_ptr": "*i32",
        "out_stats_ptr": "*fp32", "stride_ym": "i32", "stride_zm": "i32", "stride_gb": "i32", "stride_gn": "i32",
        "stride_rb": "i32", "stride_rt": "i32", "stride_rn": "i32", "M": "i32", "N": "i32", "T": "i32",
        "RES_T": "i32", "sat_max": "fp32", "out_eps": "fp32",
    }  # fmt: skip
    constexprs = {
        "stride_gn": 1, "stride_rn": 1, "ACTIVATION": ACTIVATIONS[activation][0], "GLU": False, "HAS_GATE": False,
        "HAS_RESIDUAL": False, "RESIDUAL_3D": False, "SATURATE": False, "WRITE": True, "OUT_STATS": False,
        "INT64_COLS": False, "BLOCK_M": block_m, "BLOCK_N": block_n, **flags,
    }  # fmt: skip
    attrs = divisibility_attrs(_linear_epilogue_kernel, signature, constexprs, skip=("M", "T", "RES_T"))
    return dict(name=name, fn=_linear_epilogue_kernel, signature=signature, constexprs=constexprs, attrs=attrs,
                num_warps=4)  # fmt: skip


def aot_specs() -> list[dict]:
    """Compile configurations for the ahead-of-time gate: GEGLU's GLU pass, GELU-tanh, the gated residual on a 3-D
    residual, the residual with its row statistics, a statistics-only read, Flux's saturated fp16 stream, fp32."""
    gate_residual = {"HAS_GATE": True, "HAS_RESIDUAL": True}
    return [
        _spec("linear_epilogue[fp16,geglu]", "fp16", 1280, "gelu", GLU=True),
        _spec("linear_epilogue[bf16,geglu]", "bf16", 5120, "gelu", GLU=True),
        _spec("linear_epilogue[fp16,gelu_tanh]", "fp16", 4608, "gelu_tanh"),
        _spec("linear_epilogue[bf16,gate+residual 3-D]", "bf16", 1152, None, **gate_residual, RESIDUAL_3D=True),
        _spec("linear_epilogue[fp16,residual+row stats]", "fp16", 320, None, HAS_RESIDUAL=True, OUT_STATS=True),
        _spec("linear_epilogue[bf16,row stats only]", "bf16", 640, None, WRITE=False, OUT_STATS=True),
        _spec("linear_epilogue[fp16,gate+residual,saturate]", "fp16", 3072, None, **gate_residual, SATURATE=True),
        _spec("linear_epilogue[fp32,gelu,gate+residual+stats]", "fp32", 1152, "gelu", **gate_residual, OUT_STATS=True),
    ]
