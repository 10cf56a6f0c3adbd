"""Module scopes: forward hooks that tell the profiler and the cost model which module is running.

``ModuleScopes(modules, annotate=True)`` installs a forward pre-hook and a forward hook on every submodule. It keeps a
stack of the running modules (for the cost model) and, with ``annotate=True``, opens a ``record_function`` range per
attention module (``ldmopt.attention.<kind>::<path>``), per normalisation module (``ldmopt.norm::<path>``) and per
direct child of an attention module (``ldmopt.module::<path>``: its projections, whose ops are not attention) so
torch.profiler events can be attributed. Hooks are removed on exit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..nn.child_check import observer
from .categories import TEMPORAL_MARKERS, attention_kind_of, is_attention_module, is_norm_module

ATTENTION_SCOPE = "ldmopt.attention."
NORM_SCOPE = "ldmopt.norm::"
#: A module run directly by an attention module (to_q, to_out ...): its ops are not the attention's own.
MODULE_SCOPE = "ldmopt.module::"


@dataclass
class Frame:
    path: str
    module: nn.Module
    role: str  # "attention", "norm" or "module"
    attention_kind: str | None = None
    attention_calls: int = 0  # attention computations recorded in this call (cost model)
    annotation: object = None
    call: int = 0  # which module call this is (a module called twice opens two frames)


class ModuleScopes:
    """Context manager installing scope hooks on ``modules`` (a module, or a dict name -> module)."""

    def __init__(self, modules: nn.Module | dict[str, nn.Module], *, annotate: bool = False) -> None:
        if isinstance(modules, nn.Module):
            modules = {"": modules}
        self.roots = modules
        self.annotate = annotate
        self.stack: list[Frame] = []
        self._handles: list = []
        self._calls = 0

    # ------------------------------------------------------------------ queries used by the cost model
    def temporal(self) -> bool:
        """Whether the innermost running module sits under a temporal block (paths are full, so one look)."""
        return bool(self.stack) and is_temporal_path(self.stack[-1].path)

    def path(self) -> str:
        return self.stack[-1].path if self.stack else ""

    # ------------------------------------------------------------------ hooks
    def __enter__(self) -> ModuleScopes:
        seen: set[int] = set()
        for prefix, root in self.roots.items():
            for name, module in root.named_modules():
                if id(module) in seen:
                    continue
                seen.add(id(module))
                path = ".".join(p for p in (prefix, name) if p)
                role = "attention" if is_attention_module(module) else "norm" if is_norm_module(module) else "module"
                # Observers (child_check.observer): a patched block's fused path may bypass the hooked children.
                pre, post = observer(self._pre_hook(path, role)), observer(self._post_hook())
                self._handles.append(module.register_forward_pre_hook(pre, with_kwargs=True, prepend=True))
                self._handles.append(module.register_forward_hook(post, always_call=True))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        while self.stack:
            self._close(self.stack.pop())

    def _pre_hook(self, path: str, role: str):
        def hook(module, args, kwargs):
            self._calls += 1
            frame = Frame(path, module, role, call=self._calls)
            if role == "attention":
                frame.attention_kind = attention_kind_of(path, module, args, kwargs)
                if self.annotate:
                    frame.annotation = _open(f"{ATTENTION_SCOPE}{frame.attention_kind}::{path}")
            elif role == "norm" and self.annotate:
                frame.annotation = _open(f"{NORM_SCOPE}{path}")
            elif self.annotate and self.stack and self.stack[-1].role == "attention":
                frame.annotation = _open(f"{MODULE_SCOPE}{path}")
            self.stack.append(frame)

        return hook

    def _post_hook(self):
        def hook(module, args, output):
            # Pop up to and including this module's frame (a forward that raised may have left inner frames).
            while self.stack:
                frame = self.stack.pop()
                self._close(frame)
                if frame.module is module:
                    break

        return hook

    @staticmethod
    def _close(frame: Frame) -> None:
        if frame.annotation is not None:
            frame.annotation.__exit__(None, None, None)
            frame.annotation = None


def _open(name: str):
    ctx = torch.autograd.profiler.record_function(name)
    ctx.__enter__()
    return ctx


def is_temporal_path(path: str) -> bool:
    return any(part in TEMPORAL_MARKERS for part in path.split("."))


def attention_context(stack: list[Frame]) -> str | None:
    """Attention kind when the innermost module is an attention module (its projections are Linear children)."""
    if stack and stack[-1].role == "attention":
        return stack[-1].attention_kind
    return None


def in_norm(stack: list[Frame]) -> bool:
    return bool(stack) and stack[-1].role == "norm"
