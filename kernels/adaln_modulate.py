"""adaLN modulation: ``s = x (+ residual)`` or the gated ``s = residual + gate[b] * x``, ``y = layer_norm(s) * (1 +
scale[b]) + shift[b]`` (LayerNorm without affine parameters), forward and backward, in one row kernel each.

Layout: x and residual are addressed as [M, C] rows with arbitrary strides (M = samples x tokens); scale and shift are
[B, C] (and gate) with arbitrary strides, applied to row m through sample b = m // T (T = M / B). Outputs y (and the
residual sum s when asked) are fresh contiguous [M, C] in y's dtype, to which the sum is rounded before the norm reads
it; mean/rstd are fp32 [M]. fp32/fp16/bf16 in and out (inputs may differ), statistics in fp32 over the whole row held
in registers (C <= MAX_C), int64 row offsets; column offsets int64 too when some operand's reach 2^31 (INT64_COLS: a
column-strided view such as an NCHW map read as [HW, C]).
Algorithm: forward reads each row once (centred two-pass variance in registers). Backward, per chunk of rows of one
sample: dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) with g = dy * (1 + scale[b]), plus per-chunk column sums of
dy (d shift) and dy * xhat (d scale); with a gate, d residual = ds, d x = ds * gate[b] and per-chunk column sums of
ds * x (d gate).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import LAUNCH_OPTIONS, cdiv, new_output, next_power_of_2, row_moments, row_tiles
from ._gemm import divisibility_attrs, int64_columns, row_chunks

#: Widest row a program holds in registers; wider rows are refused (the op falls back to the torch backend).
MAX_C = 8192
#: The gated backward holds a third column sum: fp32 rows wider than this would spill on sm_80 (bf16 fits to MAX_C).
MAX_GATED_FP32_BWD_C = 4096


@triton.jit
def _adaln_fwd_kernel(
    y_ptr,  # [M, C] contiguous
    sum_ptr,  # [M, C] contiguous: x + residual, written when STORE_SUM
    mean_ptr,  # [M] fp32
    rstd_ptr,  # [M] fp32
    x_ptr,
    res_ptr,
    gate_ptr,  # [B, C] (HAS_GATE)
    scale_ptr,  # [B, C]
    shift_ptr,  # [B, C]
    stride_xm,
    stride_xc,
    stride_rm,
    stride_rc,
    stride_gb,
    stride_gc,
    stride_scb,
    stride_scc,
    stride_shb,
    stride_shc,
    M,
    C,
    T,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    HAS_GATE: tl.constexpr,
    STORE_SUM: tl.constexpr,
    STORE_STATS: tl.constexpr,
    INT64_COLS: tl.constexpr,  # int64_columns(): some operand's column offsets reach 2^31
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    if INT64_COLS:  # a column stride (a channel of an NCHW map read as [HW, C]) times C can pass 2^31
        c_idx = c.to(tl.int64)
    else:  # int32 offsets are exact: fewer registers
        c_idx = c
    r_ok = rows < M
    c_ok = c < C
    mask = r_ok[:, None] & c_ok[None, :]
    sample = rows // T
    x = tl.load(x_ptr + rows[:, None] * stride_xm + c_idx[None, :] * stride_xc, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + rows[:, None] * stride_rm + c_idx[None, :] * stride_rc, mask=mask, other=0.0)
        if HAS_GATE:
            g = tl.load(gate_ptr + sample[:, None] * stride_gb + c_idx[None, :] * stride_gc, mask=mask, other=0.0)
            x = r.to(tl.float32) + g.to(tl.float32) * x.to(tl.float32)
        else:
            x = x.to(tl.float32) + r.to(tl.float32)
        # Round the sum to the output dtype first, as the unfused add does: the norm sees what is returned.
        x = x.to(y_ptr.dtype.element_ty)
        if STORE_SUM:
            tl.store(sum_ptr + rows[:, None] * C + c[None, :], x, mask=mask)
    x = x.to(tl.float32)
    mean, var = row_moments(x, mask, C)
    centred = tl.where(mask, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(var + eps)
    sc = tl.load(scale_ptr + sample[:, None] * stride_scb + c_idx[None, :] * stride_scc, mask=mask, other=0.0)
    sh = tl.load(shift_ptr + sample[:, None] * stride_shb + c_idx[None, :] * stride_shc, mask=mask, other=0.0)
    y = centred * rstd[:, None] * (1.0 + sc.to(tl.float32)) + sh.to(tl.float32)
    tl.store(y_ptr + rows[:, None] * C + c[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    if STORE_STATS:
        tl.store(mean_ptr + rows, mean, mask=r_ok)
        tl.store(rstd_ptr + rows, rstd, mask=r_ok)


@triton.jit
def _adaln_bwd_kernel(
    dx_ptr,  # [M, C] contiguous: the gradient of s (of x, and of the residual)
    dxg_ptr,  # [M, C] contiguous: the gradient of the gated x, ds * gate[b] (HAS_GATE)
    part_dscale_ptr,  # [B * n_chunks, C] fp32
    part_dshift_ptr,  # [B * n_chunks, C] fp32
    part_dgate_ptr,  # [B * n_chunks, C] fp32 (HAS_GATE)
    dy_ptr,
    s_ptr,  # the normalised input (x + residual) [M, C]
    dsum_ptr,  # gradient arriving at the returned residual sum [M, C] (HAS_DSUM)
    xg_ptr,  # the gated input x [M, C] (HAS_GATE)
    gate_ptr,  # [B, C] (HAS_GATE)
    mean_ptr,
    rstd_ptr,
    scale_ptr,
    stride_dym,
    stride_dyc,
    stride_sm,
    stride_sc,
    stride_dsm,
    stride_dsc,
    stride_xgm,
    stride_xgc,
    stride_gb,
    stride_gc,
    stride_scb,
    stride_scc,
    C,
    T,
    ROWS_PER_PROG,
    n_chunks,
    HAS_DSUM: tl.constexpr,
    HAS_GATE: tl.constexpr,
    INT64_COLS: tl.constexpr,  # as in the forward
    SCALE_IS_WEIGHT: tl.constexpr,  # the rows were multiplied by scale itself (a LayerNorm weight), not 1 + scale
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    pid = tl.program_id(0)
    chunk = pid % n_chunks
    sample = (pid // n_chunks).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    if INT64_COLS:
        c_idx = c.to(tl.int64)
    else:
        c_idx = c
    c_ok = c < C
    sc = tl.load(scale_ptr + sample * stride_scb + c_idx * stride_scc, mask=c_ok, other=0.0).to(tl.float32)
    t_begin = chunk * ROWS_PER_PROG
    t_end = tl.minimum(t_begin + ROWS_PER_PROG, T)
    sum_dy = tl.zeros([BLOCK_C], dtype=tl.float32)
    sum_dyxhat = tl.zeros([BLOCK_C], dtype=tl.float32)
    sum_dgate = tl.zeros([BLOCK_C], dtype=tl.float32)
    for t0 in range(t_begin, t_end, BLOCK_R):
        t = t0 + tl.arange(0, BLOCK_R)
        r_ok = t < t_end
        mask = r_ok[:, None] & c_ok[None, :]
        rows = sample * T + t.to(tl.int64)
        dy = tl.load(dy_ptr + rows[:, None] * stride_dym + c_idx[None, :] * stride_dyc, mask=mask, other=0.0)
        dy = dy.to(tl.float32)
        s = tl.load(s_ptr + rows[:, None] * stride_sm + c_idx[None, :] * stride_sc, mask=mask, other=0.0)
        mean = tl.load(mean_ptr + rows, mask=r_ok, other=0.0)
        rstd = tl.load(rstd_ptr + rows, mask=r_ok, other=0.0)
        xhat = tl.where(mask, (s.to(tl.float32) - mean[:, None]) * rstd[:, None], 0.0)
        sum_dy += tl.sum(dy, axis=0)
        sum_dyxhat += tl.sum(dy * xhat, axis=0)
        if SCALE_IS_WEIGHT:
            g = dy * sc[None, :]
        else:
            g = dy * (1.0 + sc[None, :])
        c1 = tl.sum(g, axis=1) / C
        c2 = tl.sum(g * xhat, axis=1) / C
        dx = rstd[:, None] * (g - c1[:, None] - xhat * c2[:, None])
        if HAS_DSUM:
            ds = tl.load(dsum_ptr + rows[:, None] * stride_dsm + c_idx[None, :] * stride_dsc, mask=mask, other=0.0)
            dx += ds.to(tl.float32)
        tl.store(dx_ptr + rows[:, None] * C + c[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if HAS_GATE:
            xg = tl.load(xg_ptr + rows[:, None] * stride_xgm + c_idx[None, :] * stride_xgc, mask=mask, other=0.0)
            sum_dgate += tl.sum(dx * xg.to(tl.float32), axis=0)  # xg is 0 outside the mask
            # Loaded per chunk of rows (a cached [C] row), not held across the loop: at C=5120 that would spill.
            gv = tl.load(gate_ptr + sample * stride_gb + c_idx * stride_gc, mask=c_ok, other=0.0).to(tl.float32)
            dxg = dx * gv[None, :]
            tl.store(dxg_ptr + rows[:, None] * C + c[None, :], dxg.to(dxg_ptr.dtype.element_ty), mask=mask)
    out = (sample * n_chunks + chunk) * C + c
    tl.store(part_dscale_ptr + out, sum_dyxhat, mask=c_ok)
    tl.store(part_dshift_ptr + out, sum_dy, mask=c_ok)
    if HAS_GATE:
        tl.store(part_dgate_ptr + out, sum_dgate, mask=c_ok)


@triton.jit
def _adaln_bwd_sums_kernel(
    dscale_ptr,  # [B, C] fp32
    dshift_ptr,  # [B, C] fp32
    dgate_ptr,  # [B, C] fp32 (HAS_GATE)
    part_ptr,  # [2 or 3, B * n_chunks, C] fp32: the backward's per-chunk sums for d scale, d shift (and d gate)
    C,
    n_chunks,
    stride_part,  # B * n_chunks * C
    HAS_GATE: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    # Every per-chunk column sum of one sample reduced in one launch, instead of one reduction per gradient.
    sample = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < C
    acc_scale = tl.zeros([BLOCK_K, BLOCK_C], dtype=tl.float32)
    acc_shift = tl.zeros([BLOCK_K, BLOCK_C], dtype=tl.float32)
    acc_gate = tl.zeros([BLOCK_K, BLOCK_C], dtype=tl.float32)
    for k0 in range(0, n_chunks, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        mask = (k < n_chunks)[:, None] & c_ok[None, :]
        offs = (sample * n_chunks + k[:, None]) * C + c[None, :]
        acc_scale += tl.load(part_ptr + offs, mask=mask, other=0.0)
        acc_shift += tl.load(part_ptr + stride_part + offs, mask=mask, other=0.0)
        if HAS_GATE:
            acc_gate += tl.load(part_ptr + 2 * stride_part + offs, mask=mask, other=0.0)
    out = sample * C + c
    tl.store(dscale_ptr + out, tl.sum(acc_scale, axis=0), mask=c_ok)
    tl.store(dshift_ptr + out, tl.sum(acc_shift, axis=0), mask=c_ok)
    if HAS_GATE:
        tl.store(dgate_ptr + out, tl.sum(acc_gate, axis=0), mask=c_ok)


#: Columns per program, and elements per accumulator, of the per-chunk sums' reduction.
_SUMS_BLOCK_C = 128
_SUMS_ELEMENTS = 2048


def _sums_tiles(c: int, n_chunks: int) -> tuple[int, int]:
    """(BLOCK_K, BLOCK_C) of _adaln_bwd_sums_kernel."""
    block_c = min(_SUMS_BLOCK_C, next_power_of_2(c))
    return max(1, min(next_power_of_2(n_chunks), _SUMS_ELEMENTS // block_c)), block_c


# ----------------------------------------------------------------------------------------------------------- launchers


def tiles(c: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_C, num_warps): whole rows, at most 16 per tile."""
    return row_tiles(c, 16)


def adaln_fwd(
    x: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    residual: torch.Tensor | None,
    gate: torch.Tensor | None,
    eps: float,
    store_sum: bool,
    store_stats: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, s, mean, rstd): s = x + residual, or residual + gate[b] * x ([M, C], empty unless store_sum), y =
    layer_norm(s) * (1 + scale[b]) + shift[b]; mean/rstd fp32 [M] (empty unless store_stats). x, residual [M, C];
    gate, scale, shift [B, C]; any strides. y and s take x's dtype, the residual's with a gate."""
    m, c = x.shape
    tokens = m // scale.shape[0]
    block_r, block_c, warps = tiles(c)
    dtype = residual.dtype if gate is not None else x.dtype
    y = new_output((m, c), device=x.device, dtype=dtype)
    s = new_output((m, c) if store_sum else (0,), device=x.device, dtype=dtype)
    mean = new_output((m,) if store_stats else (0,), device=x.device, dtype=torch.float32)
    rstd = new_output((m,) if store_stats else (0,), device=x.device, dtype=torch.float32)
    rs = residual.stride() if residual is not None else (0, 0)
    gs = gate.stride() if gate is not None else (0, 0)
    _adaln_fwd_kernel[(cdiv(m, block_r),)](
        y, s, mean, rstd, x, residual if residual is not None else x, gate if gate is not None else scale, scale,
        shift, x.stride(0), x.stride(1), rs[0], rs[1], gs[0], gs[1], scale.stride(0), scale.stride(1),
        shift.stride(0), shift.stride(1), m, c, tokens, eps, HAS_RESIDUAL=residual is not None,
        HAS_GATE=gate is not None, STORE_SUM=store_sum, STORE_STATS=store_stats,
        INT64_COLS=int64_columns(x, residual, gate, scale, shift), BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps,
        **LAUNCH_OPTIONS,
    )  # fmt: skip
    return y, s, mean, rstd


def adaln_bwd(
    dy: torch.Tensor,
    s: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    scale: torch.Tensor,
    dsum: torch.Tensor | None,
    x: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
    scale_is_weight: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ds [M, C] in s's dtype, dscale fp32 [B, C], dshift fp32 [B, C], dx, dgate): ds is the gradient of s, so of the
    residual (and of x without a gate). dsum is the gradient that reached the returned sum s (or None). With a gate
    (x is then the gated input): dx = ds * gate[b] in x's dtype and dgate fp32 [B, C]; both empty without one."""
    m, c = s.shape
    num_samples = scale.shape[0]
    tokens = m // num_samples
    block_r, block_c, warps = tiles(c)
    rows, n_chunks = row_chunks(num_samples, tokens, 1, block_r)
    has_gate = gate is not None
    ds_out = new_output((m, c), device=s.device, dtype=s.dtype)
    dx = new_output((m, c) if has_gate else (0,), device=s.device, dtype=x.dtype if has_gate else s.dtype)
    # the per-chunk sums of every gradient in one buffer, reduced by one launch after the kernel
    parts = torch.empty((3 if has_gate else 2, num_samples * n_chunks, c), device=s.device, dtype=torch.float32)
    part_dscale, part_dshift = parts[0], parts[1]
    part_dgate = parts[2] if has_gate else part_dscale
    dss = dsum.stride() if dsum is not None else (0, 0)
    xs = x.stride() if has_gate else (0, 0)
    gs = gate.stride() if has_gate else (0, 0)
    _adaln_bwd_kernel[(num_samples * n_chunks,)](
        ds_out, dx, part_dscale, part_dshift, part_dgate, dy, s, dsum if dsum is not None else dy,
        x if has_gate else s, gate if has_gate else scale, mean, rstd, scale, dy.stride(0), dy.stride(1),
        s.stride(0), s.stride(1), dss[0], dss[1], xs[0], xs[1], gs[0], gs[1], scale.stride(0), scale.stride(1), c,
        tokens, rows, n_chunks, HAS_DSUM=dsum is not None, HAS_GATE=has_gate,
        INT64_COLS=int64_columns(dy, s, dsum, x, gate, scale), SCALE_IS_WEIGHT=scale_is_weight, BLOCK_R=block_r,
        BLOCK_C=block_c, num_warps=warps,
        **LAUNCH_OPTIONS,
    )  # fmt: skip
    dscale = torch.empty((num_samples, c), device=s.device, dtype=torch.float32)
    dshift = torch.empty_like(dscale)
    dgate = torch.empty_like(dscale) if has_gate else dscale.new_empty((0,))
    block_k, block_c = _sums_tiles(c, n_chunks)
    _adaln_bwd_sums_kernel[(num_samples, cdiv(c, block_c))](
        dscale, dshift, dgate if has_gate else dscale, parts, c, n_chunks, parts.stride(0), HAS_GATE=has_gate,
        BLOCK_K=block_k, BLOCK_C=block_c, num_warps=4,
        **LAUNCH_OPTIONS,
    )  # fmt: skip
    return ds_out, dscale, dshift, dx, dgate


def aot_specs() -> list[dict]:
    """Representative compile configurations for the ahead-of-time gate (sm_80 / sm_90, no GPU needed)."""
    specs = []
    # DiT/PixArt (1152), SD3 (1536), Flux (3072), the widest supported row, and Wan 14B (5120: bf16 stream, fp32
    # modulation and gate, the gated residual add in the kernel).
    for dtype, mod, c, residual, gate in (
        ("fp16", "fp16", 1152, True, False),
        ("bf16", "bf16", 1536, False, False),
        ("bf16", "bf16", 3072, True, False),
        ("fp32", "fp32", MAX_C, True, False),
        ("bf16", "fp32", 5120, True, True),
        ("fp32", "fp32", MAX_GATED_FP32_BWD_C, True, True),
    ):
        block_r, block_c, warps = tiles(c)
        signature = {
            "y_ptr": f"*{dtype}", "sum_ptr": f"*{dtype}", "mean_ptr": "*fp32", "rstd_ptr": "*fp32",
            "x_ptr": f"*{dtype}", "res_ptr": f"*{dtype}", "gate_ptr": f"*{mod}", "scale_ptr": f"*{mod}",
            "shift_ptr": f"*{mod}", "stride_xm": "i32", "stride_xc": "i32", "stride_rm": "i32", "stride_rc": "i32",
            "stride_gb": "i32", "stride_gc": "i32", "stride_scb": "i32", "stride_scc": "i32", "stride_shb": "i32",
            "stride_shc": "i32", "M": "i32", "C": "i32", "T": "i32", "eps": "fp32",
        }  # fmt: skip
        constexprs = {
            "stride_xc": 1, "stride_rc": 1, "stride_gc": 1, "stride_scc": 1, "stride_shc": 1, "HAS_RESIDUAL": residual,
            "HAS_GATE": gate, "STORE_SUM": residual, "STORE_STATS": True, "INT64_COLS": False, "BLOCK_R": block_r,
            "BLOCK_C": block_c,
        }  # fmt: skip
        attrs = divisibility_attrs(_adaln_fwd_kernel, signature, constexprs, skip=("M", "T"))
        specs.append(
            dict(name=f"adaln_fwd[{dtype},C={c},residual={residual},gate={gate}]", fn=_adaln_fwd_kernel,
                 signature=signature, constexprs=constexprs, attrs=attrs, num_warps=warps)
        )  # fmt: skip
        signature = {
            "dx_ptr": f"*{dtype}", "dxg_ptr": f"*{dtype}", "part_dscale_ptr": "*fp32", "part_dshift_ptr": "*fp32",
            "part_dgate_ptr": "*fp32", "dy_ptr": f"*{dtype}", "s_ptr": f"*{dtype}", "dsum_ptr": f"*{dtype}",
            "xg_ptr": f"*{dtype}", "gate_ptr": f"*{mod}", "mean_ptr": "*fp32", "rstd_ptr": "*fp32",
            "scale_ptr": f"*{mod}", "stride_dym": "i32", "stride_dyc": "i32", "stride_sm": "i32", "stride_sc": "i32",
            "stride_dsm": "i32", "stride_dsc": "i32", "stride_xgm": "i32", "stride_xgc": "i32", "stride_gb": "i32",
            "stride_gc": "i32", "stride_scb": "i32", "stride_scc": "i32", "C": "i32", "T": "i32",
            "ROWS_PER_PROG": "i32", "n_chunks": "i32",
        }  # fmt: skip
        constexprs = {
            "stride_dyc": 1, "stride_sc": 1, "stride_dsc": 1, "stride_xgc": 1, "stride_gc": 1, "stride_scc": 1,
            "HAS_DSUM": residual, "HAS_GATE": gate, "INT64_COLS": False, "SCALE_IS_WEIGHT": False,
            "BLOCK_R": block_r, "BLOCK_C": block_c,
        }  # fmt: skip
        attrs = divisibility_attrs(_adaln_bwd_kernel, signature, constexprs, skip=("T", "n_chunks"))
        specs.append(
            dict(name=f"adaln_bwd[{dtype},C={c},dsum={residual},gate={gate}]", fn=_adaln_bwd_kernel,
                 signature=signature, constexprs=constexprs, attrs=attrs, num_warps=warps)
        )  # fmt: skip
        if mod == dtype and not gate:
            # the backward of a LayerNorm read in a GEMM's loads (layer_norm_linear): one "sample", the weight in
            # fp32 (autocast) or in the model's dtype
            for weight_dtype in sorted({"fp32", dtype}):
                specs.append(
                    dict(name=f"adaln_bwd[{dtype},C={c},layer_norm_weight={weight_dtype}]", fn=_adaln_bwd_kernel,
                         signature={**signature, "scale_ptr": f"*{weight_dtype}", "gate_ptr": f"*{weight_dtype}"},
                         constexprs={**constexprs, "HAS_DSUM": False, "SCALE_IS_WEIGHT": True}, attrs=attrs,
                         num_warps=warps)
                )  # fmt: skip
    for gate in (False, True):
        block_k, block_c = _sums_tiles(3072, 256)
        signature = {"dscale_ptr": "*fp32", "dshift_ptr": "*fp32", "dgate_ptr": "*fp32", "part_ptr": "*fp32",
                     "C": "i32", "n_chunks": "i32", "stride_part": "i32"}  # fmt: skip
        constexprs = {"HAS_GATE": gate, "BLOCK_K": block_k, "BLOCK_C": block_c}
        attrs = divisibility_attrs(_adaln_bwd_sums_kernel, signature, constexprs, skip=("n_chunks",))
        specs.append(
            dict(name=f"adaln_bwd_sums[gate={gate}]", fn=_adaln_bwd_sums_kernel, signature=signature,
                 constexprs=constexprs, attrs=attrs, num_warps=4)
        )  # fmt: skip
    return specs
