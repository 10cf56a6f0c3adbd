"""CUDA C++ backend (ldmopt._C) versus the Triton backend and an fp64 reference, then both timed side by side.

Part 1, correctness: at the GroupNorm(+SiLU) benchmark shapes (benchmarks/bench_group_norm.py; forward and
backward, and the statistics and the normalisation from given statistics alone, as the fused conv runs them, also
over an up block's two parts), at the LayerNorm row statistics and the LayerNorm applied from them at real
transformer widths, at the fused linear layers' passes after cuBLAS's GEMM (GEGLU, GELU-tanh, gated residual with row
statistics, Flux's clamp) and the fused convs' after cuDNN's conv (temb with GroupNorm statistics, shortcut and
residual with channel sums), at the DiT-class adaLN norms (DiT, PixArt, Flux, Wan's gated residual), and at real
temporal-attention shapes (AnimateDiff, SVD, Latte), each backend's outputs against the reference computed in fp64,
as max relative error ||out - ref||_inf / ||ref||_inf with PASS/FAIL against a per-dtype bound. Outputs are
poisoned with NaN first (LDMOPT_POISON_OUTPUTS=1), so an unwritten element fails.
Part 2, speed: harness.time_fn for ldmopt-cuda, ldmopt-triton and PyTorch eager on the same inputs (poisoning off);
rows go to the harness CSV (ops named ``cuda_check/<op>``) and a side-by-side table (cuda / triton time ratio, % of
measured copy bandwidth) is printed. run_gpu.sh runs part 1 only (``--no-bench``): the benchmarks time the same
providers. Issue targets on an H200: GroupNorm+SiLU >= 85% of copy bandwidth; temporal attention no slower than Triton.

Run on a GPU: python benchmarks/check_cuda_backend.py [--quick] [--no-bench]. Exits 1 if a check fails; on a
machine without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import traceback
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F

import ldmopt
from benchmarks.check_cuda_backend_ops import (
    GROUPS,
    _attention_reference,
    _eager_attention,
    _eager_epilogue,
    _eager_group_norm,
    _epilogue_reference,
    _ldmopt_attention,
    _ldmopt_conv_epilogue,
    _ldmopt_epilogue,
    _ldmopt_group_norm,
)
from benchmarks.check_cuda_backend_shapes import (
    ADALN_SHAPES,
    ATTENTION_SHAPES,
    CONV_EPILOGUE_SHAPES,
    EPILOGUE_SHAPES,
    FROM_SUMS_SHAPES,
    LAYER_NORM_SHAPES,
    QUICK_ADALN,
    QUICK_ATTENTION,
    QUICK_CONV_EPILOGUE,
    QUICK_EPILOGUE,
    QUICK_FROM_SUMS,
    QUICK_GROUP_NORM,
    QUICK_LAYER_NORM,
)
from benchmarks.check_gpu import BOUND, rel_err  # one error measure and one bound per dtype for both scripts
from ldmopt import _env

DEVICE = "cuda"  # tests/test_check_scripts_dry_run.py runs these checks on the CPU with tiny shapes
BACKENDS = ("cuda", "triton")
DTYPES, QUICK_DTYPES = (torch.float16, torch.bfloat16), (torch.float16,)
LAYOUTS, QUICK_LAYOUTS = ("channels_last", "nchw"), ("channels_last",)


def _group_norm_cases(quick: bool):
    from benchmarks.bench_group_norm import SHAPES

    names = QUICK_GROUP_NORM if quick else list(SHAPES)
    layouts = QUICK_LAYOUTS if quick else LAYOUTS
    dtypes = QUICK_DTYPES if quick else DTYPES
    for name in names:
        for layout in layouts:
            for dtype in dtypes:
                yield f"{name}-{layout}", SHAPES[name], layout, dtype


#: (backend, why) of each case a backend refused: a GPU run where the cuda backend refused every case fails
SKIPPED: list[tuple[str, str]] = []


def _skip(backend: str, what: str, exc: Exception) -> None:
    SKIPPED.append((backend, str(exc)))
    print(f"  skip {what}: {str(exc)[:200]}")


def _group_norm_inputs(shape, layout, dtype):
    x = (torch.randn(shape, device=DEVICE) * 2 + 0.3).to(dtype)
    if layout == "channels_last":
        x = x.to(memory_format=torch.channels_last)
    w = (torch.randn(shape[1], device=DEVICE) * 0.8 + 1).to(dtype)
    b = (torch.randn(shape[1], device=DEVICE) * 0.5).to(dtype)
    return x, w, b


def check_group_norm(quick: bool):
    for case, shape, layout, dtype in _group_norm_cases(quick):
        x, w, b = _group_norm_inputs(shape, layout, dtype)
        dy = torch.randn_like(x)
        leaves64 = [t.double().requires_grad_() for t in (x, w, b)]
        ref = F.silu(F.group_norm(leaves64[0], GROUPS, leaves64[1], leaves64[2], 1e-5))
        refs = [ref, *torch.autograd.grad(ref, leaves64, dy.double())]
        for backend in BACKENDS:
            leaves = [t.detach().clone().requires_grad_() for t in (x, w, b)]
            try:
                y = _ldmopt_group_norm(backend, *leaves)
            except ldmopt.BackendUnavailableError as exc:  # no ldmopt._C (main() refuses that on a GPU)
                _skip(backend, f"group_norm_silu {case} {dtype} {backend}", exc)
                continue
            assert y.stride() == x.stride(), f"{backend}: y strides {y.stride()} != x strides {x.stride()}"
            outs = [y, *torch.autograd.grad(y, leaves, dy)]
            yield "group_norm_silu", case, dtype, backend, outs, refs
        del leaves64, ref, refs


def check_group_norm_parts(quick: bool):
    """The statistics alone (gn_conv2d_stats: what the fused conv reads) and the normalisation from given statistics
    (group_norm_apply: the staged conv's pass, channels-last only; ``gn_apply_parts``: of x given as two
    channels-last parts, as an up block's (hidden, skip), with their statistics) on each backend."""
    from ldmopt.ops.gn_conv2d_stats import gn_conv2d_stats
    from ldmopt.ops.group_norm_apply import group_norm_apply

    for case, shape, layout, dtype in _group_norm_cases(quick):
        x, w, b = _group_norm_inputs(shape, layout, dtype)
        var, mean = torch.var_mean(x.double().reshape(x.shape[0], GROUPS, -1), dim=-1, unbiased=False)
        rstd = torch.rsqrt(var + 1e-5)
        # Statistics other than x's own, so that a kernel which recomputed them would fail.
        given = ((mean + 0.25).float(), (rstd * 1.5).float())
        z = (x.double().reshape(x.shape[0], GROUPS, -1) - given[0].double()[..., None]) * given[1].double()[..., None]
        z = z.reshape(x.shape) * w.double()[:, None, None] + b.double()[:, None, None]
        ref_y = F.silu(z)
        cl = layout == "channels_last"
        c_head = x.shape[1] // 3 * 2  # a group straddles the parts where the groups do not divide it
        head, tail = (x[:, :c_head].contiguous(memory_format=torch.channels_last),
                      x[:, c_head:].contiguous(memory_format=torch.channels_last))  # fmt: skip
        for backend in BACKENDS:
            try:
                with ldmopt.use_backend(backend):
                    out_stats = gn_conv2d_stats(x, GROUPS, 1e-5)
                    y = group_norm_apply(x, *given, w, b, GROUPS, "silu") if cl else None
                    y_parts = group_norm_apply(head, *given, w, b, GROUPS, "silu", tail) if cl else None
                    stats_parts = gn_conv2d_stats(head, GROUPS, 1e-5, tail) if cl else None
            except ldmopt.BackendUnavailableError as exc:
                _skip(backend, f"gn_stats+gn_apply {case} {dtype} {backend}", exc)
                continue
            yield "gn_stats", case, dtype, backend, list(out_stats), [mean, rstd]
            if y is not None:
                for out in (y, y_parts):
                    assert out.is_contiguous(memory_format=torch.channels_last), f"{backend}: apply not channels-last"
                yield "gn_apply", case, dtype, backend, [y], [ref_y]
                yield "gn_apply_parts", case, dtype, backend, [y_parts, *stats_parts], [ref_y, mean, rstd]
        del ref_y, z


def check_layer_norm_stats(quick: bool):
    """The row statistics the LayerNorm-in-loads GEMMs read (ldmopt.ops.layer_norm_stats), rows far from zero mean."""
    from ldmopt.ops.layer_norm_linear import layer_norm_stats_op

    for name in QUICK_LAYER_NORM if quick else list(LAYER_NORM_SHAPES):
        for dtype in QUICK_DTYPES if quick else DTYPES:
            m, c = LAYER_NORM_SHAPES[name]
            x = (torch.randn(m, c, device=DEVICE) + 8 * torch.randn(m, 1, device=DEVICE)).to(dtype)
            var, mean = torch.var_mean(x.double(), dim=1, unbiased=False)
            ref = [mean, torch.rsqrt(var + 1e-6)]
            for backend in BACKENDS:
                try:
                    with ldmopt.use_backend(backend):
                        stats = layer_norm_stats_op(x, 1e-6)
                except ldmopt.BackendUnavailableError as exc:
                    _skip(backend, f"ln_stats {name} {dtype} {backend}", exc)
                    continue
                yield "ln_stats", name, dtype, backend, [stats[0], stats[1]], ref


def check_layer_norm_apply(quick: bool):
    """The LayerNorm applied from given row statistics (what cuBLAS's GEMM reads under the "cublas" placement), with
    the model's 16-bit affine parameters."""
    from ldmopt.ops.layer_norm_apply import layer_norm_apply

    for name in QUICK_LAYER_NORM if quick else list(LAYER_NORM_SHAPES):
        for dtype in QUICK_DTYPES if quick else DTYPES:
            m, c = LAYER_NORM_SHAPES[name]
            x = (torch.randn(m, c, device=DEVICE) + 8 * torch.randn(m, 1, device=DEVICE)).to(dtype)
            var, mean = torch.var_mean(x.double(), dim=1, unbiased=False)
            stats = torch.stack([mean, torch.rsqrt(var + 1e-6)]).float()
            w, b = (torch.randn(c, device=DEVICE) * 0.5 + 1.0).to(dtype), torch.randn(c, device=DEVICE).to(dtype)
            ref = (x.double() - stats[0].double()[:, None]) * stats[1].double()[:, None] * w.double() + b.double()
            for backend in BACKENDS:
                try:
                    with ldmopt.use_backend(backend):
                        h = layer_norm_apply(x, stats, w, b, None, 1, dtype)
                except ldmopt.BackendUnavailableError as exc:
                    _skip(backend, f"ln_apply {name} {dtype} {backend}", exc)
                    continue
                yield "ln_apply", name, dtype, backend, [h], [ref]


def _epilogue_inputs(shape, dtype):
    """(z, gate, residual, kwargs of ops.linear_epilogue) for an EPILOGUE_SHAPES entry."""
    m, n, what = shape
    z = torch.randn(m, 2 * n if what == "geglu" else n, device=DEVICE).to(dtype)
    gate = residual = None
    if what == "gate_residual_stats":  # one gate row per sample: a column slice of the modulation (emb.chunk)
        gate = torch.randn(2, 6 * n, device=DEVICE).to(dtype)[:, 2 * n : 3 * n]
        residual = torch.randn(2, m // 2, n, device=DEVICE).to(dtype)
    if what == "saturate":
        residual = torch.randn(m, n, device=DEVICE).to(dtype)
    kwargs = dict(glu=what == "geglu", saturate=what == "saturate")
    activation = {"geglu": "gelu", "gelu_tanh": "gelu_tanh"}.get(what)
    return z, activation, gate, residual, kwargs, what == "gate_residual_stats"


def check_linear_epilogue(quick: bool):
    """The fused linear layers' pass after cuBLAS's GEMM: GEGLU's product, GELU-tanh, the gated residual with the next
    norm's row statistics (against those of the fp64 output), Flux's clamp."""
    for name in QUICK_EPILOGUE if quick else list(EPILOGUE_SHAPES):
        for dtype in QUICK_DTYPES if quick else DTYPES:
            z, activation, gate, residual, kwargs, stats = _epilogue_inputs(EPILOGUE_SHAPES[name], dtype)
            ref = [_epilogue_reference(z, activation, gate, residual, **kwargs)]
            if stats:
                var, mean = torch.var_mean(ref[0], dim=1, unbiased=False)
                ref += [mean, torch.rsqrt(var + 1e-6)]
            for backend in BACKENDS:
                try:
                    y, out_stats = _ldmopt_epilogue(backend, z, activation, gate, residual, kwargs, stats)
                except ldmopt.BackendUnavailableError as exc:
                    _skip(backend, f"linear_epilogue {name} {dtype} {backend}", exc)
                    continue
                yield "linear_epilogue", name, dtype, backend, [y, *([] if out_stats is None else out_stats)], ref


def check_adaln(quick: bool):
    """adaLN modulation (the DiT-class norms: residual sum, LayerNorm without affine, per-sample scale and shift),
    fp32 modulation chunks of one embedding for 16-bit rows, against fp64."""
    from ldmopt.ops.adaln_modulate import adaln_modulate

    for name in QUICK_ADALN if quick else list(ADALN_SHAPES):
        m, c, b, what = ADALN_SHAPES[name]
        for dtype in QUICK_DTYPES if quick else DTYPES:
            x = (torch.randn(m, c, device=DEVICE) + 4 * torch.randn(m, 1, device=DEVICE)).to(dtype)
            residual = torch.randn(m, c, device=DEVICE).to(dtype) if what else None
            emb = torch.randn(b, 3 * c, device=DEVICE) * 0.3
            scale, shift, gate = emb[:, :c], emb[:, c : 2 * c], emb[:, 2 * c :] if what == "gated" else None

            def per_row(t, tokens=m // b):
                return t.double().repeat_interleave(tokens, dim=0)

            s = x.double()
            if residual is not None:  # the sum rounded as stored, x scaled by the gate first where there is one
                s = (residual.double() + (s if gate is None else per_row(gate) * s)).to(dtype).double()
            var, mean = torch.var_mean(s, dim=1, unbiased=False)
            ref = (s - mean[:, None]) * torch.rsqrt(var + 1e-6)[:, None] * (1 + per_row(scale)) + per_row(shift)
            for backend in BACKENDS:
                try:
                    with ldmopt.use_backend(backend):
                        tokens = (b, m // b, c)  # the stream's [B, T, C]: one scale / shift row per sample
                        res = None if residual is None else residual.view(tokens)
                        y = adaln_modulate(x.view(tokens), scale, shift, residual=res, gate=gate, eps=1e-6)
                        y = y.view(m, c)
                except ldmopt.BackendUnavailableError as exc:
                    _skip(backend, f"adaln_modulate {name} {dtype} {backend}", exc)
                    continue
                yield "adaln_modulate", name, dtype, backend, [y], [ref]


def check_stats_from_sums(quick: bool):
    """GroupNorm statistics of an up block's cat([hidden, skip], 1) from the two parts' per-channel fp64 sums (what
    the fused convs' epilogues hand it), groups straddling the parts; SD1.5's 32x32 level and a 16-frame video."""
    from ldmopt.ops.group_norm_sums import group_norm_stats_from_sums

    for name in QUICK_FROM_SUMS if quick else list(FROM_SUMS_SHAPES):
        n, c_head, c_tail, hw, frames = FROM_SUMS_SHAPES[name]
        x = torch.randn(n, c_head + c_tail, hw, device=DEVICE, dtype=torch.float64) + 4.0
        sums = torch.stack([x.sum(2), (x * x).sum(2)], dim=-1)
        head, tail = sums[:, :c_head].contiguous(), sums[:, c_head:].contiguous()
        video = x.reshape(n // frames, frames, GROUPS, -1, hw).transpose(1, 2).reshape(n // frames, GROUPS, -1)
        var, mean = torch.var_mean(video, dim=2, unbiased=False)
        ref = [mean, torch.rsqrt(var + 1e-6)]
        for backend in BACKENDS:
            try:
                with ldmopt.use_backend(backend):
                    out = group_norm_stats_from_sums(head, GROUPS, 1e-6, hw, tail, frames)
            except ldmopt.BackendUnavailableError as exc:
                _skip(backend, f"stats_from_sums {name} {torch.float32} {backend}", exc)
                continue
            yield "stats_from_sums", name, torch.float32, backend, list(out), ref


def _conv_epilogue_inputs(shape, dtype):
    """(z, kwargs of ops.conv_epilogue) for a CONV_EPILOGUE_SHAPES entry, channels-last as cuDNN writes it."""
    n, c, h, w, what = shape

    def cl(*size, mean=0.0):
        return (torch.randn(*size, device=DEVICE) + mean).to(dtype).contiguous(memory_format=torch.channels_last)

    z = cl(n, c, h, w, mean=2.0)
    if what == "conv1":
        return z, dict(temb=torch.randn(n, c, device=DEVICE).to(dtype), out_groups=32)
    if what == "temporal":  # temb [N, C, F] with unit channel stride, as the temporal resnet hands it
        temb = torch.randn(n, h, c, device=DEVICE).to(dtype).transpose(1, 2)
        return z, dict(temb=temb, gate=torch.rand(n, h, device=DEVICE), residual=cl(n, c, h, w), out_groups=32)
    return z, dict(shortcut=cl(n, c, h, w), residual=cl(n, c, h, w), output_scale=1.5, out_groups=0,
                   out_channel_sums=True)  # fmt: skip


def check_conv_epilogue(quick: bool):
    """The fused convs' pass after cuDNN's conv: temb and the next GroupNorm's statistics, or shortcut, residual,
    scale and the channel sums a two-part GroupNorm finalises (against those of the fp64 output)."""
    for name in QUICK_CONV_EPILOGUE if quick else list(CONV_EPILOGUE_SHAPES):
        for dtype in QUICK_DTYPES if quick else DTYPES:
            z, kwargs = _conv_epilogue_inputs(CONV_EPILOGUE_SHAPES[name], dtype)
            ref = z.double() + (kwargs["shortcut"].double() if "shortcut" in kwargs else 0.0)
            if "temb" in kwargs:
                temb = kwargs["temb"].double()
                ref = ref + (temb[..., None] if temb.dim() == 3 else temb[:, :, None, None])
            if "gate" in kwargs:
                ref = ref * kwargs["gate"].double()[:, None, :, None]
            if "residual" in kwargs:
                ref = ref + kwargs["residual"].double()
            ref = ref / kwargs.get("output_scale", 1.0)
            n = z.shape[0]
            if kwargs["out_groups"]:
                var, mean = torch.var_mean(ref.reshape(n, kwargs["out_groups"], -1), dim=2, unbiased=False)
                refs = [ref, mean, torch.rsqrt(var + 1e-6)]
            else:
                rows = ref.permute(0, 2, 3, 1).reshape(n, -1, z.shape[1])
                refs = [ref, torch.stack([rows.sum(1), (rows * rows).sum(1)], dim=-1)]
            for backend in BACKENDS:
                z_in = z.clone()  # written in place
                try:
                    y, mean, rstd, sums = _ldmopt_conv_epilogue(backend, z_in, kwargs)
                except ldmopt.BackendUnavailableError as exc:
                    _skip(backend, f"conv_epilogue {name} {dtype} {backend}", exc)
                    continue
                outs = [y, mean, rstd] if kwargs["out_groups"] else [y, sums]
                yield "conv_epilogue", name, dtype, backend, outs, refs
            del ref


def _attention_inputs(shape, dtype):
    bn, f, h, d = shape
    # diffusers' (B*N, F, heads*head_dim) projections, viewed as (B*N, F, 1, heads, head_dim): no copies
    return [torch.randn(bn, f, h * d, device=DEVICE, dtype=dtype).view(bn, f, 1, h, d) for _ in range(3)]


def _attention_cases(quick: bool):
    names = QUICK_ATTENTION if quick else list(ATTENTION_SHAPES)
    dtypes = QUICK_DTYPES if quick else DTYPES
    for name in names:
        for dtype in dtypes:
            yield name, ATTENTION_SHAPES[name], dtype


def check_attention(quick: bool):
    for case, shape, dtype in _attention_cases(quick):
        q, k, v = _attention_inputs(shape, dtype)
        scale = shape[-1] ** -0.5
        ref = _attention_reference(q, k, v, scale)
        for backend in BACKENDS:
            try:
                out = _ldmopt_attention(backend, q, k, v, scale)
            except ldmopt.BackendUnavailableError as exc:
                _skip(backend, f"temporal_attention {case} {dtype} {backend}", exc)
                continue
            yield "temporal_attention", case, dtype, backend, [out], [ref]
        del ref


def run_checks(quick: bool) -> int:
    os.environ["LDMOPT_POISON_OUTPUTS"] = "1"
    failures = 0
    ran: Counter[str] = Counter()
    print(f"{'op':<20} {'case':<30} {'dtype':<9} {'backend':<7} {'max rel err (outputs...)':<40} status")
    checks = (check_group_norm, check_group_norm_parts, check_stats_from_sums, check_layer_norm_stats,
              check_layer_norm_apply, check_linear_epilogue, check_conv_epilogue, check_adaln,
              check_attention)  # fmt: skip
    for check in checks:
        try:
            for op, case, dtype, backend, outs, refs in check(quick):
                ran[backend] += 1
                errs = [rel_err(o, r) for o, r in zip(outs, refs)]
                ok = all(e <= BOUND[dtype] for e in errs)  # NaN compares False
                failures += not ok
                text = " ".join(f"{e:.2e}" for e in errs)
                print(f"{op:<20} {case:<30} {str(dtype)[6:]:<9} {backend:<7} {text:<40} {'PASS' if ok else 'FAIL'}")
        except Exception as exc:  # the exception on the ERROR line: run_gpu.sh's summary shows that line
            failures += 1
            print(f"{check.__name__} ERROR {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}")
            print(traceback.format_exc())
    if torch.cuda.is_available() and not ran["cuda"]:  # loaded, but refused every case: nothing was checked
        failures += 1
        why = next((why for backend, why in SKIPPED if backend == "cuda"), "no case was tried")
        print(f"check_cuda_backend ERROR the cuda backend ran no case: {why[:200]}")
    print(f"check_cuda_backend: {'all checks passed' if not failures else f'{failures} checks failed'}")
    return failures


#: Rows of this script's speed part go under these op names: the benchmarks record the same ops at the same cases
#: (bench_group_norm.py), and one (op, case, dtype, mode) key with two eager rows would pair the wrong baselines.
OP_PREFIX = "cuda_check/"


def _record(recorder, rows, op, case, dtype, mode, provider, fn, nbytes, flops=None):
    from benchmarks import harness

    try:
        timing, note = harness.time_fn(fn), ""
    except Exception as exc:  # a backend that cannot run these inputs is reported, not fatal
        timing, note = None, harness.error_note(exc)
    row = recorder.record(
        op=OP_PREFIX + op, case=case, dtype=str(dtype)[6:], mode=mode, provider=provider, timing=timing, bytes=nbytes,
        flops=flops, note=note,
    )  # fmt: skip
    rows.setdefault((op, case, str(dtype)[6:], mode), {})[provider] = row


def _fwd_bwd(fn, leaves, dy):
    return torch.autograd.grad(fn(*leaves), leaves, dy)


def _bench_group_norm(recorder, rows, case, shape, layout, dtype):
    x, w, b = _group_norm_inputs(shape, layout, dtype)
    elem = x.numel() * x.element_size()
    dy = torch.randn_like(x)
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, b)]
    providers = {f"ldmopt-{be}": functools.partial(_ldmopt_group_norm, be) for be in BACKENDS}
    providers["eager"] = _eager_group_norm
    for name, fn in providers.items():
        with torch.no_grad():
            _record(
                recorder, rows, "group_norm_silu", case, dtype, "fwd", name, functools.partial(fn, x, w, b), 2 * elem
            )
        # bytes: forward x, y; backward x, dy, dx
        fwd_bwd = functools.partial(_fwd_bwd, fn, leaves, dy)
        _record(recorder, rows, "group_norm_silu", case, dtype, "fwd+bwd", name, fwd_bwd, 5 * elem)


def _bench_attention(recorder, rows, case, shape, dtype):
    q, k, v = _attention_inputs(shape, dtype)
    bn, f, h, d = shape
    scale = d**-0.5
    nbytes = 4 * q.numel() * q.element_size()  # q, k, v read, out written
    flops = 4 * bn * h * f * f * d
    providers = {f"ldmopt-{be}": functools.partial(_ldmopt_attention, be) for be in BACKENDS}
    providers["eager"] = _eager_attention
    with torch.no_grad():
        for name, fn in providers.items():
            run = functools.partial(fn, q, k, v, scale)
            _record(recorder, rows, "temporal_attention", case, dtype, "fwd", name, run, nbytes, flops)


def _bench_epilogue(recorder, rows, case, shape, dtype):
    z, activation, gate, residual, kwargs, stats = _epilogue_inputs(shape, dtype)
    m, n = z.shape[0], shape[1]
    nbytes = (z.numel() + m * n * (1 + (residual is not None))) * z.element_size()  # z (and residual) read, y written
    providers = {f"ldmopt-{be}": functools.partial(_ldmopt_epilogue, be) for be in BACKENDS}
    providers["eager"] = _eager_epilogue
    with torch.no_grad():
        for name, fn in providers.items():
            run = functools.partial(fn, z, activation, gate, residual, kwargs, stats)
            _record(recorder, rows, "linear_epilogue", case, dtype, "fwd", name, run, nbytes)


def run_benchmarks(quick: bool) -> None:
    from benchmarks.harness import Recorder

    os.environ["LDMOPT_POISON_OUTPUTS"] = "0"
    recorder = Recorder()
    rows: dict = {}
    for case, shape, layout, dtype in _group_norm_cases(quick):
        _bench_group_norm(recorder, rows, case, shape, layout, dtype)
    for case, shape, dtype in _attention_cases(quick):
        _bench_attention(recorder, rows, case, shape, dtype)
    for case in QUICK_EPILOGUE if quick else list(EPILOGUE_SHAPES):
        for dtype in QUICK_DTYPES if quick else DTYPES:
            _bench_epilogue(recorder, rows, case, EPILOGUE_SHAPES[case], dtype)
    print("\nside by side (median ms; cuda/triton < 1 means the CUDA backend is faster)")
    print(f"{'op':<20} {'case':<30} {'dtype':<9} {'mode':<8} {'cuda':>9} {'triton':>9} {'eager':>9} "
          f"{'cuda/triton':>11} {'cuda %copy':>10}")  # fmt: skip
    for (op, case, dtype, mode), by in rows.items():
        ms = {p: r.median_ms or math.nan for p, r in by.items()}
        cuda, triton_ms, eager = (ms.get(p, math.nan) for p in ("ldmopt-cuda", "ldmopt-triton", "eager"))
        cuda_row = by.get("ldmopt-cuda")
        pct = cuda_row.pct_copy_bw if cuda_row is not None and cuda_row.pct_copy_bw else math.nan
        print(f"{op:<20} {case:<30} {dtype:<9} {mode:<8} {cuda:>9.4f} {triton_ms:>9.4f} {eager:>9.4f} "
              f"{cuda / triton_ms:>11.2f} {pct:>9.0f}%")  # fmt: skip
    print(f"\n(rows appended to {recorder.csv_path})\n")
    print(recorder.summary())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes, fp16 and channels-last only")
    parser.add_argument("--no-bench", action="store_true", help="correctness only")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("check_cuda_backend: no CUDA device; nothing to check")
        return 0
    ok, why = _env.cuda_extension_status()
    print(f"ldmopt._C: {why}; build: {_env.build_info()}")
    if not ok:
        print(
            "check_cuda_backend: the CUDA extension is not loaded; build it with pip install --no-build-isolation -e ."
        )
        return 1
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    failures = run_checks(args.quick)
    if not args.no_bench:
        run_benchmarks(args.quick)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
