"""``ldmopt info``: versions, which backends can run here and why not, the GPU and its compute capability."""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import platform

from . import _env


def public_ops() -> dict[str, tuple[str, ...]]:
    """Each public op of ``ldmopt.ops`` and the backends it has, read from the BackendTables of its module (so this
    list cannot fall behind the ops)."""
    import sys

    from . import ops
    from .ops._dispatch import BackendTable

    found = {}
    for name in ops.__all__:
        module = sys.modules.get(getattr(getattr(ops, name), "__module__", ""))
        tables = [t for t in vars(module).values() if isinstance(t, BackendTable)] if module else []
        # The op's own table where it has one named after it (a module's other tables serve its helper ops: the
        # statistics of layer_norm_linear have a cuda backend, the fused GEMM does not), else the widest.
        tables = [t for t in tables if t.op_name == name] or tables
        if tables:
            found[name] = max((tuple(b.name for b in t.backends) for t in tables), key=len)
    return found


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def collect(query_gpu: bool = True) -> dict:
    import torch

    from . import __version__

    triton_ok, triton_why = _env.triton_status()
    ext_ok, ext_why = _env.cuda_extension_status()
    gpu_ok, gpu_why = _env.gpu_status() if query_gpu else (False, "not queried")
    capability = None
    if gpu_ok:
        capability = "sm_{}{}".format(*torch.cuda.get_device_capability())
    triton_runs = triton_ok and (gpu_ok or _env.interpreter_enabled())
    if not triton_ok:
        triton_line = triton_why
    elif gpu_ok:
        triton_line = f"available ({triton_why}, on {gpu_why})"
    elif _env.interpreter_enabled():
        triton_line = f"available in the CPU interpreter ({triton_why}, TRITON_INTERPRET=1)"
    else:
        triton_line = f"{triton_why} importable, but no GPU and TRITON_INTERPRET is not 1"
    return {
        "ldmopt": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": _version("triton"),
        "diffusers": _version("diffusers"),
        "gpu": gpu_why,
        "compute_capability": capability,
        "interpreter": _env.interpreter_enabled(),
        "backends": {
            "cuda": "available" if ext_ok and gpu_ok else (ext_why if not ext_ok else f"built, but {gpu_why}"),
            "triton": triton_line,
            "torch": "available (reference implementation)",
        },
        "backends_usable": {"cuda": ext_ok and gpu_ok, "triton": triton_runs, "torch": True},
        "build": _env.build_info(),
        "ops": {name: list(backends) for name, backends in public_ops().items()},
        "gn_conv_prologue": _prologue_setting(),
        "gemm_placement": _gemm_placement_setting(),
        "autotune_cache": _autotune_cache_setting(),
    }


def _placement_setting(module, auto: str) -> str:
    """What a placement switch's variable asks for (``module``: its ops module, with ENV and requested_placement):
    ``auto`` described, a forced value, or why the value is invalid."""
    try:
        requested = module.requested_placement()
    except ValueError as exc:
        return f"invalid: {exc}"
    return f"auto ({auto})" if requested == "auto" else f"{requested} (forced by {module.ENV})"


def _prologue_setting() -> str:
    """Where fused GroupNorm -> conv applies the norm, as LDMOPT_GN_CONV_PROLOGUE asks (ops.gn_conv2d_prologue)."""
    from .ops import gn_conv2d_prologue as prologue

    return _placement_setting(
        prologue,
        f"on a GPU: in the conv's loader where it would normalise each input element fewer than "
        f"{prologue.STAGE_FROM_RECOMPUTE} times, else cudnn: staged before cuDNN's conv with the epilogue as a "
        f"pass of its own (ldmopt._C's where built, else Triton's; a Linear read as a 1x1 conv follows the GEMM "
        f"placement); {prologue.ENV}=loader|staged|cudnn forces one",
    )


def _gemm_placement_setting() -> str:
    """Who runs the fused linear layers' GEMMs, as LDMOPT_GEMM_PLACEMENT asks (ops.linear_cublas)."""
    from .ops import linear_cublas

    return _placement_setting(
        linear_cublas,
        f"on a GPU: cublas, PyTorch's GEMM then the epilogue as one pass, ldmopt._C's where built, else Triton's (an "
        f"inference bias + GELU-tanh: in "
        f"cuBLASLt's epilogue, no pass, unless {linear_cublas.GELU_ENV}=pass); on CPU tensors the Triton GEMM with "
        f"the epilogue on its accumulator; {linear_cublas.ENV}=triton|cublas forces one",
    )


def _autotune_cache_setting() -> str:
    """Whether the Triton kernels keep their autotune timings on disk (kernels._common.autotune), and where."""
    triton_ok, triton_why = _env.triton_status()
    if not triton_ok:  # no Triton kernel runs, so no cache directory is used
        try:
            missing = importlib.util.find_spec("triton") is None
        except ValueError:  # a module in sys.modules without a spec
            missing = False
        return "off (Triton is not installed)" if missing else f"off ({triton_why})"
    if os.environ.get("LDMOPT_AUTOTUNE_CACHE", "1") == "0":
        return "off (LDMOPT_AUTOTUNE_CACHE=0: every process times the tiles again)"
    home = os.environ.get("TRITON_HOME") or os.path.expanduser("~")
    where = os.environ.get("TRITON_CACHE_DIR") or os.path.join(home, ".triton", "cache")
    return f"on, in Triton's cache directory {where} (LDMOPT_AUTOTUNE_CACHE=0 turns it off)"


def format_info(info: dict) -> str:
    lines = [
        f"ldmopt {info['ldmopt']}",
        f"  python {info['python']}, torch {info['torch']} (CUDA {info['torch_cuda']}), triton {info['triton']}, "
        f"diffusers {info['diffusers']}",
        f"  GPU: {info['gpu']}"
        + (f", compute capability {info['compute_capability']}" if info["compute_capability"] else ""),
        f"  Triton interpreter (TRITON_INTERPRET=1): {'on' if info['interpreter'] else 'off'}",
        "backends (preferred first):",
    ]
    for name, line in info["backends"].items():
        mark = "yes" if info["backends_usable"][name] else "no "
        lines.append(f"  [{mark}] {name:<6} {line}")
    build = info["build"]
    if build:
        lines.append(
            "CUDA extension build: "
            + (
                f"built for {build.get('arch_list')} with {build.get('nvcc') or 'nvcc'}"
                + (f" ({build['cuda_home']})" if build.get("cuda_home") else "")
                if build.get("built")
                else build.get("reason", "")
            )
        )
    lines.append("ops: " + ", ".join(f"{op} ({'/'.join(b)})" for op, b in info["ops"].items()))
    lines.append(f"GroupNorm -> conv prologue: {info['gn_conv_prologue']}")
    lines.append(f"fused linear GEMMs: {info['gemm_placement']}")
    lines.append(f"autotune timings cached: {info['autotune_cache']}")
    return "\n".join(lines)


def configure_info(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print as JSON")
    parser.add_argument(
        "--kernels",
        action="store_true",
        help="compile every Triton kernel ahead of time for sm_80/sm_90 and print registers, shared memory, spills",
    )


def run_info(args: argparse.Namespace) -> int:
    import importlib.util
    import json
    import os
    import subprocess
    import sys

    if args.kernels and args.json:
        print("ldmopt info: --kernels prints a table, not JSON; run it without --json", file=sys.stderr)
        return 2
    info = collect()
    print(json.dumps(info, indent=2) if args.json else format_info(info))
    if args.kernels:
        if importlib.util.find_spec("triton") is None:
            print("ldmopt info: --kernels compiles the Triton kernels and needs Triton (pip install triton)",
                  file=sys.stderr)  # fmt: skip
            return 2
        # The AOT compile needs un-interpreted kernels: run it in a child without TRITON_INTERPRET.
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        return subprocess.call([sys.executable, "-m", "ldmopt.aot"], env=env)
    return 0
