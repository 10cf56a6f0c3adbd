"""RMSNorm at query/key-norm shapes: ldmopt's row kernel vs diffusers' RMSNorm (eight eager passes with an fp32 copy)
vs torch's fused ``F.rms_norm`` (what torch.nn.RMSNorm runs: Flux, Wan) vs torch.compile of diffusers' module.

Cases: SD3.5-large per-head q/k norms at 1024 px (2 x 4096 tokens x 38 heads of 64, bf16 weight), a HunyuanVideo-size
per-head norm (1 x 33,000 tokens x 24 heads of 128), and a whole-row norm of 3072. Bytes: x read once, y written once
(forward); x and dy read, dx written (backward part). LDMOPT_BENCH_QUICK=1 keeps the first case, forward only, no
compile.

``bench_rms_norm_rope``: an attention's query norm followed by its RoPE (one query; the key is the same again): Wan's
norm across heads at 480p x 81 frames (32,760 tokens) for Wan 2.1 1.3B (1536 = 12 x 128) and 14B (5120 = 40 x 128),
Flux.1's per-head norm at 1024 px (4096 image + 512 text tokens, 24 heads of 128) and Qwen-Image's at 1328 px (6889
image + 256 text tokens; diffusers' RMSNorm and a complex rotation). Providers: torch's fused norm
+ diffusers' rotation (Wan: eight elementwise passes over strided halves; Flux: negation, interleave, fp32 casts,
multiplies, add, cast back) vs ldmopt's one kernel (``rms_norm(..., rope=)``) vs torch.compile of the pair. Bytes: q
read once and written once.

``bench_rms_norm_rope_joint``: Flux.1's double-stream query at 1024 px: the text (512) and image (4096) streams each
normalised with their own weight, concatenated and rotated (diffusers: two norms, the concatenation, the rotation)
vs ldmopt's one kernel writing the joint tensor (``rms_norm((text, image), ..., cat_dim=1)``) vs torch.compile.

``bench_layer_norm_rope``: CogVideoX-5B's query at 720x480 x 49 frames (226 text + 17,550 video tokens, 48 heads of
64): torch's per-head LayerNorm, the video tokens' rotation and its copy into the slice vs ldmopt's one kernel
(``layer_norm_rope``, the text rows turned by zero) vs torch.compile.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

import ldmopt
from benchmarks import harness

pytestmark = harness.gpu_only

QUICK = os.environ.get("LDMOPT_BENCH_QUICK") == "1"
DEVICE = "cuda"  # tests/benchmarks_dry_run/ runs this benchmark's logic on the CPU
SHAPES = {  # name: (rows, C)
    "sd35-qk-1024": (2 * 4096 * 38, 64),
    "hunyuanvideo-qk": (33_000 * 24, 128),
    "row-3072": (2 * 4096, 3072),
}
EPS = 1e-6


def _diffusers_eager(x, w):
    # diffusers.models.normalization.RMSNorm.forward (non-NPU path), half-precision weight
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    return (x * torch.rsqrt(variance + EPS)).to(w.dtype) * w


def _providers():
    providers = {
        "eager-diffusers": _diffusers_eager,
        "torch-rms_norm": lambda x, w: F.rms_norm(x, (x.shape[-1],), w, EPS),
        "ldmopt": lambda x, w: ldmopt.ops.rms_norm(x, w, None, EPS),
    }
    if not QUICK:  # an inductor compile costs more of the quick run's budget than the row is worth
        providers["compile"] = harness.compiled(_diffusers_eager, mode="max-autotune-no-cudagraphs")
    return providers


@pytest.mark.parametrize("case", list(SHAPES)[:1] if QUICK else list(SHAPES))
@pytest.mark.parametrize(
    "dtype", [torch.bfloat16] if QUICK else [torch.float16, torch.bfloat16], ids=["bf16"] if QUICK else ["fp16", "bf16"]
)
@pytest.mark.parametrize("mode", ["fwd"] if QUICK else ["fwd", "fwd+bwd"])
def bench_rms_norm(case, dtype, mode, bench_recorder):
    rows, c = SHAPES[case]
    x = torch.randn(rows, c, device=DEVICE, dtype=dtype)
    weight = (1 + 0.3 * torch.randn(c, device=DEVICE)).to(dtype)
    reference = _diffusers_eager(x.float(), weight.float())
    _time_providers("rms_norm", case, dtype, mode, _providers(), (x, weight), (), reference, bench_recorder)


def _time_providers(op, case, dtype, mode, providers, leaves, extra, reference, bench_recorder):
    """One row per provider ``fn(*leaves, *extra)``: forward, or forward and the gradients of ``leaves`` (x, weight).
    Bytes: x read and y written (forward); x, dy read and dx written in addition (backward)."""
    x = leaves[0]
    elem = x.element_size() * x.numel()
    if mode == "fwd+bwd":
        for t in leaves:
            t.requires_grad_(True)
    dy = torch.randn(reference.shape, device=x.device, dtype=x.dtype)
    for name, fn in providers.items():
        if mode == "fwd":
            run = lambda fn=fn: fn(*leaves, *extra)
            nbytes = 2 * elem
        else:
            run = lambda fn=fn: torch.autograd.grad(fn(*leaves, *extra), leaves, dy)
            nbytes = 5 * elem
        try:
            with torch.no_grad():
                out = fn(*leaves, *extra)
            err = ((out.float() - reference).abs().max() / reference.abs().max()).item()
            timing, note = harness.time_fn(run), f"max rel err vs fp32 {err:.1e}"
        except Exception as exc:  # a provider that cannot run is a row with the reason
            timing, note = None, f"unavailable: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:80]}"
        bench_recorder.record(
            op=op, case=case, dtype=str(dtype).removeprefix("torch."), mode=mode, provider=name, timing=timing,
            bytes=nbytes, note=note,
        )  # fmt: skip


ROPE_SHAPES = {  # name: (tokens, heads, head size, processor)
    "wan1.3b-480p": (32_760, 12, 128, "wan"),
    "flux-1024": (4096 + 512, 24, 128, "flux"),
    "qwen-image-1328": (83 * 83 + 256, 24, 128, "qwen"),
    "wan14b-480p": (32_760, 40, 128, "wan"),
}


def _tables(tokens, head_dim, processor):
    """The rotary tables as the processor receives them, fp32, each angle repeated for a pair: Wan [1, S, 1, D],
    Flux [S, D]."""
    half = head_dim // 2
    freqs = 10000.0 ** (-torch.arange(half, device=DEVICE, dtype=torch.float64) / half)
    theta = (torch.arange(tokens, device=DEVICE, dtype=torch.float64)[:, None] * freqs).repeat_interleave(2, -1)
    if processor == "qwen":  # complex [S, D/2], one angle per pair
        return torch.polar(torch.ones_like(theta[:, 0::2]), theta[:, 0::2]).to(torch.complex64)
    shape = (1, tokens, 1, head_dim) if processor == "wan" else (tokens, head_dim)
    return theta.cos().float().view(shape), theta.sin().float().view(shape)


def _wan_eager(q, w, heads, tables):
    # WanAttnProcessor: torch's RMSNorm over all heads, then the rotation on [B, S, H, D] with fp32 tables
    q = F.rms_norm(q, (q.shape[-1],), w, EPS).unflatten(2, (heads, -1))
    x1, x2 = q.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = tables[0][..., 0::2], tables[1][..., 1::2]
    out = torch.empty_like(q)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(q)


def _wan_ldmopt(q, w, heads, tables):
    angles = (tables[0][..., 0::2].flatten(0, 2), tables[1][..., 1::2].flatten(0, 2))
    return ldmopt.ops.rms_norm(q, w, None, EPS, rope=angles, rope_layout="pairs").unflatten(2, (heads, -1))


def _flux_eager(q, w, heads, tables):
    # FluxAttnProcessor: torch's RMSNorm per head on [B, S, H, D], then apply_rotary_emb(use_real_unbind_dim=-1)
    q = F.rms_norm(q.unflatten(-1, (heads, -1)), (q.shape[-1] // heads,), w, EPS)
    cos, sin = tables[0][None, :, None, :], tables[1][None, :, None, :]
    real, imag = q.reshape(*q.shape[:-1], -1, 2).unbind(-1)
    rotated = torch.stack([-imag, real], dim=-1).flatten(3)
    return (q.float() * cos + rotated.float() * sin).to(q.dtype)


def _flux_ldmopt(q, w, heads, tables):
    q = q.unflatten(-1, (heads, -1))
    return ldmopt.ops.rms_norm(q, w, None, EPS, rope=tables, rope_layout="elements", rope_dim=-3)


def _qwen_eager(q, w, heads, freqs):
    # QwenDoubleStreamAttnProcessor2_0: diffusers' RMSNorm per head, then apply_rotary_emb_qwen(use_real=False)
    q = _diffusers_eager(q.unflatten(-1, (heads, -1)), w)
    rotated = torch.view_as_complex(q.float().reshape(*q.shape[:-1], -1, 2)) * freqs.unsqueeze(1)
    return torch.view_as_real(rotated).flatten(3).type_as(q)


def _qwen_ldmopt(q, w, heads, freqs):
    pairs = torch.view_as_real(freqs)
    tables = (pairs[..., 0], pairs[..., 1])
    return ldmopt.ops.rms_norm(
        q.unflatten(-1, (heads, -1)), w, None, EPS, rope=tables, rope_layout="pairs", rope_dim=-3
    )


ROPE_PROVIDERS = {
    "wan": (_wan_eager, _wan_ldmopt), "flux": (_flux_eager, _flux_ldmopt), "qwen": (_qwen_eager, _qwen_ldmopt)
}  # fmt: skip


@pytest.mark.parametrize("case", list(ROPE_SHAPES)[:2] if QUICK else list(ROPE_SHAPES))
@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=["bf16"])
@pytest.mark.parametrize("mode", ["fwd"] if QUICK else ["fwd", "fwd+bwd"])
def bench_rms_norm_rope(case, dtype, mode, bench_recorder):
    tokens, heads, head_dim, processor = ROPE_SHAPES[case]
    c = heads * head_dim
    eager, fused = ROPE_PROVIDERS[processor]
    q = torch.randn(1, tokens, c, device=DEVICE, dtype=dtype)
    w = (1 + 0.3 * torch.randn(c if processor == "wan" else head_dim, device=DEVICE)).to(dtype)
    tables = _tables(tokens, head_dim, processor)
    reference = eager(q.float(), w.float(), heads, tables)
    providers = {"eager-diffusers": eager, "ldmopt": fused}
    if not QUICK:
        providers["compile"] = harness.compiled(eager, mode="max-autotune-no-cudagraphs")
    _time_providers("rms_norm_rope", case, dtype, mode, providers, (q, w), (heads, tables), reference, bench_recorder)


FLUX_TEXT_TOKENS = 512


def _flux_joint_eager(q, w_text, w_image, heads, tables):
    # FluxAttnProcessor, double-stream blocks: each stream's RMSNorm per head, cat([text, image]), then the rotation
    text, image = (t.unflatten(-1, (heads, -1)) for t in (q[:, :FLUX_TEXT_TOKENS], q[:, FLUX_TEXT_TOKENS:]))
    d = text.shape[-1]
    joint = torch.cat([F.rms_norm(text, (d,), w_text, EPS), F.rms_norm(image, (d,), w_image, EPS)], dim=1)
    cos, sin = tables[0][None, :, None, :], tables[1][None, :, None, :]
    real, imag = joint.reshape(*joint.shape[:-1], -1, 2).unbind(-1)
    rotated = torch.stack([-imag, real], dim=-1).flatten(3)
    return (joint.float() * cos + rotated.float() * sin).to(joint.dtype)


def _flux_joint_ldmopt(q, w_text, w_image, heads, tables):
    parts = tuple(t.unflatten(-1, (heads, -1)) for t in (q[:, :FLUX_TEXT_TOKENS], q[:, FLUX_TEXT_TOKENS:]))
    return ldmopt.ops.rms_norm(parts, (w_text, w_image), None, EPS, rope=tables, rope_layout="elements", cat_dim=1)


@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=["bf16"])
@pytest.mark.parametrize("mode", ["fwd"] if QUICK else ["fwd", "fwd+bwd"])
def bench_rms_norm_rope_joint(dtype, mode, bench_recorder):
    """Flux's double-stream query: the text and image streams normalised with their own weights, joined and rotated
    (diffusers: two norms, a concatenation, the rotation's passes; ldmopt: one kernel writing the joint tensor)."""
    tokens, heads, head_dim, _ = ROPE_SHAPES["flux-1024"]
    q = torch.randn(1, tokens, heads * head_dim, device=DEVICE, dtype=dtype)  # [text | image] projections
    w_text, w_image = ((1 + 0.3 * torch.randn(head_dim, device=DEVICE)).to(dtype) for _ in range(2))
    tables = _tables(tokens, head_dim, "flux")
    reference = _flux_joint_eager(q.float(), w_text.float(), w_image.float(), heads, tables)
    providers = {"eager-diffusers": _flux_joint_eager, "ldmopt": _flux_joint_ldmopt}
    if not QUICK:
        providers["compile"] = harness.compiled(_flux_joint_eager, mode="max-autotune-no-cudagraphs")
    leaves = (q, w_text, w_image)
    _time_providers("rms_norm_rope_joint", "flux-1024", dtype, mode, providers, leaves, (heads, tables), reference,
                    bench_recorder)  # fmt: skip


COGVIDEOX = {"cogvideox5b-49f": (226, 13 * 30 * 45, 48, 64)}  # text, video tokens (720x480, 49 frames), heads, head


def _cogvideox_eager(q, w, b, heads, text, tables):
    # CogVideoXAttnProcessor2_0: torch's LayerNorm per head on [B, H, S, D], apply_rotary_emb on the video tokens,
    # written back into the slice
    q = F.layer_norm(q.unflatten(-1, (heads, -1)).transpose(1, 2), (w.numel(),), w, b, EPS)
    video = q[:, :, text:]
    real, imag = video.reshape(*video.shape[:-1], -1, 2).unbind(-1)
    rotated = torch.stack([-imag, real], dim=-1).flatten(3)
    q[:, :, text:] = (video.float() * tables[0] + rotated.float() * tables[1]).to(q.dtype)
    return q.transpose(1, 2)


def _cogvideox_ldmopt(q, w, b, heads, text, tables):
    from ldmopt.patch.qk_norm_rope import with_identity_rows

    joint = with_identity_rows(tables, text, first=True)  # the text rows turn by zero, as the patched forward builds
    return ldmopt.ops.layer_norm_rope(q.unflatten(-1, (heads, -1)), w, b, EPS, rope=joint, rope_layout="elements",
                                      rope_dim=-3)  # fmt: skip


@pytest.mark.parametrize("case", list(COGVIDEOX))
@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=["bf16"])
@pytest.mark.parametrize("mode", ["fwd"] if QUICK else ["fwd", "fwd+bwd"])
def bench_layer_norm_rope(case, dtype, mode, bench_recorder):
    """CogVideoX-5B's query at 720x480 x 49 frames: the per-head LayerNorm and the video tokens' rotation (diffusers:
    torch's norm, about seven elementwise passes, the copy into the slice) vs ldmopt's one kernel vs torch.compile."""
    text, video, heads, head_dim = COGVIDEOX[case]
    q = torch.randn(1, text + video, heads * head_dim, device=DEVICE, dtype=dtype) + 0.3
    w = (1 + 0.3 * torch.randn(head_dim, device=DEVICE)).to(dtype)
    b = (0.1 * torch.randn(head_dim, device=DEVICE)).to(dtype)
    theta = torch.randn(video, head_dim // 2, device=DEVICE, dtype=torch.float64)
    tables = tuple(t.repeat_interleave(2, -1).float() for t in (theta.cos(), theta.sin()))
    reference = _cogvideox_eager(q.float(), w.float(), b.float(), heads, text, tables)
    providers = {"eager-diffusers": _cogvideox_eager, "ldmopt": _cogvideox_ldmopt}
    if not QUICK:
        providers["compile"] = harness.compiled(_cogvideox_eager, mode="max-autotune-no-cudagraphs")
    _time_providers("layer_norm_rope", case, dtype, mode, providers, (q, w, b), (heads, text, tables), reference,
                    bench_recorder)  # fmt: skip
