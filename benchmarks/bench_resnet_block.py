"""diffusers ResnetBlock2D at Stable Diffusion / SDXL / VAE shapes: ldmopt's fused block vs eager vs torch.compile,
and the fused GroupNorm -> conv alone vs cuDNN to show where the time goes.

Providers (op "resnet_block"): eager (diffusers' forward, channels-last model and input: cuDNN conv + PyTorch
GroupNorm), compile (torch.compile max-autotune-no-cudagraphs of that forward), ldmopt (fused forward: norm1 statistics
+ two fused convs), ldmopt+stats (norm1 statistics handed over by the producer, as in a chained UNet: two launches). Op
"gn_conv2d": the GroupNorm+SiLU -> 3x3 conv alone: eager (F.group_norm, F.silu, cuDNN conv), cudnn-conv (cuDNN conv of
an already activated input: the conv's own cost), ldmopt (fused, statistics inside), ldmopt+stats, ldmopt-plain (our
implicit GEMM without the prologue, the like-for-like conv vs cuDNN). "-loader" rows keep GroupNorm + SiLU in the conv's
loader, "-staged" rows stage it before ldmopt's plain conv; the others use the auto placement, which on a GPU stages it
before cuDNN's conv and runs the epilogue as a pass of its own ("cudnn": ldmopt/ops/gn_conv2d_prologue.py), so the
three placements are timed side by side. Op "resnet_skip": an up block's resnet on
its skip connection: eager and compile concatenate then run diffusers' block, ldmopt-cat concatenates then runs the
fused block, ldmopt reads (hidden, skip) in place (the raw concatenation is never written; the staged normalisation
writes the normalised one). Op "upsample_conv": diffusers'
Upsample2D (nearest 2x, then a 3x3 conv) vs ldmopt's conv reading the input through the 2x index map ("-staged"; the
auto placement on a GPU upsamples before cuDNN's conv).
The resnet_block, gn_conv2d and resnet_skip providers also get ``+graph`` rows (GPU time per call, from ten calls
captured in one CUDA graph). FLOPs are the convolutions' 2*MACs; bytes the minimum traffic (activations read/written
once, weights once; for fwd+bwd also the gradients' reads and writes).
Targets (H200): whole block >= 1.25x eager channels-last at 64x64x320 and 32x32x640, not slower than compile.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from benchmarks import harness

pytestmark = harness.gpu_only

DEVICE = "cuda"  # tests/benchmarks_dry_run/ runs this benchmark's logic on the CPU
QUICK = os.environ.get("LDMOPT_BENCH_QUICK") == "1"

# name: (batch, in_channels, out_channels, H=W, temb_channels, eps). SD/SDXL with classifier-free guidance batch 2.
BLOCKS = {
    "sd15-64x64x320": (2, 320, 320, 64, 1280, 1e-5),
    "sd15-32x32x640": (2, 640, 640, 32, 1280, 1e-5),
    "sd15-32x32-320to640": (2, 320, 640, 32, 1280, 1e-5),  # 1x1 conv_shortcut
    "sd15-16x16x1280": (2, 1280, 1280, 16, 1280, 1e-5),
    "sdxl-128x128x320": (2, 320, 320, 128, 1280, 1e-5),
    "sdxl-64x64x640": (2, 640, 640, 64, 1280, 1e-5),
    "sdxl-32x32x1280": (2, 1280, 1280, 32, 1280, 1e-5),
    "vae512-dec-128x128x512": (1, 512, 512, 128, None, 1e-6),
    "vae512-dec-512x512x128": (1, 128, 128, 512, None, 1e-6),
    "vae1024-dec-256x256x512": (1, 512, 512, 256, None, 1e-6),
    "vae1024-dec-1024x1024x128": (1, 128, 128, 1024, None, 1e-6),
}
QUICK_BLOCKS = ("sd15-64x64x320", "sd15-32x32x640")
# name: (batch, hidden channels, skip channels, out channels, H=W): UNet up-block resnets (in = hidden + skip).
SKIP_BLOCKS = {
    "sd15-up3-64x64-640+320": (2, 640, 320, 320, 64),
    "sd15-up2-32x32-1280+640": (2, 1280, 640, 640, 32),
    "sdxl-up2-128x128-320+320": (2, 320, 320, 320, 128),
}
QUICK_SKIP_BLOCKS = ("sd15-up3-64x64-640+320",)
GROUPS = 32
#: ops whose providers are also timed as CUDA graphs (`+graph` rows: GPU time only; eager times include the host's)
GRAPHED_OPS = ("resnet_block", "gn_conv2d", "resnet_skip")


def _cases():
    return list(QUICK_BLOCKS) if QUICK else list(BLOCKS)


def _block(case, dtype):
    from diffusers.models.resnet import ResnetBlock2D

    n, cin, cout, size, temb_ch, eps = BLOCKS[case]
    block = ResnetBlock2D(in_channels=cin, out_channels=cout, temb_channels=temb_ch, groups=GROUPS, eps=eps)
    block = block.to(device=DEVICE, dtype=dtype, memory_format=torch.channels_last).eval()
    x = torch.randn(n, cin, size, size, device=DEVICE, dtype=dtype).contiguous(memory_format=torch.channels_last)
    temb = None if temb_ch is None else torch.randn(n, temb_ch, device=DEVICE, dtype=dtype)
    return block, x, temb


def _conv_flops(n, cin, cout, size, k=3):
    return 2 * n * size * size * cout * cin * k * k


def _placement(provider: str):
    """A "-loader" provider keeps GroupNorm + SiLU in the conv's loader; "-staged" and "-plain" ones run the conv in
    ldmopt's Triton kernel (the normalisation staged before it); the others take the auto placement ("cudnn" for
    these convs on a GPU: the staged normalisation, cuDNN's conv and the epilogue pass; ops/gn_conv2d_prologue.py),
    so the rows time all three."""
    from ldmopt.ops.gn_conv2d_prologue import forced

    if provider.endswith("-loader"):
        return forced("loader")
    return forced("staged" if provider.endswith(("-staged", "-plain")) else "auto")


def _record(rec, op, case, dtype, mode, provider, fn, flops, nbytes):
    from ldmopt.nn import resnet

    # ldmopt's rows choose their backends as a user's call does (ldmopt._C's statistics and passes where built); a
    # fall-back to the reference raises, so it shows in the table instead of being timed.
    timed = harness.default_backends(fn) if provider.startswith("ldmopt") else fn

    resnet.fallback_reasons.clear()
    row = dict(op=op, case=case, dtype=str(dtype).removeprefix("torch."), mode=mode, bytes=nbytes, flops=flops)
    with _placement(provider):  # set once around the timings, so no call pays for it
        try:
            timed()
            timing, note = harness.time_fn(timed), ""
        except Exception as exc:  # a provider that cannot run (compile failure, refusal) is a row with the reason
            timing, note = None, harness.error_note(exc)
        if resnet.fallback_reasons:
            note = "fell back to diffusers: " + "; ".join(resnet.fallback_reasons)
        rec.record(provider=provider, timing=timing, note=note, **row)
        if timing is not None and op in GRAPHED_OPS:  # the kernels' own time, whatever the host adds
            harness.record_graphed(rec, timed, device=DEVICE, provider=provider, **row)


@pytest.mark.parametrize("case", _cases())
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("mode", ["fwd"] if QUICK else ["fwd", "fwd+bwd"])
def bench_resnet_block(case, dtype, mode, bench_recorder):
    pytest.importorskip("diffusers")
    from diffusers.models.resnet import ResnetBlock2D

    from ldmopt.nn.resnet import fused_resnet_forward

    block, x, temb = _block(case, dtype)
    n, cin, cout, size, _, _ = BLOCKS[case]
    flops = _conv_flops(n, cin, cout, size) + _conv_flops(n, cout, cout, size)
    flops += _conv_flops(n, cin, cout, size, 1) if cin != cout else 0
    elem = x.element_size()
    act_in, act_out = x.numel() * elem, n * cout * size * size * elem
    # x read (norm1 stats + conv1 + residual), h written and read, out written, weights once; the backward adds dy
    # read, dx written, x and h read again for the weight gradients, and those written (a lower bound).
    weights = sum(p.numel() * p.element_size() for p in block.parameters())
    nbytes = 3 * act_in + 3 * act_out + weights
    if mode == "fwd+bwd":
        nbytes += 2 * act_in + 2 * act_out + weights
    stats = torch.ops.ldmopt.gn_conv2d_stats(x, GROUPS, block.norm1.eps)
    providers = {
        "eager": lambda x, t: ResnetBlock2D.forward(block, x, t),
        "compile": harness.compiled(lambda x, t: ResnetBlock2D.forward(block, x, t), mode="max-autotune-no-cudagraphs"),
        "ldmopt": lambda x, t: fused_resnet_forward(block, x, t),
        "ldmopt+stats": lambda x, t: fused_resnet_forward(block, x, t, stats=stats),
        "ldmopt+stats-loader": lambda x, t: fused_resnet_forward(block, x, t, stats=stats),
        "ldmopt+stats-staged": lambda x, t: fused_resnet_forward(block, x, t, stats=stats),
    }
    if mode == "fwd+bwd":
        block.train()
        x.requires_grad_(True)
        for placed in ("ldmopt+stats", "ldmopt+stats-loader", "ldmopt+stats-staged"):
            providers.pop(placed)  # the placement changes the forward kernel only
    for name, fwd in providers.items():
        if mode == "fwd":

            def run(fwd=fwd):
                with torch.no_grad():
                    return fwd(x, temb)
        else:
            params = [x, *block.parameters()]
            dy = torch.randn(n, cout, size, size, device=DEVICE, dtype=dtype).contiguous(
                memory_format=torch.channels_last
            )

            def run(fwd=fwd, params=params, dy=dy):
                return torch.autograd.grad(fwd(x, temb), params, dy)

        _record(bench_recorder, "resnet_block", case, dtype, mode, name, run, flops * (1 if mode == "fwd" else 3),
                nbytes)  # fmt: skip


@pytest.mark.parametrize("case", _cases())
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def bench_gn_conv2d(case, dtype, bench_recorder):
    from ldmopt.ops.gn_conv2d import gn_silu_conv2d

    n, cin, cout, size, _, eps = BLOCKS[case]
    x = torch.randn(n, cin, size, size, device=DEVICE, dtype=dtype).contiguous(memory_format=torch.channels_last)
    gw = torch.randn(cin, device=DEVICE, dtype=dtype)
    gb = torch.randn(cin, device=DEVICE, dtype=dtype)
    w = (torch.randn(cout, cin, 3, 3, device=DEVICE, dtype=dtype) * 0.05).contiguous(memory_format=torch.channels_last)
    b = torch.randn(cout, device=DEVICE, dtype=dtype)
    activated = F.silu(F.group_norm(x, GROUPS, gw, gb, eps))
    stats = torch.ops.ldmopt.gn_conv2d_stats(x, GROUPS, eps)
    flops = _conv_flops(n, cin, cout, size)
    nbytes = x.numel() * x.element_size() + n * cout * size * size * x.element_size() + w.numel() * w.element_size()
    providers = {
        "eager": lambda: F.conv2d(F.silu(F.group_norm(x, GROUPS, gw, gb, eps)), w, b, 1, 1),
        "cudnn-conv": lambda: F.conv2d(activated, w, b, 1, 1),
        "ldmopt": lambda: gn_silu_conv2d(x, gw, gb, GROUPS, eps, w, b),
        "ldmopt+stats": lambda: gn_silu_conv2d(x, gw, gb, GROUPS, eps, w, b, stats=stats),
        "ldmopt+stats-loader": lambda: gn_silu_conv2d(x, gw, gb, GROUPS, eps, w, b, stats=stats),
        "ldmopt+stats-staged": lambda: gn_silu_conv2d(x, gw, gb, GROUPS, eps, w, b, stats=stats),
        "ldmopt-plain": lambda: gn_silu_conv2d(activated, None, None, 0, 0.0, w, b, normalize=False),
    }
    for name, fn in providers.items():
        _record(bench_recorder, "gn_conv2d", case, dtype, "fwd", name, fn, flops, nbytes)


@pytest.mark.parametrize("case", list(QUICK_SKIP_BLOCKS) if QUICK else list(SKIP_BLOCKS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def bench_resnet_skip(case, dtype, bench_recorder):
    """An up block's first resnet on ``cat([hidden, skip], 1)``, with and without writing the concatenation."""
    pytest.importorskip("diffusers")
    from diffusers.models.resnet import ResnetBlock2D

    from ldmopt.nn.resnet import fused_resnet_forward

    n, c_hidden, c_skip, cout, size = SKIP_BLOCKS[case]
    cin = c_hidden + c_skip
    block = ResnetBlock2D(in_channels=cin, out_channels=cout, temb_channels=1280, groups=GROUPS)
    block = block.to(device=DEVICE, dtype=dtype, memory_format=torch.channels_last).eval()
    hidden, skip = (
        torch.randn(n, c, size, size, device=DEVICE, dtype=dtype).contiguous(memory_format=torch.channels_last)
        for c in (c_hidden, c_skip)
    )
    temb = torch.randn(n, 1280, device=DEVICE, dtype=dtype)
    flops = _conv_flops(n, cin, cout, size) + _conv_flops(n, cout, cout, size) + _conv_flops(n, cin, cout, size, 1)
    elem = hidden.element_size()
    act_in, act_out = n * cin * size * size * elem, n * cout * size * size * elem
    # The minimum without the concatenation: the parts read three times (statistics, conv1, shortcut), h written and
    # read, out written, weights once. Eager adds the concatenation's read and write, a staged normalisation the
    # normalised activations' write and read.
    nbytes = 3 * act_in + 3 * act_out + sum(p.numel() * p.element_size() for p in block.parameters())

    def cat_block(h, s, t):
        return ResnetBlock2D.forward(block, torch.cat([h, s], dim=1), t)

    providers = {
        "eager": cat_block,
        "compile": harness.compiled(cat_block, mode="max-autotune-no-cudagraphs"),
        "ldmopt-cat": lambda h, s, t: fused_resnet_forward(block, torch.cat([h, s], dim=1), t),
        "ldmopt": lambda h, s, t: fused_resnet_forward(block, (h, s), t),
    }
    if QUICK:  # the quick GPU run compares with compile on the plain block (bench_resnet_block) only
        providers.pop("compile")
    for name, fwd in providers.items():

        def run(fwd=fwd):
            with torch.no_grad():
                return fwd(hidden, skip, temb)

        _record(bench_recorder, "resnet_skip", case, dtype, "fwd", name, run, flops, nbytes)


# name: (batch, channels, H=W of the input): the UNet's and the VAE decoder's upsamplers.
UPSAMPLERS = {
    "sd15-unet-16to32x1280": (2, 1280, 16),
    "sd15-unet-32to64x640": (2, 640, 32),
    "vae1024-dec-256to512x512": (1, 512, 256),
    "vae1024-dec-512to1024x256": (1, 256, 512),
}
QUICK_UPSAMPLERS = ("vae1024-dec-256to512x512",)


@pytest.mark.parametrize("case", list(QUICK_UPSAMPLERS) if QUICK else list(UPSAMPLERS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def bench_upsample_conv(case, dtype, bench_recorder):
    pytest.importorskip("diffusers")
    from diffusers.models.upsampling import Upsample2D

    from ldmopt.patch.rules_upsample import fused_upsample_forward

    n, c, size = UPSAMPLERS[case]
    block = Upsample2D(c, use_conv=True).to(device=DEVICE, dtype=dtype, memory_format=torch.channels_last).eval()
    x = torch.randn(n, c, size, size, device=DEVICE, dtype=dtype).contiguous(memory_format=torch.channels_last)
    flops = _conv_flops(n, c, c, 2 * size)
    elem = x.element_size()
    # The minimum: x read, the 2x output written, weights once (what "-staged", the Triton conv reading x through the
    # 2x index map, moves). diffusers, and "ldmopt" on a GPU (the cudnn placement), also write and read back 4x.
    nbytes = x.numel() * elem * 5 + sum(p.numel() * p.element_size() for p in block.parameters())
    providers = {
        "eager": lambda: Upsample2D.forward(block, x),
        "compile": harness.compiled(lambda: Upsample2D.forward(block, x), mode="max-autotune-no-cudagraphs"),
        "ldmopt": lambda: fused_upsample_forward(block, x),
        "ldmopt-staged": lambda: fused_upsample_forward(block, x),
    }
    if QUICK:
        providers.pop("compile")
    for name, fn in providers.items():

        def run(fn=fn):
            with torch.no_grad():
                return fn()

        _record(bench_recorder, "upsample_conv", case, dtype, "fwd", name, run, flops, nbytes)
