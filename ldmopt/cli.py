"""The ``ldmopt`` command: thin argument parsing over the library's entry points.

Each subcommand lives in a module exposing ``configure_<name>(parser)`` and ``run_<name>(args) -> int``; those
modules keep their heavy imports inside ``run_<name>`` so ``ldmopt --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "demo": ("ldmopt.demo", "run a small Stable Diffusion pipeline unpatched and patched, compare and time them"),
    "info": ("ldmopt.info", "versions, available backends and why not, GPU and compute capability"),
    "analyze": ("ldmopt.profiler.cli", "analytic FLOPs/bytes per operator category of a model, on meta tensors"),
    "profile": ("ldmopt.profiler.cli", "measure the per-category time split of a model with torch.profiler"),
}


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
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
