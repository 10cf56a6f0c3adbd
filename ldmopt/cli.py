"""The ``ldmopt`` command: thin argument parsing over the library's entry points.

Each subcommand lives in a module exposing ``configure_<name>(parser)`` and ``run_<name>(args) -> int``; those
modules keep their heavy imports inside ``run_<name>`` so ``ldmopt --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

COMMANDS = {
    "demo": ("ldmopt.demo", "run a small pipeline (or a zoo denoiser) unpatched and patched, compare and time them"),
    "info": ("ldmopt.info", "versions, available backends and why not, GPU and compute capability"),
    "analyze": ("ldmopt.profiler.cli", "analytic FLOPs/bytes per operator category of a model, on meta tensors"),
    "profile": ("ldmopt.profiler.cli", "measure the per-category time split of a model with torch.profiler"),
    "tune": ("ldmopt.patch.cli", "time each fused module against the stock one on a zoo model; keep the faster"),
}


#: Output-file options per command, with the file suffixes they can write (None: any, "-" for stdout). Checked and
#: their parent folder created before the command runs, so a bad path cannot fail the write after all the work is
#: done (analyze, profile and tune prepare their own).
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff")
OUTPUT_FILES = {"demo": {"save": IMAGE_SUFFIXES}}


def _check_device(device: str) -> str | None:
    """Why ``device`` cannot be used here, or None. Imports torch only when a device is named."""
    import torch

    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError):
        return f"--device {device!r} is not a torch device (cpu, cuda, cuda:1, ...)"
    if kind not in ("cpu", "cuda"):
        # meta tensors run no kernels (what they would cost: ldmopt analyze); other device types are not supported.
        return f"--device {device!r}: the command runs the model, on cpu or cuda only (figures on meta: ldmopt analyze)"
    if kind == "cuda" and not torch.cuda.is_available():
        return f"--device {device!r}: no CUDA GPU is available here (torch.cuda.is_available() is False); use cpu"
    return None


def _check_common(args: argparse.Namespace) -> str | None:
    """Checks shared by the subcommands, run before any work: the device exists, output folders can be made."""
    device = getattr(args, "device", None)
    if isinstance(device, str) and device != "auto":
        problem = _check_device(device)
        if problem:
            return problem
    if args.command == "demo" and getattr(args, "save", None) and args.model not in ("sd", "sd15"):
        return f"--save {args.save}: only the sd pipeline produces images; --model {args.model} runs a denoiser alone"
    for option, suffixes in OUTPUT_FILES.get(args.command, {}).items():
        path = getattr(args, option, None)
        if isinstance(path, str) and suffixes is not None and not path.lower().endswith(suffixes):
            return f"--{option} {path}: the file name must end in one of {', '.join(suffixes)} (an image is written)"
        if isinstance(path, str) and os.path.isdir(path):
            return f"--{option} {path} is a folder; give a file name such as {os.path.join(path, 'demo.png')}"
        if isinstance(path, str) and path != "-":
            try:
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            except OSError as exc:
                return f"--{option} {path}: cannot create its folder: {exc}"
    return None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ldmopt", description="Fused kernels for latent diffusion models.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            if exc.name is None or not module_name.startswith(exc.name):
                raise
            continue  # the feature's module is not part of this build
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        getattr(module, f"configure_{name}")(sub_parser)
        sub_parser.set_defaults(_run=getattr(module, f"run_{name}"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    problem = _check_common(args)
    if problem:
        print(f"ldmopt {args.command}: {problem}", file=sys.stderr)
        return 2
    return exit_quietly_on_broken_pipe(lambda: int(args._run(args) or 0))


def exit_quietly_on_broken_pipe(run) -> int:
    """``run()``'s exit code, or 141 (a shell's code for a writer killed by SIGPIPE) without a traceback when the
    reader of stdout left early (``ldmopt info --kernels | head``); stdout goes to /dev/null so the flush at exit
    cannot raise again."""
    try:
        return run()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
