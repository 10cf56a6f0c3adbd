"""The reasons shared by every op's backends for refusing inputs: Triton missing or unable to run these tensors, and
ldmopt._C not loaded, missing an op, built from other sources or not on these tensors' GPU. Each op's own refusals
(shapes, layouts) live beside its kernel's launcher."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from .. import _env


def tensors_in(args: Sequence) -> list[torch.Tensor]:
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(t for t in a if isinstance(t, torch.Tensor))
    return out


#: Why a kernel with tl.dot refuses bf16 in the interpreter (wrong products: triton-lang/triton#11584).
INTERPRETER_BF16_DOT = (
    "bf16 matrix products under TRITON_INTERPRET=1: Triton's interpreter multiplies bf16 tl.dot operands as raw bits "
    "(wrong results); the reference backend runs them"
)


def triton_refusals(
    *args, dtypes: Sequence[torch.dtype] = (torch.float32, torch.float16, torch.bfloat16), matmul: bool = False
) -> list[str]:
    """Reasons common to every Triton backend: Triton missing, tensors where Triton cannot run, dtypes. ``matmul``:
    the kernel multiplies with tl.dot, which the interpreter gets wrong for bf16."""
    ok, why = _env.triton_status()
    if not ok:
        return [why]
    reasons = []
    tensors = tensors_in(args)
    on_gpu = True
    for t in tensors:  # is_cuda: called on every op call, and cheaper than .device
        if not t.is_cuda:
            on_gpu = False
            break
    if not on_gpu:
        devices = {t.device.type for t in tensors}
        if devices - {"cuda"} and not (devices <= {"cpu"} and _env.interpreter_enabled()):
            reasons.append(
                f"tensors on {sorted(devices)}: Triton runs CUDA tensors, or CPU tensors with TRITON_INTERPRET=1"
            )
        elif matmul and any(t.dtype == torch.bfloat16 for t in tensors):
            reasons.append(INTERPRETER_BF16_DOT)
    for t in tensors:
        if t.dtype not in dtypes and t.is_floating_point():
            reasons.append(f"dtype {t.dtype} is not supported (supported: {', '.join(map(str, dtypes))})")
            break
    return reasons


@functools.cache
def stale_schema(op_symbol: str) -> str | None:
    """Why ldmopt._C's op ``op_symbol`` cannot take the Python callers' arguments (None: it can): its schema differs
    from the one they call (ops/cuda_schemas.py), as in an extension built from older sources and not rebuilt. Read
    once per op (the library is loaded once)."""
    from .cuda_schemas import CUDA_SCHEMAS

    expected = CUDA_SCHEMAS.get(op_symbol)
    schema = getattr(getattr(getattr(torch.ops.ldmopt, op_symbol, None), "default", None), "_schema", None)
    if expected is None or schema is None:
        return None
    try:  # as parsed schemas, not as text: a torch version that prints them another way refuses nothing
        if torch._C.parse_schema(expected) == schema:
            return None
    except RuntimeError:  # a torch whose parser does not read the table's text
        if str(schema) == expected:
            return None
    return (
        f"ldmopt._C's {op_symbol} is {schema}, but ldmopt calls {expected}: the extension was built from older "
        "sources (rebuild it: pip install --no-build-isolation -e .)"
    )


def cuda_extension_refusals(op_symbol: str, *args) -> list[str]:
    """Reasons common to every ldmopt._C backend: extension not loaded, op missing or of another schema, tensors not
    on CUDA."""
    ok, why = _env.cuda_extension_status()
    if not ok:
        return [why]
    if not hasattr(torch.ops.ldmopt, op_symbol):
        return [f"ldmopt._C has no kernel {op_symbol!r} (extension built from older sources?)"]
    stale = stale_schema(op_symbol)
    if stale is not None:
        return [stale]
    tensors = tensors_in(args)
    if not all(t.is_cuda for t in tensors):
        return ["tensors are not on a CUDA device"]
    why_not = _env.cuda_extension_device_refusal(tensors[0].get_device()) if tensors else None
    return [why_not] if why_not else []
