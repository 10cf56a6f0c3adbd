"""The published profiling findings behind ldmopt, and the generator of docs/profiling.md.

``python -m ldmopt.profiler.studies [--out docs/profiling.md] [--no-measure]`` recomputes every analytic number
with ``analyze`` (meta tensors, no GPU) and, unless ``--no-measure``, a small CPU-measured profile, and writes the
page. Numbers are labelled ANALYTIC (FLOPs counted, times projected with a roofline on datasheet peaks) or MEASURED
(with the device). Published figures are quoted as reported, never recomputed.
"""

from __future__ import annotations

import argparse
import os
import platform
from dataclasses import dataclass

from . import categories as C

GOLDEN = 'Golden et al., "Generative AI Beyond LLMs: System Implications of Multi-Modal Generation", ISPASS 2024'
ALDOUS = "Aldous & Abdelmoniem, EuroMLSys 2024 (training profile of an LDM, their public profiler dump)"


@dataclass(frozen=True)
class Finding:
    claim: str
    value: str
    source: str


FINDINGS = (
    Finding(
        "convolution share of execution time in diffusion text-to-image models, after FlashAttention",
        "up to 44%",
        GOLDEN,
    ),
    Finding("linear-layer share of execution time in transformer-based text-to-image models", "up to 49%", GOLDEN),
    Finding("temporal attention share of all attention time in text-to-video models", "over 60%", GOLDEN),
    Finding(
        "variation of attention sequence length within one diffusion step (64x64, 32x32, 16x16, 8x8 levels)",
        "up to 4x",
        GOLDEN,
    ),
    Finding(
        "GPU time of an LDM training step: cuDNN conv forward / bmm / conv backward / GroupNorm / NCHW->NHWC",
        "25% / 23% / 7.5% / 4.4% / 3.95%",
        ALDOUS,
    ),
)

TTI_UNETS = (("sd15", (256, 512, 768, 1024)), ("sd21", (768,)), ("sdxl", (1024,)))
TTI_TRANSFORMERS = (("dit", 256), ("pixart-alpha", 1024), ("pixart-sigma", 1024), ("sd3", 1024), ("flux", 1024))
TTV = (("animatediff", 512), ("modelscope", 256), ("svd", (576, 1024)), ("latte", 512))
FRAMES = (8, 16, 32, 64)
GPU = "H100"


def _p(x: float) -> str:
    return f"{100 * x:.1f}%"


def _table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _res(a) -> str:
    return f"{a.resolution[0]}x{a.resolution[1]}"


def _conv_section(analyze) -> list[str]:
    rows = []
    for name, resolutions in TTI_UNETS:
        for res in resolutions:
            a = analyze(name, resolution=res, gpu=GPU)
            t, tp, f = a.shares("time"), a.shares("time", patched=True), a.shares("flops")
            rows.append(
                [
                    name,
                    _res(a),
                    f"{a.total_flops / 1e12:.2f}",
                    _p(f[C.CONV]),
                    _p(t[C.CONV]),
                    _p(tp[C.CONV]),
                    _p(t[C.NORM] + t[C.ELEMENTWISE]),
                    f"{a.time_s * 1e3:.1f} -> {a.patched_time_s * 1e3:.1f}",
                ]
            )
    return [
        "### Convolution in diffusion text-to-image (study: up to 44% of time after FlashAttention)",
        "",
        f"ANALYTIC, batch 2 (classifier-free guidance), fp16, one UNet call; time = roofline projection on {GPU}.",
        "",
        _table(
            [
                "model",
                "resolution",
                "TFLOP",
                "conv FLOPs",
                "conv time (as is)",
                "conv time (patched)",
                "norm+elementwise time",
                f"projected ms on {GPU} (as is -> patched)",
            ],
            rows,
        ),
        "",
        "The projection assumes every kernel runs at its roofline (attention as one fused FlashAttention-style kernel),"
        " so it is the post-FlashAttention setting of the study. Removing the GroupNorm/SiLU passes and elementwise"
        ' tails (the "patched" column) raises the convolution share further: the remaining time is the GEMM/conv work'
        " itself.",
        "",
    ]


def _linear_section(analyze) -> list[str]:
    rows = []
    for name, res in TTI_TRANSFORMERS:
        a = analyze(name, resolution=res, gpu=GPU)
        t, f = a.shares("time"), a.shares("flops")
        attn_t = sum(t[c] for c in C.ATTENTION)
        rows.append(
            [
                name,
                _res(a),
                str(a.batch),
                f"{a.total_flops / 1e12:.2f}",
                _p(f[C.LINEAR]),
                _p(t[C.LINEAR]),
                _p(attn_t),
                _p(t[C.ELEMENTWISE] + t[C.NORM] + t[C.LAYOUT]),
            ]
        )
    return [
        "### Linear layers in transformer text-to-image (study: up to 49% of time)",
        "",
        f"ANALYTIC, fp16, one transformer call; time = roofline projection on {GPU}.",
        "",
        _table(
            [
                "model",
                "resolution",
                "batch",
                "TFLOP",
                "linear FLOPs",
                "linear time",
                "attention time",
                "norm+elementwise+layout time",
            ],
            rows,
        ),
        "",
    ]


def _temporal_section(analyze) -> list[str]:
    rows, kernel_shares, module_shares = [], [], []
    for name, res in TTV:
        for a in (analyze(name, resolution=res, frames=f, gpu=GPU) for f in FRAMES):
            split_t, split_f = a.attention_split("time"), a.attention_split("flops")
            kernel_shares.append(split_t["temporal"])
            module_shares.append(a.attention_layer_split()["temporal"])
            rows.append(
                [
                    name,
                    _res(a),
                    str(a.frames),
                    f"{a.total_flops / 1e12:.1f}",
                    _p(split_f["temporal"]),
                    _p(split_t["temporal"]),
                    _p(a.attention_layer_split()["temporal"]),
                    f"{a.flops_of(C.ATTN_TEMPORAL) / 1e12:.3f}",
                    f"{a.flops_of(C.ATTN_SPATIAL) / 1e12:.2f}",
                ]
            )
    return [
        "### Temporal attention in text-to-video (study: over 60% of attention time)",
        "",
        f"ANALYTIC, batch 2, fp16; time = roofline projection on {GPU}. Temporal attention FLOPs grow as F^2 with the"
        ' frame count F (each pixel attends over F frames), spatial attention FLOPs as F (F images). "Attention'
        ' modules" counts whole attention layers (Q/K/V/output projections included), the view of a module-level'
        " profile; the other columns count the attention computation alone.",
        "",
        _table(
            [
                "model",
                "resolution",
                "frames",
                "TFLOP",
                "temporal / attention FLOPs",
                "temporal / attention time",
                "temporal / attention modules time",
                "temporal attn TFLOP",
                "spatial attn TFLOP",
            ],
            rows,
        ),
        "",
        f"The projected share ({_p(min(kernel_shares))} to {_p(max(kernel_shares))} of attention time;"
        f" {_p(min(module_shares))} to {_p(max(module_shares))} counting whole attention modules) stays below the"
        " measured one and does not grow with the frame count, and that gap is the point: at F = 8..64 a temporal"
        " attention has a few KB of work per (pixel, head), arithmetic intensity of about F/2 FLOP/byte, and tens of"
        " thousands of independent problems (batch x pixels x heads = 65,536 for AnimateDiff at 512). An ideal kernel"
        " is purely bandwidth-bound and cheap. General-purpose attention kernels tile queries and keys by 64-128"
        " (most of each tile is padding at F = 16), pad head dims 40/80/160 to powers of two, and the model needs"
        " permute copies around every temporal block; none of that is in a roofline. ldmopt's temporal kernel targets"
        " that gap (strided reads, FxF scores in registers, batch on grid axis 0). A GPU run of `ldmopt profile` on"
        " these models measures it.",
        "",
    ]


def _seq_section(analyze) -> list[str]:
    a = analyze("sd15", resolution=512, gpu=GPU)
    rows = [
        [g["kind"], f"{g['q_len']} x {g['kv_len']}", str(g["head_dim"]), str(g["calls"]), _p(g["flops_share"])]
        for g in a.sequence_lengths()
    ]
    return [
        "### Sequence lengths within one step (study: up to 4x variation)",
        "",
        "ANALYTIC, SD1.5 512x512, batch 2: every attention call of one UNet call, grouped by shape.",
        "",
        _table(["kind", "query x key tokens", "head dim", "calls", "share of attention FLOPs"], rows),
        "",
        "Query length changes 4x between consecutive levels (4096, 1024, 256, 64 tokens): 64x from the first level"
        " to the last. Kernels are tuned per level for this reason.",
        "",
    ]


def _scaling_section(analyze) -> list[str]:
    rows = []
    for res in (256, 512, 768, 1024):
        a = analyze("sd15", resolution=res, gpu=GPU)
        rows.append(
            [str(res), *(f"{a.flops_of(c) / 1e9:.0f}" for c in (C.CONV, C.LINEAR, C.ATTN_SPATIAL, C.ATTN_CROSS))]
        )
    return [
        "### Scaling with image size (SD1.5, batch 2)",
        "",
        "ANALYTIC GFLOP per UNet call. Tokens grow as resolution^2: convolution, linear and cross-attention FLOPs"
        " grow with the token count N, self-attention FLOPs with N^2.",
        "",
        _table(["resolution", "convolution", "linear", "attention: spatial self", "attention: cross"], rows),
        "",
    ]


def _training_rows(a) -> list[list[str]]:
    """Lines of a training profile from an analytic training step: convolution forward and backward apart."""
    step = a.step_shares()

    def share(phases, cats):
        return _p(sum(step.get((p, c), 0.0) for p in phases for c in cats))

    both = ("forward", "backward")
    return [
        ["convolution forward", share(("forward",), (C.CONV,))],
        ["convolution backward", share(("backward",), (C.CONV,))],
        ["linear/GEMM (fwd + bwd)", share(both, (C.LINEAR,))],
        ["attention (fwd + bwd, fused kernels)", share(both, C.ATTENTION)],
        ["normalisation (fwd + bwd)", share(both, (C.NORM,))],
        ["elementwise/activation (fwd + bwd)", share(both, (C.ELEMENTWISE,))],
        ["layout conversions and copies", share(both, (C.LAYOUT,))],
        ["AdamW update", share(("optimizer",), C.CATEGORIES)],
    ]


def _training_section(analyze, measure: bool) -> list[str]:
    steps = [analyze("sd15", resolution=256, batch=batch, gpu=GPU, training=True) for batch in (2, 32)]
    a = steps[0]
    columns = [_training_rows(step) for step in steps]
    rows = [[lines[0][0], *(line[1] for line in lines)] for lines in zip(*columns)]
    lines = [
        "### Training profile (study: conv fwd 25%, bmm 23%, conv bwd 7.5%, GroupNorm 4.4%, NCHW->NHWC 3.95%)",
        "",
        "ANALYTIC training step (`analyze(..., training=True)`, `ldmopt analyze --training`): forward, MSE loss,"
        " backward (every parameter's gradient; attention's as one FlashAttention backward) and a foreach AdamW"
        f" update, SD1.5 at 256x256 (the LDM training resolution), {a.dtype} weights and optimizer states, shares of"
        f" the roofline-projected step time on {GPU}. FLOPs per step at batch 2:"
        f" {a.flops_of(*C.CATEGORIES, phase='forward') / 1e9:.0f} G forward,"
        f" {a.flops_of(*C.CATEGORIES, phase='backward') / 1e9:.0f} G backward.",
        "",
        _table(["line of the profile", *(f"batch {s.batch}" for s in steps)], rows),
        "",
        "A roofline cannot give the study's split of convolution time (forward 25%, backward 7.5%): the input and"
        " weight gradients each cost the forward's FLOPs, so the convolution backward projects at twice the forward."
        " Nor its bmm line: without a fused attention kernel attention runs as bmm + softmax, which a kernel-level"
        " profile reports as bmm. AdamW's update moves every parameter, gradient and moment several times whatever the"
        " batch, so at small batches it leads the step (in fp32 master weights, as mixed-precision training keeps"
        " them, its bytes double). fp16 convolutions on NCHW tensors also make cuDNN convert layouts (nchwToNhwc"
        " kernels) around the tensor-core kernel, which a count of operators cannot see. `ldmopt profile --training`"
        " measures all of these on a GPU (layout kernels fall in the layout category).",
        "",
    ]
    if measure:
        lines += _measured_training()
    return lines


def _measured_training() -> list[str]:
    import torch

    from .. import configs
    from .measure import profile

    model = configs.build_model("sd15", tiny=True, device="cpu", dtype=torch.float32)
    inputs = configs.example_inputs(model, resolution=64, batch=2)
    p = profile(model, inputs=inputs, steps=2, warmup=1, wait=1, training=True)
    total = p.total_us or 1.0

    def op_share(category, predicate):
        return sum(t for name, t, _ in p.top(category, 1000) if predicate(name)) / total

    conv_bwd = op_share(C.CONV, lambda n: "backward" in n)
    rows = [
        ["convolution forward", _p(p.shares()[C.CONV] - conv_bwd)],
        ["convolution backward", _p(conv_bwd)],
        ["linear/GEMM (fwd + bwd)", _p(p.shares()[C.LINEAR])],
        ["attention (fwd + bwd)", _p(sum(p.shares()[c] for c in C.ATTENTION))],
        ["normalisation", _p(p.shares()[C.NORM])],
        ["elementwise/activation (incl. optimizer)", _p(p.shares()[C.ELEMENTWISE])],
        ["layout conversions and copies", _p(p.shares()[C.LAYOUT])],
    ]
    return [
        "MEASURED on CPU (CPU operator time, not GPU time; tiny random-weight SD1.5-family UNet, 64x64 pixels, batch 2,"
        " fp32, AdamW; wait/warmup/active = 1/1/2): shares of a training step. CPU kernels have a different balance"
        " from cuDNN/cuBLAS, so this shows what the tool reports, not what a GPU does. One run's shares: CPU operator"
        " times vary between runs, on a shared machine by tens of percentage points.",
        "",
        _table(["category", "share (CPU-measured)"], rows),
        "",
    ]


def _fusion_section(analyze) -> list[str]:
    rows = []
    for name, res, frames in (
        ("sd15", 512, None),
        ("sdxl", 1024, None),
        ("pixart-alpha", 1024, None),
        ("flux", 1024, None),
        ("animatediff", 512, 16),
        ("svd", (576, 1024), 14),
    ):
        a = analyze(name, resolution=res, frames=frames, gpu=GPU)
        top = sorted(a.fusions.items(), key=lambda kv: -kv[1].bytes_saved)[:3]
        rows.append(
            [
                name,
                f"{a.total_bytes / 1e9:.1f} -> {a.patched_bytes / 1e9:.1f}",
                f"{a.time_s * 1e3:.1f} -> {a.patched_time_s * 1e3:.1f}",
                "; ".join(f"{k} ({v.bytes_saved / 1e9:.1f} GB)" for k, v in top if v.count),
            ]
        )
    return [
        "### What the fusions remove (projection)",
        "",
        f"ANALYTIC: minimum HBM bytes and roofline time on {GPU}, unpatched vs as ldmopt patches the model, from the"
        " recorded data flow (rules in `ldmopt/profiler/fusions.py`), projected for the placements a GPU runs by"
        " default (placement 'auto': cuDNN's conv and cuBLAS's GEMMs with ldmopt's passes around them; `ldmopt analyze"
        " --placement triton` projects ldmopt's Triton kernels). Default settings of each model.",
        "",
        _table(["model", "GB moved", f"projected ms on {GPU}", "largest savings"], rows),
        "",
    ]


def _measured_inference() -> list[str]:
    import torch

    from .. import configs
    from .measure import profile

    model = configs.build_model("sd15", tiny=True, device="cpu", dtype=torch.float32)
    p = profile(model, inputs=configs.example_inputs(model, resolution=64, batch=2), steps=3, warmup=1)
    rows = [[C.LABELS[k], _p(s)] for k, s in p.shares().items() if s >= 0.0005]
    return [
        "### A measured profile (CPU)",
        "",
        "MEASURED on CPU (CPU operator self time): tiny random-weight SD1.5-family UNet, 64x64 pixels, batch 2, fp32,"
        f" 3 active steps; {100 * p.classified_share():.1f}% of operator time classified into named categories. One"
        " run's shares: CPU operator times vary between runs, on a shared machine by tens of percentage points.",
        "",
        _table(["category", "share (CPU-measured)"], rows),
        "",
    ]


def render(measure: bool = True) -> str:
    import diffusers
    import torch

    from .cost import analyze

    lines = [
        "# Profiling: the studies' findings beside ldmopt's numbers",
        "",
        "Generated by `python -m ldmopt.profiler.studies --out docs/profiling.md`; do not edit by hand.",
        f"Environment of this run: torch {torch.__version__}, diffusers {diffusers.__version__},"
        f" Python {platform.python_version()}, {'no GPU' if not torch.cuda.is_available() else 'GPU present'}.",
        "",
        "Labels: **ANALYTIC** numbers come from `ldmopt analyze` on meta tensors: FLOPs are counted exactly (equal to"
        " `torch.utils.flop_counter`), bytes are the minimum HBM traffic (each operator input read once, each output"
        f" written once), times are roofline **projections** on the {GPU} datasheet peaks, never measurements."
        " **MEASURED** numbers come from `ldmopt profile` and name the device they ran on. Published figures are"
        " quoted as reported.",
        "",
        "## Published findings",
        "",
        _table(["finding", "reported", "source"], [[f.claim, f.value, f.source] for f in FINDINGS]),
        "",
        "## Side by side",
        "",
    ]
    lines += _conv_section(analyze)
    lines += _linear_section(analyze)
    lines += _temporal_section(analyze)
    lines += _seq_section(analyze)
    lines += _scaling_section(analyze)
    lines += _training_section(analyze, measure)
    lines += _fusion_section(analyze)
    if measure:
        lines += _measured_inference()
    lines += [
        "## Reproduce",
        "",
        "```",
        "ldmopt analyze sd15 --resolution 256,512,768,1024 --plot sd15.png",
        "ldmopt analyze animatediff --frames 8,16,32,64 --json animatediff.json",
        "ldmopt analyze sd15 --resolution 256 --batch 32 --training                 # a training step, by phase",
        "ldmopt profile sdxl --resolution 1024 --trace sdxl.json --device cuda     # CUDA kernel time",
        "ldmopt profile sd15 --training --tensorboard runs/sd15 --device cuda      # training step, wait/warmup/active",
        "ldmopt profile animatediff --patched --device cuda                         # the split after ldmopt's fusions",
        "```",
        "",
        "The three `profile` lines build real-size models: run them on a GPU. The measured CPU tables above come from "
        "the",
        "tiny SD1.5 at 64 px (`python -m ldmopt.profiler.studies` rewrites this page), which a CPU runs in about a "
        "minute:",
        "",
        "```",
        "ldmopt profile sd15 --tiny --resolution 64 --device cpu --steps 3 --warmup 1",
        "ldmopt profile sd15 --tiny --resolution 64 --device cpu --training --steps 2 --warmup 1 --wait 1",
        "ldmopt profile animatediff --tiny --patched --device cpu   # no table above: the patched split, tiny",
        "```",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Regenerate docs/profiling.md")
    parser.add_argument("--out", default="docs/profiling.md")
    parser.add_argument("--no-measure", action="store_true", help="analytic numbers only (skip the CPU profiles)")
    args = parser.parse_args(argv)
    folder = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(folder):  # checked before the minute of profiling, not after
        parser.error(f"--out {args.out}: folder {folder} does not exist (outside a checkout, give --out a path)")
    text = render(measure=not args.no_measure)
    with open(args.out, "w") as f:
        f.write(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
