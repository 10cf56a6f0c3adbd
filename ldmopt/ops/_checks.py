"""Argument checks shared by the ops: each error names the argument, the value received and what is supported."""

from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def check_tensor(
    name: str,
    t: object,
    *,
    ndim: Sequence[int] | None = None,
    dtypes: Sequence[torch.dtype] = FLOAT_DTYPES,
    allow_empty: bool = False,
) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() not in ndim:
        raise ValueError(f"{name} must have {' or '.join(map(str, ndim))} dims, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} has dtype {t.dtype}; supported: {', '.join(str(d) for d in dtypes)}")
    if not allow_empty and t.numel() == 0:
        raise ValueError(f"{name} is empty (shape {tuple(t.shape)}); ldmopt ops need at least one element")
    return t


def check_vector(name: str, t: torch.Tensor | None, length: int, like: torch.Tensor) -> None:
    """An optional per-channel parameter: 1-D of ``length`` floats on ``like``'s device."""
    if t is None:
        return
    check_tensor(name, t, ndim=(1,))
    if t.shape[0] != length:
        raise ValueError(f"{name} must have shape ({length},), got {tuple(t.shape)}")
    if t.device != like.device:
        raise ValueError(f"{name} is on {t.device} but the input is on {like.device}")


def check_eps(eps: object) -> float:
    """A normalisation's epsilon: a finite non-negative real number (not a bool), returned as a float.

    While compiling it is returned unchecked: ``torch.compile(dynamic=True)`` passes a module's float attribute as a
    symbolic float, on which ``math.isfinite`` cannot be traced. Eager calls check it."""
    if type(eps) is float and 0.0 <= eps < math.inf:  # the common case first (NaN fails the comparison)
        return eps
    if torch.compiler.is_compiling():
        return eps  # type: ignore[return-value]
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be a finite non-negative float, got {eps!r}")
    return float(eps)


#: What the kernels write: fp8 and other floating types would need scaling the epilogues do not do.
OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_out_dtype(out_dtype: object) -> None:
    """An optional output dtype: None or one of :data:`OUT_DTYPES`."""
    if out_dtype is not None and out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be None or one of {[str(d) for d in OUT_DTYPES]}, got {out_dtype!r}")


def dense(t: torch.Tensor, dtype: torch.dtype, *, copy: bool = False) -> torch.Tensor:
    """``t`` in ``dtype``, dense row-major: the layout every kernel writes and the ops' fakes declare (a reference
    computed from a transposed input keeps its strides otherwise). ``copy``: never ``t`` itself (an op's output must
    not alias its input)."""
    if not copy and t.dtype == dtype and t.is_contiguous():
        return t
    return t.to(dtype, memory_format=torch.contiguous_format, copy=True)


def check_activation(name: str, value: str | None, supported: Sequence[str | None]) -> str | None:
    if value not in supported:
        raise ValueError(f"{name}={value!r} is not supported; expected one of {list(supported)}")
    return value


def memory_format_of(t: torch.Tensor) -> torch.memory_format:
    """The memory format a dense tensor is laid out in (channels-last wins over contiguous only when strictly so)."""
    if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous():
        return torch.channels_last
    if t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d) and not t.is_contiguous():
        return torch.channels_last_3d
    return torch.contiguous_format


def spatial_dims_flatten(t: torch.Tensor) -> bool:
    """Whether the dims after (N, C) can be addressed as one strided axis (size-1 dims carry any stride)."""
    dims = [i for i in range(2, t.dim()) if t.shape[i] > 1]
    return all(t.stride(outer) == t.stride(inner) * t.shape[inner] for outer, inner in itertools.pairwise(dims))


def check_same_device(name: str, t: torch.Tensor | None, like: torch.Tensor) -> None:
    if t is not None and t.device != like.device:
        raise ValueError(f"{name} is on {t.device} but the input is on {like.device}")


def rows_as(y: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """A kernel's [rows, N] output in the caller's ``shape`` as a tensor of its own, not a view of the 2-D result (as
    F.linear returns its 3-D output): FSDP2 warns on view outputs of the blocks it wraps, whose in-place updates
    would bypass its backward hooks. Under torch.jit.trace a view: the trace records _unsafe_view's sizes as constants,
    a view's as the input's symbolic sizes."""
    if torch._C._get_tracing_state() is not None:
        return y.view(shape)
    return torch.ops.aten._unsafe_view.default(y, shape)
