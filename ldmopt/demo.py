"""``ldmopt demo``: run a small diffusion model unpatched and patched, check the outputs agree, time both.

The default (``--model sd``) is a whole StableDiffusionPipeline built offline: the tiny SD1.5 UNet and VAE of
``ldmopt.configs`` with random weights from a fixed seed, a tiny CLIP text encoder and a byte-level CLIP tokenizer
constructed in memory. Other ``--model`` names (the zoo's tiny denoisers: dit, animatediff, svd, ...) run the
denoiser alone for ``--steps`` calls. Heavy imports (diffusers, transformers) happen inside :func:`run_demo`.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
import warnings
from typing import Any

#: Images in [0, 1] (sd) or denoiser outputs: patched vs stock max abs difference allowed, per dtype name.
TOLERANCE = {"float32": 2e-3, "float16": 3e-2, "bfloat16": 6e-2}
DTYPES = ("auto", "float32", "float16", "bfloat16", "fp32", "fp16", "bf16")
#: the short names analyze, profile and tune take, accepted here too
_DTYPE_ALIASES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
TEXT_HIDDEN_LAYERS = 2
TEXT_TOKENS = 77
PROMPT = "a photograph of an astronaut riding a horse"


def _model_choices() -> list[str]:
    try:
        from .configs import names
    except ImportError:
        return ["sd"]
    return ["sd", "sd15", *(n for n in names() if n not in ("sd15",))]


def configure_demo(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="sd", choices=_model_choices(),
                        help="sd (or sd15, its zoo name): a tiny StableDiffusionPipeline (default); other names: "
                             "that zoo family's tiny denoiser alone")  # fmt: skip
    parser.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda, cuda:1 ...")
    parser.add_argument("--dtype", default="auto", choices=DTYPES,
                        help="auto: float16 on cuda, float32 on cpu (fp16, bf16, fp32 are accepted too)")  # fmt: skip
    parser.add_argument("--steps", type=int, default=4, help="denoising steps (or denoiser calls); default 4")
    parser.add_argument("--backend", default="auto", choices=("auto", "torch", "triton"),
                        help="ldmopt backend of the patched run; on cpu, triton = the Triton interpreter")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights and inputs; default 0")
    parser.add_argument("--save", metavar="PNG", help="write the stock and patched images side by side (sd only)")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="also time the stock and the patched run with the denoiser replayed as CUDA graphs "
                             "(ldmopt.cuda_graphs; needs a CUDA device)")  # fmt: skip
    parser.add_argument("--tune", action="store_true",
                        help="patch with ldmopt.tune: only the modules whose fused forward measured faster than the "
                             "stock one over the demo's run (prints the per-module table)")  # fmt: skip


# ------------------------------------------------------------------------------------------------ building


def channels_last(obj):
    """A 4-D tensor, or a model's 4-D weights (in place), in channels-last: the layout the fused GroupNorm->conv
    kernels read (ResnetBlock2D given NCHW input runs diffusers' forward). 5-D weights (Conv3d) stay as they are."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.to(memory_format=torch.channels_last)
    for p in obj.parameters():
        if p.dim() == 4:
            p.data = p.data.to(memory_format=torch.channels_last)
    return obj


def channels_last_call(model, inputs) -> None:
    """``model``'s 4-D weights and the 4-D tensors of ``inputs`` (configs.ModelInputs) in channels-last, in place: how
    ldmopt's fused convs are meant to run."""
    import torch

    channels_last(model)
    kwargs = inputs.kwargs
    kwargs.update({k: channels_last(v) for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.dim() == 4})


def build_tiny_sd_pipeline(device: Any = "cpu", dtype: Any = None, seed: int = 0):
    """A StableDiffusionPipeline with random tiny weights (fixed seed), built without any download."""
    import torch
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer
    from transformers.utils import logging as transformers_logging

    # diffusers' pipeline imports make transformers warn about optional vision backends this demo does not use.
    transformers_logging.set_verbosity_error()
    from diffusers import DDIMScheduler, StableDiffusionPipeline
    from tokenizers.pre_tokenizers import ByteLevel

    from .configs import build_model

    dtype = dtype or torch.float32
    torch.manual_seed(seed)
    unet = channels_last(build_model("sd15", tiny=True, device=device, dtype=dtype))
    vae = channels_last(build_model("sd15-vae", tiny=True, device=device, dtype=dtype))
    # Byte-level vocabulary without merges: every character is a token, which is all a tiny demo needs.
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for suffix in ("", "</w>"):
        for ch in sorted(ByteLevel.alphabet()):
            vocab.setdefault(ch + suffix, len(vocab))
    tokenizer = CLIPTokenizer(vocab=vocab, merges=[], model_max_length=TEXT_TOKENS)
    width = unet.config.cross_attention_dim
    text_config = CLIPTextConfig(
        vocab_size=len(vocab), hidden_size=width, intermediate_size=2 * width, num_hidden_layers=TEXT_HIDDEN_LAYERS,
        num_attention_heads=2, max_position_embeddings=TEXT_TOKENS, bos_token_id=0, eos_token_id=1, pad_token_id=1,
    )  # fmt: skip
    text_encoder = CLIPTextModel(text_config).to(device=device, dtype=dtype).eval()
    scheduler = DDIMScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False, set_alpha_to_one=False,
        steps_offset=1,
    )  # fmt: skip
    pipe = StableDiffusionPipeline(
        vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet, scheduler=scheduler,
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )  # fmt: skip
    pipe.set_progress_bar_config(disable=True)
    return pipe


def sd_image_size(pipe) -> int:
    """Pixels per side giving the tiny UNet 16x16 latents (every level at least 2x2)."""
    return 16 * pipe.vae_scale_factor


def run_sd(pipe, steps: int, seed: int):
    """(images (B, 3, H, W) in [0, 1], seconds per denoising step)."""
    import torch

    stamps: list[float] = []

    def on_step_end(_pipe, _step, _t, kwargs):
        stamps.append(time.perf_counter())
        return kwargs

    size = sd_image_size(pipe)
    generator = torch.Generator("cpu").manual_seed(seed)
    start = time.perf_counter()
    with torch.no_grad():
        images = pipe(PROMPT, num_inference_steps=steps, height=size, width=size, generator=generator,
                      output_type="pt", callback_on_step_end=on_step_end).images  # fmt: skip
    marks = [start, *stamps]
    # The first interval also holds text encoding and latent setup; the median of the rest is the step time.
    per_step = [b - a for a, b in itertools.pairwise(marks)]
    return images.float().cpu(), statistics.median(per_step[1:] or per_step)


def run_denoiser(model, inputs, steps: int):
    """(last output, seconds per call) for ``steps`` calls of a zoo denoiser."""
    import torch

    from .configs import run_model

    times, out = [], None
    with torch.no_grad():
        for _ in range(steps):
            start = time.perf_counter()
            out = run_model(model, inputs)
            _sync(out)
            times.append(time.perf_counter() - start)
    out = out[0] if isinstance(out, tuple) else getattr(out, "sample", out)
    return out.float().cpu(), statistics.median(times[1:] or times)


def _sync(out) -> None:
    import torch

    t = out[0] if isinstance(out, tuple) else out
    if isinstance(t, torch.Tensor) and t.is_cuda:
        torch.cuda.synchronize(t.device)


# ------------------------------------------------------------------------------------------------ reporting


def _category_split(run, modules: dict, device) -> str:
    """The per-category time split of one patched run (ldmopt.profiler), or why it is not shown."""
    try:
        from .profiler import profile
    except ImportError:
        return "per-category time split: not available (ldmopt.profiler is not part of this build)"
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Profiler won't be using warmup")  # one run is enough here
            result = profile(run, modules=modules, steps=1, warmup=0, device=str(device))
    except Exception as exc:  # the split is informative; never fail the demo on it
        return f"per-category time split: unavailable ({type(exc).__name__}: {exc})"
    return f"per-category time split of one patched run:\n{result}"


def _save_side_by_side(path: str, stock, patched) -> None:
    import numpy as np
    from PIL import Image

    def to_uint8(images):
        return (images[0].clamp(0, 1).permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)

    both = np.concatenate([to_uint8(stock), to_uint8(patched)], axis=1)
    Image.fromarray(both).save(path)


def _resolve(args) -> tuple[Any, Any, str]:
    import torch

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    name = _DTYPE_ALIASES.get(args.dtype, args.dtype)
    if name == "auto":
        name = "float16" if device.type == "cuda" else "float32"
    return device, getattr(torch, name), name


def _backend_note(device, backend: str) -> str:
    if device.type == "cuda":
        return f"backend: {backend} (cuda device: ldmopt's Triton/CUDA kernels where they accept the inputs)"
    if backend == "triton":
        return "backend: triton on cpu -> the Triton interpreter (TRITON_INTERPRET=1): exact kernels, slow"
    if os.environ.get("TRITON_INTERPRET") == "1" and backend == "auto":
        return "backend: auto on cpu with TRITON_INTERPRET=1 -> Triton kernels in the interpreter where they accept"
    return (
        f"backend: {backend} on cpu -> the reference backend (torch) runs ldmopt's ops; "
        "--backend triton runs the Triton kernels in the interpreter (several minutes on a CPU)"
    )


def _graphed_run(target, run, device, stock, how: str | None, dtype_name: str) -> str:
    """``run()`` with the denoiser replayed as CUDA graphs (``--cuda-graphs``): the lines to print (time per step,
    agreement with the stock eager run, the graphs' summary), or why it was skipped."""
    import torch

    from . import graphs

    refusal = graphs._BACKEND.supports(device)
    if refusal is not None:
        return f"--cuda-graphs skipped: {refusal}\n" if how is None else ""
    handle = graphs.cuda_graphs(target)
    try:
        with warnings.catch_warnings():  # the eager calls and their reasons are in the summary printed below
            warnings.simplefilter("ignore", RuntimeWarning)
            out, step = run()
    finally:
        summary = str(handle)
        handle.remove()
    err = (out - stock).abs().max().item()
    agree = bool(torch.isfinite(out).all()) and err <= TOLERANCE[dtype_name]
    label = "stock" if how is None else how
    lines = [
        f"time per step, {label} + CUDA graphs: {step * 1e3:.1f} ms (max abs difference from stock eager "
        f"{err:.2e}: {'agrees' if agree else 'DOES NOT AGREE'})",
        *summary.splitlines()[1:],
    ]
    return "\n".join(lines) + "\n"


def run_demo(args: argparse.Namespace) -> int:
    if args.model == "sd15":  # the zoo's name of the SD1.5 family: the demo's pipeline
        args.model = "sd"
    if args.steps < 1:
        print("ldmopt demo: --steps must be at least 1", file=sys.stderr)
        return 2
    device, dtype, dtype_name = _resolve(args)
    if device.type == "cpu" and args.backend == "triton":
        # Must be set before any Triton kernel is defined (triton.jit reads it when decorating).
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    import ldmopt
    from ldmopt.ops._dispatch import BackendUnavailableError
    from ldmopt.patch import patch, tune, unpatch

    print(f"ldmopt demo: model={args.model} device={device} dtype={dtype_name} steps={args.steps} seed={args.seed}")
    print(_backend_note(device, args.backend))
    if args.model == "sd":
        try:
            pipe = build_tiny_sd_pipeline(device, dtype, args.seed)
        except ImportError as exc:  # transformers/tokenizers build the text encoder; they are not core dependencies
            print(f"ldmopt demo: the sd pipeline needs transformers ({exc}); pip install transformers", file=sys.stderr)
            return 2
        target, modules = pipe, {"unet": pipe.unet, "vae": pipe.vae}
        run = lambda: run_sd(pipe, args.steps, args.seed)
    else:
        from .configs import build_model, example_inputs

        torch.manual_seed(args.seed)
        target = build_model(args.model, tiny=True, device=device, dtype=dtype)
        # SVD's context is one image-embedding token (the tiny default would be a 7-token text context).
        tokens = 1 if type(target).__name__ == "UNetSpatioTemporalConditionModel" else None
        inputs = example_inputs(target, text_tokens=tokens)
        channels_last_call(target, inputs)
        modules = {args.model: target}
        run = lambda: run_denoiser(target, inputs, args.steps)

    stock, stock_step = run()
    graphed_note = _graphed_run(target, run, device, stock, None, dtype_name) if args.cuda_graphs else ""
    if args.tune:
        try:
            with ldmopt.use_backend(args.backend):
                report = tune(target, run, warmup=1, repeats=3)
        except BackendUnavailableError as exc:  # tune leaves the model stock when run() raises
            print(f"ldmopt demo: --backend {args.backend}: {exc}", file=sys.stderr)
            return 2
    else:
        report = patch(target)
    try:  # the caller's model is left as it was, whatever happens below
        with ldmopt.use_backend(args.backend):
            try:
                patched, patched_step = run()
            except BackendUnavailableError as exc:  # a forced backend that cannot run these inputs
                print(f"ldmopt demo: --backend {args.backend}: {exc}", file=sys.stderr)
                return 2
            summary = str(report)  # its call counts cover the patched run, not the profiling run below
            nothing = "per-category time split: nothing patched"
            split = _category_split(run, modules, device) if report.total else nothing
        print(summary)
        err = (patched - stock).abs().max().item()
        tol = TOLERANCE[dtype_name]
        agree = bool(torch.isfinite(patched).all()) and err <= tol
        print(f"outputs agree: {'yes' if agree else 'NO'} (max abs difference {err:.2e}, tolerance {tol:.0e})")
        how = "tuned" if args.tune else "patched"
        print(f"time per step: stock {stock_step * 1e3:.1f} ms, {how} {patched_step * 1e3:.1f} ms")
        if args.cuda_graphs:
            with ldmopt.use_backend(args.backend):
                graphed_note += _graphed_run(target, run, device, stock, how, dtype_name)
            print(graphed_note.rstrip())
        if device.type == "cpu":
            print("(cpu timings of a tiny random model say nothing about GPU speed)")
        print(split)
        if args.save:
            if args.model == "sd":
                _save_side_by_side(args.save, stock, patched)
                print(f"saved stock | patched images to {args.save}")
            else:
                print("--save: only the sd pipeline produces images; nothing saved")
        return 0 if agree else 1
    finally:
        unpatch(target)
