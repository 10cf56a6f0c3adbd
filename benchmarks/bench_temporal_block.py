"""Whole temporal transformers at video-model shapes: diffusers' forward (permute to (B*N, F, C), SDPA, permute back)
vs ldmopt's temporal attention processor (same permutes, strided kernel) vs ldmopt's token-order forward (no permute
copy at all) vs torch.compile of diffusers' forward.

Cases (B = 2, classifier-free guidance; real channel counts and heads from shared/configs):
- ``animatediff512-*``: an AnimateDiff motion module (``AnimateDiffTransformer3D``: GroupNorm, proj_in, one
  BasicTransformerBlock with two self-attentions over 16 frames and a GEGLU feed-forward, proj_out) on a
  channels-last (B*F, C, H, W) activation, as a channels-last UNet hands it over.
- ``svd576x1024-72x128``: one SVD ``TemporalBasicTransformerBlock`` (14 frames, 5 heads of 64, attn2 over one
  image-embedding token) on the (B*F, N, C) tokens.
Bytes: the activation read and the output written once, for fwd+bwd also their gradients (the minimum; the
projections' weights are small), so GB/s is a lower bound; the row's note carries the max relative error of the
provider's output against eager.
Target: the token-order forward faster than both the stock module and the processor alone (the permutes' share),
and not slower than torch.compile. LDMOPT_BENCH_QUICK=1 keeps one case per model, fp16, forward, no compiles.
"""

from __future__ import annotations

import os

import pytest
import torch

from benchmarks import harness

pytestmark = harness.gpu_only

QUICK = os.environ.get("LDMOPT_BENCH_QUICK") == "1"
DEVICE = "cuda"  # tests/benchmarks_dry_run/ runs this benchmark's logic on the CPU
FRAMES_ANIMATEDIFF, FRAMES_SVD = 16, 14
# name: (kind, channels, heads, head_dim, H, W)
CASES = {
    "animatediff512-64x64": ("motion", 320, 8, 40, 64, 64),
    "animatediff512-32x32": ("motion", 640, 8, 80, 32, 32),
    "animatediff512-16x16": ("motion", 1280, 8, 160, 16, 16),
    "svd576x1024-72x128": ("svd", 320, 5, 64, 72, 128),
    "svd576x1024-36x64": ("svd", 640, 10, 64, 36, 64),
}
QUICK_CASES = ("animatediff512-64x64", "svd576x1024-72x128")


def _motion_module(channels, heads, head_dim):
    from diffusers.models.unets.unet_motion_model import AnimateDiffTransformer3D

    return AnimateDiffTransformer3D(
        num_attention_heads=heads, attention_head_dim=head_dim, in_channels=channels, norm_num_groups=32,
        activation_fn="geglu", positional_embeddings="sinusoidal", num_positional_embeddings=32,
    )  # fmt: skip


def _svd_block(channels, heads, head_dim):
    from diffusers.models.attention import TemporalBasicTransformerBlock

    return TemporalBasicTransformerBlock(channels, channels, heads, head_dim, cross_attention_dim=1024)


def _setup(case, dtype):
    kind, c, heads, d, h, w = CASES[case]
    b = 2
    if kind == "motion":
        module = _motion_module(c, heads, d)
        x = torch.randn(b * FRAMES_ANIMATEDIFF, c, h, w, device=DEVICE, dtype=dtype)
        x = x.contiguous(memory_format=torch.channels_last)
        call = lambda m, x: m(x, num_frames=FRAMES_ANIMATEDIFF)
    else:
        module = _svd_block(c, heads, d)
        x = torch.randn(b * FRAMES_SVD, h * w, c, device=DEVICE, dtype=dtype)
        context = torch.randn(b * h * w, 1, 1024, device=DEVICE, dtype=dtype)
        call = lambda m, x: m(x, FRAMES_SVD, context)
    return module.to(device=DEVICE, dtype=dtype).eval(), x, call


def _install_processors(module):
    """ldmopt's processors on the module's attention: found by container for a motion module; set directly on a
    bare SVD block's attn1 (temporal) and attn2 (single key)."""
    from ldmopt.nn import temporal_attention as T

    if type(module).__name__ != "TemporalBasicTransformerBlock":
        return T.install_processors(module)
    install = T.ProcessorInstall()
    for name, cls in (("attn1", T.TemporalAttnProcessor), ("attn2", T.SingleKeyAttnProcessor)):
        attn = getattr(module, name)
        previous, reason = T.install_processor(attn, cls)
        assert reason is None, reason
        install.modules[name], install.previous[name], install.installed[name] = attn, previous, attn.processor
    return install


@pytest.mark.parametrize("case", [c for c in CASES if not QUICK or c in QUICK_CASES])
@pytest.mark.parametrize(
    "dtype", [torch.float16] if QUICK else [torch.float16, torch.bfloat16], ids=["fp16"] if QUICK else ["fp16", "bf16"]
)
@pytest.mark.parametrize("mode", ["fwd"] if QUICK else ["fwd", "fwd+bwd"])
def bench_temporal_block(case, dtype, mode, bench_recorder):
    pytest.importorskip("diffusers")
    from ldmopt.nn import temporal_attention as T
    from ldmopt.nn import temporal_layout

    module, x, call = _setup(case, dtype)
    nbytes = (2 if mode == "fwd" else 4) * x.numel() * x.element_size()
    with torch.no_grad():
        reference = call(module, x)
    stock = lambda: call(module, x)
    # provider: (the module's forward to time, install, uninstall), installed only while that provider is timed.
    providers = {
        "eager": (stock, None, None),
        "ldmopt-processor": (stock, _install_processors, T.uninstall_processors),
        "ldmopt": (stock, temporal_layout.install_temporal_blocks, temporal_layout.uninstall_temporal_blocks),
    }
    if not QUICK:
        providers["compile"] = (harness.compiled(stock, mode="max-autotune-no-cudagraphs"), None, None)
    params, grad_out = (), None
    if mode == "fwd+bwd":
        module.train()
        x.requires_grad_(True)
        grad_out = torch.randn_like(reference)
        params = [x, *module.parameters()]
    for name, (fn, install, uninstall) in providers.items():
        run = harness.step_of(fn, mode, params, grad_out)
        temporal_layout.fallback_reasons.clear()
        installed = install(module) if install else None
        try:
            if name == "ldmopt":
                assert installed.blocks, f"nothing installed: {installed.skipped}"
            with torch.no_grad():
                note = f"max rel err vs eager {harness.max_rel_err(fn(), reference):.1e}"
            timing, peak = harness.time_fn(run), harness.peak_memory(run)
            if name == "ldmopt" and any(f.fallback_reasons for f in installed.forwards.values()):
                reasons = {r for f in installed.forwards.values() for r in f.fallback_reasons}
                note = "fell back to diffusers: " + "; ".join(sorted(reasons))
        except Exception as exc:  # a provider that cannot run is a row with the reason
            timing, peak, note = None, None, harness.error_note(exc)
        finally:
            if installed is not None:
                uninstall(installed)
        bench_recorder.record(
            op="temporal_block", case=case, dtype=str(dtype).removeprefix("torch."), mode=mode, provider=name,
            timing=timing, bytes=nbytes, peak_mem=peak, note=note,
        )  # fmt: skip
