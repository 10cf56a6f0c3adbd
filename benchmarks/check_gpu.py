"""GPU correctness at real shapes: every ldmopt kernel against the reference backend computed in fp64.

Prints one line per (op, case, dtype, backend): max relative error ||out - ref||_inf / ||ref||_inf and PASS/FAIL
against a per-dtype bound; exits 1 if anything fails. Outputs are poisoned with NaN before the kernels write them.
Run: python benchmarks/check_gpu.py [--quick]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

os.environ.setdefault("LDMOPT_POISON_OUTPUTS", "1")

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ldmopt
from benchmarks.check_gpu_cases import (
    _GEMM_RUNS,
    FULL_ONLY,
    GEMM_PLACEMENTS,
    OP_CASES,
    PLACEMENTS,
    PLAIN_PLACEMENTS,
    fused_linear_inputs,
)
from benchmarks.check_gpu_linear import _run_gelu, ref_residual_stats, run_residual_stats
from ldmopt.ops.gn_conv2d_prologue import forced
from ldmopt.ops.linear_cublas import forced as gemm_forced

DEVICE = "cuda"  # tests/test_check_scripts_dry_run.py runs every check on the CPU with tiny CASES
BOUND = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 4e-2}
DTYPES = (torch.float16, torch.bfloat16)
MOTION_FRAMES, SVD_FRAMES, SVD_CONTEXT_DIM = 16, 14, 1024  # temporal_layout's clips
REF_SEQUENCES = 512  # temporal_attention's fp64 reference covers this many sequences (keeps its memory small)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if torch.isnan(out).any():
        return float("nan")
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30)).item()


# A check yields (case, dtype, backend, outputs, references) tuples.
Check = Callable[[bool], Iterator[tuple[str, torch.dtype, str, list[torch.Tensor], list[torch.Tensor]]]]
CHECKS: dict[str, Check] = {}


def check(name: str):
    def register(fn: Check) -> Check:
        CHECKS[name] = fn
        return fn

    return register


#: (k, n): this process runs the k-th of every n (check, case) pairs (``--shard k/n``: run_gpu.sh runs n at once,
#: their Triton compiles on the machine's cores in parallel).
SHARD = (0, 1)


def _cases(name: str, quick: bool) -> dict:
    pairs = [(check, case) for check in CASES for case in CASES[check] if not (quick and case in FULL_ONLY)]
    k, n = SHARD
    mine = {pair for i, pair in enumerate(pairs) if i % n == k}
    return {case: spec for case, spec in CASES[name].items() if (name, case) in mine}


@check("group_norm_silu")
def _group_norm(quick: bool):
    for case, shape in _cases("group_norm_silu", quick).items():
        for dtype in DTYPES:
            x = (torch.randn(shape, device=DEVICE) * 2 + 0.3).to(dtype).to(memory_format=torch.channels_last)
            w = torch.randn(shape[1], device=DEVICE).to(dtype)
            b = torch.randn(shape[1], device=DEVICE).to(dtype)
            dy = torch.randn_like(x)
            leaves64 = [t.double().requires_grad_() for t in (x, w, b)]
            ref = F.silu(F.group_norm(leaves64[0], 32, leaves64[1], leaves64[2], 1e-5))
            grads64 = torch.autograd.grad(ref, leaves64, dy.double())
            for backend in ("triton", "cuda"):
                leaves = [t.detach().clone().requires_grad_() for t in (x, w, b)]
                try:
                    with ldmopt.use_backend(backend):
                        y = ldmopt.ops.group_norm(leaves[0], 32, leaves[1], leaves[2], 1e-5, "silu")
                        grads = torch.autograd.grad(y, leaves, dy)
                except ldmopt.BackendUnavailableError as exc:
                    print(f"  skip group_norm_silu {case} {dtype} {backend}: {str(exc)[:120]}")
                    continue
                yield case, dtype, backend, [y, *grads], [ref, *grads64]


def _random_norm_affine(block: torch.nn.Module) -> None:
    """Non-trivial GroupNorm weights and biases (a fresh block's are ones and zeros), in place."""
    with torch.no_grad():
        for name, p in block.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.5 + (1.0 if name.endswith("weight") else 0.0))


@check("resnet_block")
def _resnet_block(quick: bool):
    """Fused ResnetBlock2D vs diffusers' own block in fp64 (also exercises the conv epilogue's statistics handoff)."""
    from diffusers.models.resnet import ResnetBlock2D

    from ldmopt.nn import fused_resnet_forward

    for case, (n, c_in, c_out, hw, temb_channels) in _cases("resnet_block", quick).items():
        ref_block = ResnetBlock2D(in_channels=c_in, out_channels=c_out, temb_channels=temb_channels)
        ref_block = ref_block.to(DEVICE).eval()
        _random_norm_affine(ref_block)
        x = torch.randn(n, c_in, hw, hw, device=DEVICE).to(memory_format=torch.channels_last)
        temb = torch.randn(n, temb_channels, device=DEVICE) if temb_channels else None
        with torch.no_grad():
            ref = ref_block.double()(x.double(), None if temb is None else temb.double())
        for dtype in DTYPES:
            block = ref_block.to(dtype)
            for placement in PLACEMENTS:  # GroupNorm + SiLU in the conv's loader, or staged before a plain conv
                with torch.no_grad(), ldmopt.use_backend("triton"), forced(placement):
                    out = fused_resnet_forward(block, x.to(dtype), None if temb is None else temb.to(dtype))
                    y, (mean, rstd) = fused_resnet_forward(
                        block, x.to(dtype), None if temb is None else temb.to(dtype), out_stats=(32, 1e-6)
                    )
                var, mu = torch.var_mean(y.double().reshape(n, 32, -1), dim=-1, unbiased=False)
                yield case, dtype, f"triton/{placement}", [out, mean, rstd], [ref, mu, torch.rsqrt(var + 1e-6)]


@check("resnet_skip")
def _resnet_skip(quick: bool):
    """A UNet up block's resnet on its skip connection read in place, ``x=(hidden, skip)`` (never concatenated), vs
    diffusers' block on ``torch.cat([hidden, skip], 1)`` in fp64: forward and both parts' gradients."""
    from diffusers.models.resnet import ResnetBlock2D

    from ldmopt.nn import fused_resnet_forward

    for case, (n, c_hidden, c_skip, c_out, hw, temb_channels) in _cases("resnet_skip", quick).items():
        ref_block = ResnetBlock2D(in_channels=c_hidden + c_skip, out_channels=c_out, temb_channels=temb_channels)
        ref_block = ref_block.to(DEVICE).eval()
        _random_norm_affine(ref_block)
        hidden = torch.randn(n, c_hidden, hw, hw, device=DEVICE).to(memory_format=torch.channels_last)
        skip = (torch.randn(n, c_skip, hw, hw, device=DEVICE) * 0.5 - 0.3).to(memory_format=torch.channels_last)
        temb = torch.randn(n, temb_channels, device=DEVICE)
        dy = torch.randn(n, c_out, hw, hw, device=DEVICE).to(memory_format=torch.channels_last)
        parts64 = [t.double().requires_grad_() for t in (hidden, skip)]
        ref = ref_block.double()(torch.cat(parts64, 1), temb.double())
        grads64 = torch.autograd.grad(ref, parts64, dy.double())
        for dtype in DTYPES:
            block = ref_block.to(dtype)
            for placement in PLACEMENTS:
                parts = [t.to(dtype).requires_grad_() for t in (hidden, skip)]
                with ldmopt.use_backend("triton", ops=("gn_conv2d", "gn_conv2d_stats")), forced(placement):
                    out = fused_resnet_forward(block, tuple(parts), temb.to(dtype))
                    grads = torch.autograd.grad(out, parts, dy.to(dtype))
                yield case, dtype, f"triton/{placement}", [out, *grads], [ref, *grads64]


@check("upsample_conv")
def _upsample_conv(quick: bool):
    """diffusers' Upsample2D as patched vs its own forward in fp64: nearest 2x read in the Triton conv's loads
    ("staged") or upsampled before cuDNN's conv ("cudnn")."""
    from diffusers.models.upsampling import Upsample2D

    for case, (n, channels, hw) in _cases("upsample_conv", quick).items():
        ref_block = Upsample2D(channels, use_conv=True).to(DEVICE).eval()
        x = torch.randn(n, channels, hw, hw, device=DEVICE).to(memory_format=torch.channels_last)
        with torch.no_grad():
            ref = ref_block.double()(x.double())
        for dtype in DTYPES:
            block = copy.deepcopy(ref_block).to(dtype=dtype, memory_format=torch.channels_last)
            report = ldmopt.patch(block)
            assert report.counts() == {"upsample_conv": 1}, str(report)
            for placement in PLAIN_PLACEMENTS:
                with torch.no_grad(), ldmopt.use_backend("triton", ops=("gn_conv2d",)), forced(placement):
                    out = block(x.to(dtype))
                assert not report.fallbacks(), report.fallbacks()
                yield case, dtype, f"triton/{placement}", [out], [ref]


@check("svd_resnet_block")
def _svd_resnet_block(quick: bool):
    """SVD's SpatioTemporalResBlock as patched (spatial resnet + temporal (3, 1) convs with the blend in the
    epilogue) vs diffusers' own block in fp64, with an image-only video in the batch; forward and input gradient."""
    from diffusers.models.resnet import SpatioTemporalResBlock

    for case, (videos, frames, channels, height, width, temb_channels) in _cases("svd_resnet_block", quick).items():
        ref_block = SpatioTemporalResBlock(channels, channels, temb_channels=temb_channels).to(DEVICE).eval()
        _random_norm_affine(ref_block)
        with torch.no_grad():
            ref_block.time_mixer.mix_factor.fill_(0.3)
        x = torch.randn(videos * frames, channels, height, width, device=DEVICE).to(memory_format=torch.channels_last)
        temb = torch.randn(videos * frames, temb_channels, device=DEVICE)
        indicator = torch.zeros(videos, frames, device=DEVICE)
        indicator[-1] = 1.0  # an image-only video: its blend weight is 1
        dy = torch.randn_like(x)
        x64 = x.double().requires_grad_()
        ref = ref_block.double()(x64, temb.double(), indicator)
        (dx64,) = torch.autograd.grad(ref, x64, dy.double())
        for dtype in DTYPES:
            block = copy.deepcopy(ref_block).to(dtype)
            report = ldmopt.patch(block)  # the spatial ResnetBlock2D fused too: its output feeds the temporal convs
            assert report.counts() == {"resnet": 1, "spatiotemporal_resnet": 1}, str(report)
            xi = x.to(dtype).requires_grad_()
            with ldmopt.use_backend("triton", ops=("gn_conv2d", "gn_conv2d_stats")):
                out = block(xi, temb.to(dtype), indicator)
                (dx,) = torch.autograd.grad(out, xi, dy.to(dtype))
            assert not report.fallbacks(), report.fallbacks()
            yield case, dtype, "triton", [out, dx], [ref, dx64]


@check("fused_linear")
def _fused_linear(quick: bool):
    """GEGLU, bias+GELU-tanh and gated-residual GEMMs and adaLN modulation, forward and all gradients, vs fp64."""
    for case, (run, ref_fn, bsz, t, k, n) in _cases("fused_linear", quick).items():
        for dtype in DTYPES:
            inputs = fused_linear_inputs(run, bsz, t, k, n, dtype, DEVICE)
            leaves64 = [v.double().requires_grad_() for v in inputs]
            ref = ref_fn(*leaves64)
            dy = torch.randn(ref.shape, device=DEVICE).to(dtype)
            grads64 = torch.autograd.grad(ref, leaves64, dy.double())
            placements = GEMM_PLACEMENTS if run in _GEMM_RUNS else {"auto": "triton"}
            for placement, label in placements.items():
                leaves = [v.detach().clone().requires_grad_() for v in inputs]
                with ldmopt.use_backend("triton"), gemm_forced(placement):
                    y = run(*leaves)
                    grads = torch.autograd.grad(y, leaves, dy)
                yield case, dtype, label, [y, *grads], [ref.detach(), *grads64]
            if run is _run_gelu:  # inference: GELU in cuBLASLt's epilogue (training keeps the pass, above)
                with torch.no_grad(), ldmopt.use_backend("triton"), gemm_forced("cublas"):
                    yield case, dtype, "triton/cublaslt", [run(*inputs)], [ref.detach()]


@check("linear_row_stats")
def _linear_row_stats(quick: bool):
    """A residual GEMM handing the next LayerNorm its statistics: the output and the rows' (mean, rstd), summed across
    column tiles by fp64 atomics and finalised by the last tile, vs fp64."""
    for case, (bsz, t, k, n, offset) in _cases("linear_row_stats", quick).items():
        for dtype in DTYPES:
            x, res = torch.randn(bsz, t, k, device=DEVICE), torch.randn(bsz, t, n, device=DEVICE) + offset
            w, b = torch.randn(n, k, device=DEVICE) * k**-0.5, torch.randn(n, device=DEVICE) * 0.1
            inputs = [v.to(dtype) for v in (x, w, b, res)]
            for placement, label in GEMM_PLACEMENTS.items():
                with ldmopt.use_backend("triton"), gemm_forced(placement):
                    run_residual_stats(*inputs)  # the first call tunes; the second launches the tuned tile directly
                    outs = run_residual_stats(*inputs)
                refs = ref_residual_stats(*(v.double() for v in inputs), outs[0])
                yield case, dtype, label, list(outs), list(refs)


@check("conv_row_stats")
def _conv_row_stats(quick: bool):
    """A transformer's GroupNorm + proj_in as one fused 1x1 conv that hands its first block's norm1 the LayerNorm
    statistics of its pixel rows: y and the rows' (mean, rstd), summed across column tiles by fp64 atomics and
    finalised by the last tile, vs fp64, in both GroupNorm placements."""
    from ldmopt.ops.gn_conv2d import gn_silu_conv2d

    for case, (n, c, c_out, hw) in _cases("conv_row_stats", quick).items():
        x = (torch.randn(n, c, hw, hw, device=DEVICE) * 1.5 + 0.5).to(memory_format=torch.channels_last)
        gw, gb = torch.randn(c, device=DEVICE) * 0.5 + 1.0, torch.randn(c, device=DEVICE) * 0.5
        w, b = torch.randn(c_out, c, 1, 1, device=DEVICE) * c**-0.5, torch.randn(c_out, device=DEVICE) * 0.1 + 2.0
        ref = F.conv2d(F.group_norm(x.double(), 32, gw.double(), gb.double(), 1e-5), w.double(), b.double())
        for dtype in DTYPES:
            inputs = [t.to(dtype) for t in (x, gw, gb)] + [w.to(dtype, memory_format=torch.channels_last), b.to(dtype)]
            for placement in PLACEMENTS:
                with torch.no_grad(), ldmopt.use_backend("triton"), forced(placement):
                    for _ in range(2):  # the first call tunes; the second launches the tuned tile directly
                        y, stats = gn_silu_conv2d(inputs[0], inputs[1], inputs[2], 32, 1e-5, inputs[3], inputs[4],
                                                  1, 0, activation=None, next_norm_eps=1e-6)  # fmt: skip
                rows = y.double().permute(0, 2, 3, 1).reshape(-1, c_out)  # the stored y's own statistics
                var, mean = torch.var_mean(rows, dim=1, unbiased=False)
                yield case, dtype, f"triton/{placement}", [y, stats[0], stats[1]], [ref, mean, torch.rsqrt(var + 1e-6)]


@check("channel_sums")
def _channel_sums(quick: bool):
    """A transformer's proj_out + residual as a plain 1x1 conv summing its output per (image, channel) in fp64
    atomics (no per-group finalisation: out_groups=0), and an up block's GroupNorm statistics of cat([y, skip], 1)
    finalised from both parts' sums (groups straddling the parts), vs fp64."""
    from ldmopt.ops.gn_conv2d import channel_sums_torch, gn_silu_conv2d
    from ldmopt.ops.group_norm_sums import group_norm_stats_from_sums

    for case, (n, c, c_skip, hw) in _cases("channel_sums", quick).items():
        tokens = (torch.randn(n, c, hw, hw, device=DEVICE) * 1.5 + 0.5).to(memory_format=torch.channels_last)
        residual = torch.randn(n, c, hw, hw, device=DEVICE).to(memory_format=torch.channels_last)
        skip = (torch.randn(n, c_skip, hw, hw, device=DEVICE) * 0.7 - 0.4).to(memory_format=torch.channels_last)
        w, b = torch.randn(c, c, 1, 1, device=DEVICE) * c**-0.5, torch.randn(c, device=DEVICE) * 0.1 + 1.0
        ref = F.conv2d(tokens.double(), w.double(), b.double()) + residual.double()
        for dtype in DTYPES:
            args = [t.to(dtype) for t in (tokens, w, b, residual, skip)]
            args[1] = args[1].contiguous(memory_format=torch.channels_last)
            for placement in PLAIN_PLACEMENTS:
                with torch.no_grad(), ldmopt.use_backend("triton"), forced(placement):
                    for _ in range(2):  # the first call tunes; the second launches the tuned tile directly
                        y, sums = gn_silu_conv2d(args[0], None, None, 0, 0.0, args[1], args[2], 1, 0,
                                                 normalize=False, activation=None, residual=args[3],
                                                 out_channel_sums=True)  # fmt: skip
                    mean, rstd = group_norm_stats_from_sums(sums, 32, 1e-6, hw * hw, channel_sums_torch(args[4]))
                both = torch.cat([y, args[4]], 1).double()  # the stored y's own statistics, with the skip's
                var, mu = torch.var_mean(both.reshape(n, 32, -1), dim=-1, unbiased=False)
                refs = [ref, channel_sums_torch(y), mu, torch.rsqrt(var + 1e-6)]
                yield case, dtype, f"triton/{placement}", [y, sums, mean, rstd], refs


def _sliced(full: torch.Tensor, sl: slice) -> torch.Tensor:
    """``full[:, :, sl]``, all NaN if ``full`` has a non-finite value anywhere (rel_err then reports NaN: FAIL)."""
    part = full[:, :, sl]
    return part if torch.isfinite(full).all() else torch.full_like(part, float("nan"))


@check("temporal_attention")
def _temporal_attention(quick: bool):
    """Strided (B, F, N, H, D) views of a packed qkv projection vs fp64 SDPA, forward and backward, at real shapes;
    the AnimateDiff-SDXL case has 262,144 (sequence, head) pairs, past the 65,535 grid limit of batch-on-grid-y.
    Triton runs autotuned ("triton"), then each candidate tile forced ("triton:P8xD64w8", ...) where it has several:
    autotuning may pick any of them on another GPU or shape."""
    from ldmopt.kernels.temporal_attention import candidate_configs, forced_config, tile_name, tile_pairs

    from ldmopt.ops.temporal_attention import temporal_attention

    for case, (b, f, n, h, d) in _cases("temporal_attention", quick).items():
        for dtype in DTYPES:
            qkv = torch.randn(b, f, n, 3, h, d, device=DEVICE).to(dtype)
            q, k, v = qkv.unbind(3)
            dy = torch.randn(b, f, n, h, d, device=DEVICE).to(dtype)
            leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            # fp64 reference on a slice of the sequences keeps the reference's memory small; the poison check (NaN
            # where nothing was written) covers every sequence.
            sl = slice(0, min(n, REF_SEQUENCES))
            ref_leaves = [t[:, :, sl].double().permute(0, 2, 3, 1, 4).requires_grad_() for t in (q, k, v)]
            ref = F.scaled_dot_product_attention(*ref_leaves)
            ref_grads = torch.autograd.grad(ref, ref_leaves, dy[:, :, sl].double().permute(0, 2, 3, 1, 4))
            refs = [t.permute(0, 3, 1, 2, 4) for t in (ref.detach(), *ref_grads)]
            tiles = tile_pairs(candidate_configs(f, d, dtype), candidate_configs(f, d, dtype, backward=True))
            variants = [("triton", None), ("cuda", None)] + [
                (f"triton:{tile_name(fw)}", (fw, bw))
                for fw, bw in (tiles if len(tiles) > 1 else [])  # one candidate: what "triton" ran
            ]
            for backend, tile_pair in variants:
                try:
                    with ldmopt.use_backend(backend.split(":")[0]), forced_config(*(tile_pair or ())):
                        out = temporal_attention(*leaves)
                        grads = torch.autograd.grad(out, leaves, dy) if backend != "cuda" else []
                except ldmopt.BackendUnavailableError as exc:
                    print(f"  skip temporal_attention {case} {dtype} {backend}: {str(exc)[:120]}")
                    continue
                outs = [_sliced(t, sl) for t in (out, *grads)]
                yield case, dtype, backend, outs, refs[: len(outs)]


def _motion(c, heads, hw):
    from diffusers.models.unets.unet_motion_model import AnimateDiffTransformer3D

    module = AnimateDiffTransformer3D(
        num_attention_heads=heads, attention_head_dim=c // heads, in_channels=c, norm_num_groups=32,
        positional_embeddings="sinusoidal", num_positional_embeddings=32,
    )  # fmt: skip
    x = torch.randn(2 * MOTION_FRAMES, c, hw, hw, device=DEVICE).to(memory_format=torch.channels_last)
    return module, x, lambda m, x: m(x, num_frames=MOTION_FRAMES)


def _svd(c, heads, hw):
    from diffusers.models.attention import TemporalBasicTransformerBlock

    module = TemporalBasicTransformerBlock(c, c, heads, c // heads, cross_attention_dim=SVD_CONTEXT_DIM)
    x = torch.randn(2 * SVD_FRAMES, hw * hw, c, device=DEVICE)
    context = torch.randn(2 * hw * hw, 1, SVD_CONTEXT_DIM, device=DEVICE)
    return module, x, lambda m, x: m(x, SVD_FRAMES, context.to(x.dtype))


@check("temporal_layout")
def _temporal_layout(quick: bool):
    """Whole temporal transformers run in (B, F, N, C) order (ldmopt.nn.temporal_layout) vs diffusers' own module in
    fp64: an AnimateDiff motion module on a channels-last activation and an SVD temporal block."""
    from ldmopt.nn.temporal_layout import install_temporal_blocks, uninstall_temporal_blocks

    for case, (build, c, heads, hw) in _cases("temporal_layout", quick).items():
        module, x, call = build(c, heads, hw)
        module = module.to(DEVICE).eval()
        with torch.no_grad():
            for name, p in module.named_parameters():  # non-trivial norm affines, as trained models have
                if "norm" in name:
                    p.copy_(torch.randn_like(p) * 0.5 + (1.0 if name.endswith("weight") else 0.0))
            ref = call(module.double(), x.double())
        for dtype in DTYPES:
            module = module.to(dtype)
            install = install_temporal_blocks(module)
            try:
                with torch.no_grad(), ldmopt.use_backend("triton"):
                    out = call(module, x.to(dtype))
            finally:
                uninstall_temporal_blocks(install)
            ran = install.report()[""]
            if ran["kernel"] != 1:
                raise AssertionError(f"{case} {dtype}: the token-order path did not run: {dict(ran)}")
            yield case, dtype, "triton", [out], [ref]


# Real shapes per check (check_gpu_cases.py but temporal_layout, whose builders are above); the cases in
# FULL_ONLY run only without --quick. A dry run replaces both with tiny cases.
CASES: dict[str, dict[str, tuple]] = {
    **OP_CASES,
    "temporal_layout": {  # (builder, channels, heads, H = W)
        "animatediff-32x32x640": (_motion, 640, 8, 32),
        "svd-32x32x320": (_svd, 320, 5, 32),
        "animatediff-64x64x320": (_motion, 320, 8, 64),
    },
}


def run_checks(quick: bool, only: list[str] | None = None) -> int:
    """Run the checks, one line each; returns the number of failures."""
    failures = 0
    print(f"{'op':<22} {'case':<22} {'dtype':<9} {'backend':<14} {'max rel err (outputs...)':<40} status")
    for name, fn in CHECKS.items():
        if only and name not in only:
            continue
        try:
            for case, dtype, backend, outs, refs in fn(quick):
                errs = [rel_err(o, r) for o, r in zip(outs, refs)]
                ok = all(e <= BOUND[dtype] for e in errs)  # NaN compares False
                failures += not ok
                errs_text = " ".join(f"{e:.2e}" for e in errs)
                status = "PASS" if ok else "FAIL"
                print(f"{name:<22} {case:<22} {str(dtype)[6:]:<9} {backend:<14} {errs_text:<40} {status}")
        except Exception as exc:  # the exception on the ERROR line: run_gpu.sh's summary shows that line
            failures += 1
            print(f"{name:<22} ERROR {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}")
            print(traceback.format_exc())
    k, n = SHARD
    shard = f" (shard {k}/{n})" if n > 1 else ""
    print(f"check_gpu: {'all passed' if not failures else f'{failures} failed'}{shard}")
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    parser.add_argument("--only", action="append", help="only these checks")
    parser.add_argument("--shard", default="0/1", help="k/n: only the k-th of every n (check, case) pairs")
    args = parser.parse_args(argv)
    global SHARD
    k, n = (int(v) for v in args.shard.split("/"))
    if not 0 <= k < n:
        parser.error(f"--shard k/n needs 0 <= k < n, got {args.shard}")
    SHARD = (k, n)
    unknown = sorted(set(args.only or ()) - set(CHECKS))
    if unknown:  # a misspelt name ran nothing and printed "all passed"
        parser.error(f"--only {', '.join(unknown)}: no such check; expected some of {', '.join(CHECKS)}")
    if not torch.cuda.is_available():
        print("check_gpu: no CUDA device; nothing to check")
        return 0
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    return 1 if run_checks(args.quick, args.only) else 0


if __name__ == "__main__":
    sys.exit(main())
