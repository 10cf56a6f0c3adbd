"""``ldmopt analyze`` and ``ldmopt profile``: argument setup and runners for the top-level CLI.

The lead's ``ldmopt/cli.py`` calls, per subcommand, ``configure_<name>(parser)`` and ``run_<name>(args) -> int``.
Only argparse is imported at module level; torch, diffusers and matplotlib load when a command runs.
"""

from __future__ import annotations

import argparse
import os

from .placements import PLACEMENTS
from .settings import ANALYZE_DTYPES


def _resolution(text: str):
    """argparse type: '512' -> 512, '576x1024' -> (576, 1024)."""
    try:
        sides = tuple(int(side) for side in text.lower().split("x")) if "x" in text.lower() else (int(text),)
        if len(sides) > 2:
            raise ValueError(text)
    except ValueError:
        hint = "; ldmopt analyze sweeps a comma list" if "," in text else ""
        raise argparse.ArgumentTypeError(f"expected pixels as 512 or HxW (576x1024), got {text!r}{hint}") from None
    if min(sides) < 1:  # the API would say "resolution must be positive", not naming --resolution
        raise argparse.ArgumentTypeError(f"pixels must be positive, got {text!r}")
    return sides if len(sides) == 2 else sides[0]


_resolution.__name__ = "resolution"


def _count(minimum: int):
    """argparse type: an integer >= ``minimum`` (0 or a negative batch must not fall back to the default)."""

    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from exc
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be {'positive' if minimum == 1 else f'>= {minimum}'}, got {value}")
        return value

    convert.__name__ = "positive integer" if minimum == 1 else f"integer >= {minimum}"
    return convert


_positive = _count(1)


def _gpu(text: str) -> str:
    """argparse type: a GPU of the datasheet table (the API's error points to register_gpu, out of a flag's reach)."""
    from .gpus import GPUS

    if text.lower() not in {name.lower() for name in GPUS}:
        raise argparse.ArgumentTypeError(f"unknown GPU {text!r}; expected one of {', '.join(GPUS)}")
    return text


def _list(parse):
    def convert(text: str):
        try:
            return [parse(part) for part in text.split(",") if part.strip()]
        except argparse.ArgumentTypeError as exc:
            if "," not in text:
                raise
            raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from exc
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}") from exc

    return convert


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--batch", type=_positive, default=None, help="batch (default: the zoo's, 2 = classifier-free guidance)"
    )
    parser.add_argument("--dtype", default=None, choices=ANALYZE_DTYPES,
                        help="fp16 (default for analyze/GPU), bf16 or fp32")  # fmt: skip
    parser.add_argument("--tiny", action="store_true", help="the tiny random-weight variant of the model family")
    parser.add_argument("--json", metavar="PATH", default=None, help="write the result as JSON ('-' for stdout)")
    parser.add_argument("--plot", metavar="PNG", default=None, help="write a figure (needs matplotlib)")


def _zoo_names() -> list[str]:
    from .. import configs

    return configs.names()


def configure_analyze(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Analytic cost model on meta tensors (no GPU, no weights): FLOPs, minimum HBM bytes and a roofline time "
        "projection per operator category, as is and as ldmopt patches it. Comma lists sweep the setting."
    )
    parser.add_argument("model", help=f"zoo name: {', '.join(_zoo_names())}")
    parser.add_argument("--resolution", type=_list(_resolution), default=None,
                        help="pixels: 512, 576x1024, or a comma list 256,512,768,1024")  # fmt: skip
    parser.add_argument("--frames", type=_list(_positive), default=None,
                        help="frames (video models only), or a comma list 8,16,32,64")  # fmt: skip
    parser.add_argument("--gpu", type=_gpu, default="H100", help="A100, H100 or H200 (datasheet peaks; default H100)")
    parser.add_argument("--check-flops", action="store_true", help="cross-check against torch.utils.flop_counter")
    parser.add_argument(
        "--training", action="store_true", help="a training step: forward, MSE loss, backward and AdamW, by phase"
    )
    parser.add_argument(
        "--patched", action="store_true", help="count the model as ldmopt.patch leaves it (its fused ops recorded)"
    )
    parser.add_argument("--placement", default=None, choices=PLACEMENTS,
                        help="what the patched projection models: auto (default) = the fused conv's and GEMMs' "
                             "placements on a GPU ('cudnn', 'cublas'; LDMOPT_GN_CONV_PROLOGUE / LDMOPT_GEMM_PLACEMENT "
                             "honoured), triton = ldmopt's Triton kernels (the CPU's; the only one --patched "
                             "models, and its default)")  # fmt: skip
    _common(parser)


def configure_profile(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Measured breakdown under torch.profiler (CUDA kernel time on a GPU, CPU operator time otherwise) of a zoo "
        "model with random weights."
    )
    parser.add_argument("model", help="zoo name (see `ldmopt analyze --help`)")
    parser.add_argument("--resolution", type=_resolution, default=None, help="pixels: 512 or 576x1024")
    parser.add_argument("--frames", type=_positive, default=None, help="frames (video models only)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--steps", type=_positive, default=3, help="active (recorded) steps")
    parser.add_argument("--warmup", type=_count(0), default=1, help="unrecorded steps before the active ones")
    parser.add_argument("--wait", type=_count(0), default=None, help="skipped steps before warmup (training default 1)")
    parser.add_argument("--training", action="store_true", help="forward + backward + AdamW step per step")
    parser.add_argument("--patched", action="store_true",
                        help="ldmopt.patch the model first (channels-last weights and inputs, as the demo runs it) "
                             "and print the patch report: the split then shows ldmopt's kernels")  # fmt: skip
    parser.add_argument("--trace", metavar="JSON", default=None, help="write a Chrome trace")
    parser.add_argument("--tensorboard", metavar="DIR", default=None, help="log to TensorBoard")
    parser.add_argument("--wandb", metavar="PROJECT", default=None, help="log to Weights & Biases")
    parser.add_argument("--top", type=_count(0), default=3, help="top kernels/operators per category")
    _common(parser)


def _typed(value) -> str:
    """A setting as given on the command line: 512, 576x1024, or a comma list of those."""
    if isinstance(value, list):
        return ",".join(map(_typed, value))
    return f"{value[0]}x{value[1]}" if isinstance(value, tuple) else str(value)


def setting_problem(args: argparse.Namespace) -> str | None:
    """Why ``--frames`` or ``--resolution`` does not fit the zoo model, or None. The API refuses these too, but in its
    own argument names (frames=8, resolution=512), which are not what the user typed."""
    from .. import configs

    try:
        entry = configs.get(args.model)
    except KeyError:
        return None  # the API's message lists the zoo
    if args.frames and not entry.is_video:
        return (
            f"--frames {_typed(args.frames)}: {entry.name} ({entry.description}) is an image model: it has no frames; "
            "drop --frames"
        )
    for res in args.resolution if isinstance(args.resolution, list) else [args.resolution]:
        if entry.cls in configs.SQUARE_ONLY and isinstance(res, tuple) and res[0] != res[1]:
            return (
                f"--resolution {_typed(res)}: {entry.name} ({entry.cls}) takes square images only; give one side "
                f"(--resolution {res[0]}) or equal sides"
            )
    return None


def _analyze_flags_problem(args: argparse.Namespace) -> str | None:
    """Flag combinations analyze() refuses, said in flags (its messages name placement= and check_flops=)."""
    if args.patched and args.placement not in (None, "triton"):
        return (
            f"--placement {args.placement} with --patched: the patched recording counts each ldmopt op as the one "
            "kernel the Triton placement runs (--placement triton, the default with --patched); the GPUs' default "
            "placements are projected from the stock model: drop --patched"
        )
    if args.patched and args.check_flops:
        return (
            "--check-flops with --patched: torch's FlopCounterMode has no formulas for ldmopt's fused ops, and its "
            "module hooks would send every fused block to its stock forward; check the stock model: drop --patched"
        )
    return setting_problem(args)


def _message(exc: Exception) -> str:
    """The text of an error (a KeyError's str() would quote it)."""
    return str(exc.args[0]) if len(exc.args) == 1 else str(exc)


def prepare_outputs(command: str, *, plot: str | None = None, **files: str | None) -> bool:
    """Before the work: check that ``plot`` can be written and that no output file is an existing folder, and create
    the parent folders of the output files; False (after a message) if that fails. ``files`` are option name -> path
    (``json=args.json``, ``save_choice=...``), named in the messages as their flags."""
    import sys

    if plot:
        from .plots import plot_output_problem

        problem = plot_output_problem(plot)
        if problem:
            print(f"ldmopt {command}: {problem}", file=sys.stderr)
            return False
    for option, path in files.items():
        if path and path != "-" and os.path.isdir(path):  # open() would fail only after the whole run
            flag, example = "--" + option.replace("_", "-"), os.path.join(path, f"{command}.json")
            print(f"ldmopt {command}: {flag} {path} is a folder; give a file name such as {example}", file=sys.stderr)
            return False
    for path in (*files.values(), plot):
        if not path or path == "-":
            continue
        parent = os.path.dirname(os.path.abspath(path))
        try:
            os.makedirs(parent, exist_ok=True)
        except OSError as exc:
            print(f"ldmopt {command}: cannot create the folder of {path}: {exc}", file=sys.stderr)
            return False
    return True


def _json_safe(obj):
    """``obj`` with NaN and infinities as null: JSON has no such numbers (Python writes a bare NaN that strict
    parsers, jq and JavaScript reject), and they mean "not measured" here (a tuning with nothing to time)."""
    import math

    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def _write_json(obj, path: str) -> None:
    import json
    import sys

    text = json.dumps(_json_safe(obj), indent=2, default=str, allow_nan=False)
    if path == "-":
        sys.stdout.write(text + "\n")
    else:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            f.write(text + "\n")


def _sweep_table(analyses) -> str:
    from . import categories as C
    from .report import pct, render_table, si

    cats = [c for c in C.CATEGORIES if any(a.categories[c].time_s for a in analyses)]
    rows = []
    for a in analyses:
        shares = a.shares("time")
        setting = f"{a.resolution[0]}x{a.resolution[1]}" + (f" F{a.frames}" if a.frames else "")
        rows.append([setting, si(a.total_flops), f"{a.time_s * 1e3:.2f}", f"{a.patched_time_s * 1e3:.2f}",
                     *(pct(shares[c]) for c in cats), pct(a.attention_split()["temporal"])])  # fmt: skip
    headers = ["setting", "FLOPs", "proj ms", "patched ms", *(C.LABELS[c] for c in cats), "temporal/attn"]
    a0 = analyses[0]
    step = ", training step" if a0.training else ""
    title = (f"ldmopt analyze: {a0.model} scaling sweep, batch {a0.batch}, {a0.dtype}{step}; ANALYTIC: shares of "
             f"roofline-PROJECTED time on {a0.gpu.name} (not measured)")  # fmt: skip
    return title + "\n" + render_table(headers, rows) + "\n" + a0.placement_line


def run_analyze(args: argparse.Namespace) -> int:
    import sys

    from .cost import analyze

    dtype = args.dtype or "fp16"
    problem = _analyze_flags_problem(args)
    if problem:
        print(f"ldmopt analyze: {problem}", file=sys.stderr)
        return 2
    if not prepare_outputs("analyze", json=args.json, plot=args.plot):
        return 2
    analyses = []
    try:
        for res in args.resolution or [None]:
            for frames in args.frames or [None]:
                analyses.append(analyze(args.model, resolution=res, frames=frames, batch=args.batch, dtype=dtype,
                                        gpu=args.gpu, tiny=args.tiny, check_flops=args.check_flops,
                                        training=args.training, patched=args.patched,
                                        placement=args.placement))  # fmt: skip
    except (KeyError, ValueError) as exc:
        print(f"ldmopt analyze: {_message(exc)}", file=sys.stderr)
        return 2
    if args.json != "-":
        print(analyses[0].table() if len(analyses) == 1 else _sweep_table(analyses))
    if args.json:
        payload = analyses[0].to_dict() if len(analyses) == 1 else [a.to_dict() for a in analyses]
        _write_json(payload, args.json)
    if args.plot:
        from .plots import plot_analysis, plot_sweep

        (plot_analysis(analyses[0], args.plot) if len(analyses) == 1 else plot_sweep(analyses, args.plot))
        print(f"plot: {args.plot}", file=sys.stderr)
    return 0


def run_profile(args: argparse.Namespace) -> int:
    import importlib.util
    import sys

    import torch

    from .logging import LoggingUnavailableError
    from .measure import profile

    dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
    if args.dtype is not None and args.dtype not in dtypes:
        print(f"ldmopt profile: --dtype {args.dtype!r}: expected one of {', '.join(dtypes)}", file=sys.stderr)
        return 2
    problem = setting_problem(args)
    for flag, value, package in (("--tensorboard", args.tensorboard, "tensorboard"), ("--wandb", args.wandb, "wandb")):
        if not problem and value and importlib.util.find_spec(package) is None:  # profile() would say wandb=...
            problem = f"{flag} {value} needs the {package!r} package, which is not installed: pip install {package}"
    if problem:
        print(f"ldmopt profile: {problem}", file=sys.stderr)
        return 2
    if not prepare_outputs("profile", json=args.json, trace=args.trace, plot=args.plot):
        return 2
    try:
        target, inputs, report = args.model, None, None
        build = dict(dtype=dtypes.get(args.dtype), tiny=args.tiny, resolution=args.resolution, frames=args.frames,
                     batch=args.batch)  # fmt: skip
        if args.patched:  # built and given its inputs here: the setting is in them, not for profile to apply again
            target, inputs, report = _patched_zoo_model(args, dtypes.get(args.dtype))
            build = {}
        result = profile(
            target,
            inputs=inputs,
            steps=args.steps,
            warmup=args.warmup,
            wait=args.wait,
            training=args.training,
            trace=args.trace,
            tensorboard=args.tensorboard,
            wandb=args.wandb,
            device=args.device,
            **build,
        )
    except (KeyError, ValueError, OSError, LoggingUnavailableError) as exc:
        print(f"ldmopt profile: {_message(exc)}", file=sys.stderr)
        return 2
    if args.json != "-":
        if report is not None:
            print(report)
        print(result.table(top=args.top))
    if args.json:
        _write_json(result.to_dict(), args.json)
    if args.plot:
        from .plots import plot_profile

        plot_profile(result, args.plot)
        print(f"plot: {args.plot}", file=sys.stderr)
    return 0


def _patched_zoo_model(args: argparse.Namespace, dtype):
    """(model, inputs, report): the zoo model built as ``profile`` builds it, in channels-last (the fused
    GroupNorm->conv kernels' layout: NCHW input would take diffusers' forward), then patched."""
    import ldmopt

    from ..demo import channels_last_call
    from .measure import _resolve_target

    setting = dict(resolution=args.resolution, frames=args.frames, batch=args.batch)
    model, inputs = _resolve_target(args.model, device=args.device, dtype=dtype, tiny=args.tiny, inputs=None, **setting)
    channels_last_call(model, inputs)
    return model, inputs, ldmopt.patch(model, training=args.training)
