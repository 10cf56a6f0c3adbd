"""``ldmopt tune MODEL``: which of ldmopt's fused modules pay on this machine, for a zoo model at a given size.

Builds the model as ``ldmopt profile`` does (random weights from the embedded config, no downloads; channels-last
weights and inputs, as the demo runs it), runs :func:`ldmopt.tune` with one forward call under ``torch.no_grad`` as
its run() (``--training``: a training step, fp32 weights under autocast, forward, MSE loss and backward, timed rule
by rule), and prints the per-site table. Only argparse is imported at module level.
"""

from __future__ import annotations

import argparse

from ..profiler.cli import (
    _count,
    _message,
    _positive,
    _resolution,
    _write_json,
    _zoo_names,
    prepare_outputs,
    setting_problem,
)

# Checked while parsing: ldmopt.tune's and ldmopt.patch's refusals name min_speedup= and families, not the flags.


def _min_speedup(text: str) -> float:
    """argparse type: a finite number > 0."""
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


def _families(text: str) -> list[str]:
    """argparse type: a comma list of ldmopt.patch families, at least one."""
    from . import FAMILIES

    families = [f.strip() for f in text.split(",") if f.strip()]
    unknown = [f for f in families if f not in FAMILIES]
    if unknown or not families:
        what = f"unknown {', '.join(map(repr, unknown))}" if unknown else f"no family in {text!r}"
        raise argparse.ArgumentTypeError(f"{what}; expected a comma list of {', '.join(FAMILIES)}")
    return families


def configure_tune(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Time each module ldmopt.patch would fuse, stock and patched, on one forward call of a zoo model with "
        "random weights (or one training step with --training), and keep only the faster ones (ldmopt.tune): "
        "prints the per-site table."
    )
    parser.add_argument("model", help=f"zoo name: {', '.join(_zoo_names())}")
    parser.add_argument("--resolution", type=_resolution, default=None, help="pixels: 512 or 576x1024")
    parser.add_argument("--frames", type=_positive, default=None, help="frames (video models only)")
    parser.add_argument("--batch", type=_positive, default=None, help="batch (default: the zoo's)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--dtype", default=None, choices=("fp16", "bf16", "fp32"),
                        help="default fp16 on cuda (--training: bf16 autocast), fp32 on cpu")  # fmt: skip
    parser.add_argument("--tiny", action="store_true", help="the tiny random-weight variant of the model family")
    parser.add_argument("--warmup", type=_count(0), default=2, help="calls before each measurement (default 2)")
    parser.add_argument("--repeats", type=_positive, default=5, help="timed calls per configuration (default 5)")
    parser.add_argument("--rounds", type=_positive, default=3, help="refinement rounds at most (default 3)")
    parser.add_argument("--min-speedup", type=_min_speedup, default=1.0, help="keep a site when stock > fused x this")
    parser.add_argument(
        "--cuda-graph",
        action="store_true",
        help="time each configuration captured as a CUDA graph (GPU time only, for captured models)",
    )
    parser.add_argument(
        "--by",
        choices=("site", "rule"),
        default=None,
        help="site: per-site forward timing (default); rule: whole calls, each rule's sites alone (--training's)",
    )
    parser.add_argument(
        "--training",
        action="store_true",
        help="time a training step (fp32 weights, --dtype autocast, forward + backward) by rule: the choice for "
        "ldmopt.patch_tuned(..., training=True) or examples/train_ldm.py --tune-choice",
    )
    parser.add_argument(
        "--families", type=_families, default=None, help="comma list of ldmopt.patch families (default: all)"
    )
    parser.add_argument("--report", action="store_true", help="also print the whole patch report")
    parser.add_argument("--json", metavar="PATH", default=None, help="write the tuning table as JSON ('-': stdout)")
    parser.add_argument(
        "--save-choice",
        metavar="PATH",
        default=None,
        help="write what was kept as JSON, for ldmopt.patch_tuned(model, PATH) on the same model without measuring",
    )


def run_tune(args: argparse.Namespace) -> int:
    import dataclasses
    import sys

    import torch

    import ldmopt

    from ..demo import channels_last_call
    from ..profiler.measure import _resolve_target

    problem = setting_problem(args)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")  # as _resolve_target picks it
    if not problem and args.cuda_graph and torch.device(device).type != "cuda":  # tune would say cuda_graph=True
        problem = f"--cuda-graph times CUDA graphs, which run on a GPU; the model would be on {device}: --device cuda"
    if problem:
        print(f"ldmopt tune: {problem}", file=sys.stderr)
        return 2
    if not prepare_outputs("tune", json=args.json, save_choice=args.save_choice):
        return 2
    dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
    setting = dict(resolution=args.resolution, frames=args.frames, batch=args.batch)
    try:
        if args.training and args.by == "site":
            raise ValueError("--training times whole training steps rule by rule: leave out --by site")
        dtype = dtypes.get(args.dtype)
        model, inputs = _resolve_target(
            args.model, device=args.device, dtype=torch.float32 if args.training else dtype, tiny=args.tiny,
            inputs=None, **setting,
        )  # fmt: skip
        channels_last_call(model, inputs)
        model.train(args.training)
        call = model if inputs.method == "forward" else getattr(model, inputs.method)
        run = _training_step(model, call, inputs.kwargs, dtype) if args.training else _inference_call(call, inputs)
        report = ldmopt.tune(
            model, run, families=args.families, warmup=args.warmup, repeats=args.repeats, rounds=args.rounds,
            min_speedup=args.min_speedup, cuda_graph=args.cuda_graph, by=None if args.training else args.by,
            training=args.training,
        )  # fmt: skip
    except (KeyError, ValueError) as exc:
        message = _message(exc)
        print(message if message.startswith("ldmopt.tune:") else f"ldmopt tune: {message}", file=sys.stderr)
        return 2
    if args.json != "-":
        print(report if args.report else report.tuning)
    if args.json:
        # The setting that ran (the zoo's defaults filled in), not the flags as given
        ran = {"resolution": list(inputs.resolution), "frames": inputs.frames, "batch": inputs.batch}
        _write_json({"model": args.model, **ran, **dataclasses.asdict(report.tuning)}, args.json)
    if args.save_choice:
        report.tuning.save(args.save_choice)
    ldmopt.unpatch(model)
    return 0


def _inference_call(call, inputs):
    import torch

    def run():
        with torch.no_grad():
            return call(**inputs.kwargs)

    return run


def _training_step(model, call, kwargs, dtype):
    """Forward under autocast (``dtype``; None: bf16 on a GPU, fp32 on the CPU), MSE against a fixed random target,
    backward."""
    import torch

    device = next(model.parameters()).device
    if dtype is None and device.type == "cuda":
        dtype = torch.bfloat16  # how diffusion models train on GPUs
    autocast = dtype in (torch.float16, torch.bfloat16)
    target = []

    def step():
        with torch.autocast(device.type, dtype=dtype, enabled=autocast):
            out = call(**kwargs)
        out = out[0] if isinstance(out, tuple) else getattr(out, "sample", out)
        if not target:  # drawn once: every configuration trains toward the same target
            target.append(torch.randn_like(out, dtype=torch.float32))
        torch.nn.functional.mse_loss(out.float(), target[0]).backward()
        model.zero_grad(set_to_none=True)

    return step
