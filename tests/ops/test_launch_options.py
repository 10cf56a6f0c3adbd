"""Every Triton launch passes the shared compile options (kernels/_common.py LAUNCH_OPTIONS): FMA contraction asked for
explicitly, since Triton 3.10 turns its default off; the ahead-of-time gate compiles with the same options."""

import ast
import pathlib

import pytest
import torch
from ldmopt.kernels import _common

import ldmopt.aot
from ldmopt import ops
from ldmopt._env import interpreter_enabled

KERNELS = pathlib.Path(_common.__file__).parent
#: forwards its caller's keyword arguments to the launch as they are
PASS_THROUGH = {"_tuned_launch.py"}


def _launches(path: pathlib.Path) -> list[ast.Call]:
    """The ``kernel[grid](...)`` calls of a module."""
    tree = ast.parse(path.read_text())
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Subscript)]


def test_fp_fusion_is_asked_for():
    assert _common.LAUNCH_OPTIONS == {"enable_fp_fusion": True}


def test_every_launch_passes_the_launch_options():
    checked, missing = 0, []
    for path in sorted(KERNELS.glob("*.py")):
        if path.name in PASS_THROUGH:
            continue
        for call in _launches(path):
            checked += 1
            names = [ast.unparse(k.value) for k in call.keywords if k.arg is None]
            if "LAUNCH_OPTIONS" not in names:
                missing.append(f"{path.name}:{call.lineno}")
    assert checked >= 20, checked  # the scan finds the launches at all
    assert not missing, f"launches without **LAUNCH_OPTIONS: {missing}"


def test_a_launch_reaches_the_kernel_with_the_options(monkeypatch):
    # Under the interpreter the launch keywords reach InterpretedFunction.run (which drops what it does not know);
    # on a GPU JITFunction.run reads them as compile options.
    from triton.runtime import interpreter

    if not interpreter_enabled():
        pytest.skip("needs TRITON_INTERPRET=1")
    seen = []
    run = interpreter.InterpretedFunction.run

    def recording(self, *args, **kwargs):
        seen.append(kwargs.get("enable_fp_fusion"))
        return run(self, *args, **kwargs)

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", recording)
    x = torch.randn(2, 12, 5, 3).to(memory_format=torch.channels_last)
    with ops.use_backend("triton"):
        ops.group_norm(x, 3, torch.randn(12), torch.randn(12), activation="silu")
    assert seen and all(seen), seen


def test_the_aot_gate_compiles_with_the_launch_options(monkeypatch):
    import triton

    captured = []

    def compile_stub(src, target, options):
        captured.append(options)
        raise RuntimeError("stop after the options")

    monkeypatch.setattr(triton, "compile", compile_stub)
    record = ldmopt.aot.compile_spec("ldmopt.kernels.group_norm", 0, 90)
    assert not record.ok and "stop after the options" in record.problem
    assert captured and captured[0]["enable_fp_fusion"] is True
