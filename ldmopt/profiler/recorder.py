"""Operator recorder for the analytic model: one record per ATen operator (and per attention call).

``Recorder`` is a ``TorchDispatchMode`` that logs, for every operator that is not a view, its category, FLOPs
(matmul, convolution and attention formulas: 2 FLOPs per multiply-add, as torch.utils.flop_counter counts), the
minimum HBM bytes (each tensor input read once, each output written once; broadcast dimensions read once), and
which earlier record produced each input (the data flow used by the fusion model). ``AttentionRegions`` is a
``TorchFunctionMode`` that turns each ``F.scaled_dot_product_attention`` call into ONE record, as a fused attention
kernel runs on a GPU (on meta tensors PyTorch would otherwise decompose it into the math path).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..nn.child_check import qualified_name
from . import categories as C
from .scopes import ModuleScopes, attention_context, in_norm, is_temporal_path

#: torch.Tag.inplace exists from torch 2.12 on; older releases (2.11 is on the GPU image) mark in-place ops only by
#: the trailing underscore, which the check below also accepts.
_INPLACE_TAG = getattr(torch.Tag, "inplace", None)
_FREE_OPS = {"_unsafe_view", "lift_fresh", "detach", "alias", "_reshape_alias", "set_", "resize_", "_has_compatible"}
#: Allocations without a fill: they move no bytes and read nothing of their argument (empty_like(x) takes x's shape).
_ALLOCATIONS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted"}


@dataclass
class AttentionCall:
    kind: str  # "spatial", "cross", "temporal" or "unattributed"
    path: str
    batch_heads: int  # batch x heads (temporal: batch x pixels x heads)
    heads: int
    q_len: int
    kv_len: int
    head_dim: int
    flops: int


@dataclass
class OpRecord:
    index: int
    name: str  # "aten::convolution", "attention" for an SDPA call
    category: str
    flops: int
    in_bytes: tuple[int, ...]
    out_bytes: int
    producers: tuple[int, ...]  # record index per tensor input, -1 for parameters and graph inputs
    path: str
    temporal: bool
    dtype: str
    layer: str | None = None  # kind of the enclosing attention module (projections included), if any
    consumers: list[int] = field(default_factory=list)
    owner: str = ""  # "module.Class" of the innermost module whose forward ran the op
    call: int = 0  # which call of that module (ModuleScopes' frame counter)
    processor: str = ""  # "module.Class" of that module's attention processor, if it has one

    @property
    def bytes(self) -> int:
        return sum(self.in_bytes) + self.out_bytes

    @property
    def base(self) -> str:
        return C.op_base_name(self.name)[1]


def _processor_name(module: torch.nn.Module) -> str:
    processor = getattr(module, "processor", None)
    return qualified_name(type(processor)) if processor is not None else ""


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes an operator must move for ``t``: broadcast (stride-0) dimensions are read once."""
    numel = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            numel *= size
    return numel * t.element_size()


def _channels_last(x: torch.Tensor) -> bool:
    """aten's suggest_memory_format() is channels-last (2d or 3d): such strides, and not plainly contiguous."""
    formats = {4: torch.channels_last, 5: torch.channels_last_3d}
    fmt = formats.get(x.dim())
    return fmt is not None and x.is_contiguous(memory_format=fmt) and not x.is_contiguous()


def _tensors(tree) -> list[torch.Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


def _mm_flops(base: str, args: tuple, out: torch.Tensor) -> int:
    if base in ("mm", "addmm", "_addmm_activation"):
        a = args[1] if base != "mm" else args[0]
        return 2 * a.shape[0] * a.shape[1] * out.shape[-1]
    if base in ("bmm", "baddbmm"):
        a = args[1] if base == "baddbmm" else args[0]
        return 2 * a.shape[0] * a.shape[1] * a.shape[2] * out.shape[-1]
    return 0


def _conv_flops(args: tuple, out: torch.Tensor) -> int:
    x, w = args[0], args[1]
    transposed = bool(args[6]) if len(args) > 6 else False
    spatial = x.shape[2:] if transposed else out.shape[2:]
    return 2 * x.shape[0] * math.prod(spatial) * math.prod(w.shape)


def _sdpa_flops(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int, int, int]:
    """(flops, batch*heads, q_len, kv_len, head_dim) of one attention: QK^T and PV, 2 FLOPs per multiply-add."""
    batch_heads = math.prod(q.shape[:-2])
    lq, d = q.shape[-2], q.shape[-1]
    lk, dv = k.shape[-2], v.shape[-1]
    return 2 * batch_heads * lq * lk * (d + dv), batch_heads, lq, lk, d


class Recorder(TorchDispatchMode):
    """Dispatch mode that records operators (see the module docstring). Use inside ``ModuleScopes``."""

    def __init__(self, scopes: ModuleScopes) -> None:
        super().__init__()
        self.scopes = scopes
        self.records: list[OpRecord] = []
        self.attention: list[AttentionCall] = []
        self.suppress = 0
        self._producer: dict[int, int] = {}
        self._alive: list[torch.Tensor] = []  # keeps ids unique while the pass runs (meta tensors cost nothing)

    # ------------------------------------------------------------------ data flow
    def producer_of(self, t: torch.Tensor) -> int:
        return self._producer.get(id(t), -1)

    def _produce(self, outputs: list[torch.Tensor], index: int) -> None:
        for t in outputs:
            self._producer[id(t)] = index
            self._alive.append(t)

    def add(self, name, category, flops, inputs, outputs, *, out_bytes=None) -> OpRecord:
        stack = self.scopes.stack
        path = stack[-1].path if stack else ""
        rec = OpRecord(
            index=len(self.records),
            name=name,
            category=category,
            flops=int(flops),
            in_bytes=tuple(tensor_bytes(t) for t in inputs),
            out_bytes=sum(t.numel() * t.element_size() for t in outputs) if out_bytes is None else out_bytes,
            producers=tuple(self.producer_of(t) for t in inputs),
            path=path,
            temporal=is_temporal_path(path),
            layer=next((f.attention_kind for f in reversed(stack) if f.role == "attention"), None),
            dtype=str(outputs[0].dtype if outputs else inputs[0].dtype if inputs else "").replace("torch.", ""),
            owner=qualified_name(type(stack[-1].module)) if stack else "",
            call=stack[-1].call if stack else 0,
            processor=_processor_name(stack[-1].module) if stack else "",
        )
        for p in rec.producers:
            if p >= 0:
                self.records[p].consumers.append(rec.index)
        self.records.append(rec)
        self._produce(outputs, rec.index)
        return rec

    def add_attention(self, q, k, v, mask, out, kind: str | None) -> None:
        flops, batch_heads, lq, lk, d = _sdpa_flops(q, k, v)
        category = C.ATTENTION_KINDS.get(kind, C.ATTN_UNATTRIBUTED)
        inputs = [t for t in (q, k, v, mask) if isinstance(t, torch.Tensor)]
        rec = self.add("attention", category, flops, inputs, [out])
        heads = q.shape[-3] if q.dim() >= 4 else 1
        self.attention.append(AttentionCall(kind or "unattributed", rec.path, batch_heads, heads, lq, lk, d, flops))

    # ------------------------------------------------------------------ dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.suppress:
            return out
        namespace = func.namespace
        base = func._schema.name.split("::")[-1]
        inputs = _tensors((args, kwargs))
        outputs = _tensors(out)
        if func.is_view or base in _FREE_OPS:
            # A view moves no data: its outputs come from whatever produced its input.
            if inputs:
                src = self.producer_of(inputs[0])
                if src >= 0:
                    self._produce(outputs, src)
            return out
        if base.endswith("_") or (_INPLACE_TAG is not None and _INPLACE_TAG in func.tags):
            if base == "copy_":
                inputs = inputs[1:2]  # dst is overwritten, not read
            outputs = outputs[:1] or inputs[:1]
        stack = self.scopes.stack
        kind = attention_context(stack)
        name = f"{namespace}::{base}"
        if base.startswith("_scaled_dot_product") and "backward" not in base and len(args) >= 3:
            self.add_attention(args[0], args[1], args[2], None, outputs[0], kind)
            return out
        category = C.classify_op(name, attention_kind=kind, in_norm=in_norm(stack))
        if base in _ALLOCATIONS:
            self.add(name, category, 0, [], outputs, out_bytes=0)
            return out
        flops = 0
        if base in ("mm", "addmm", "_addmm_activation", "bmm", "baddbmm"):
            flops = _mm_flops(base, args, outputs[0])
            if kind is not None and base in ("bmm", "baddbmm") and stack[-1].attention_calls == 0:
                self._attention_from_bmm(args, base, outputs[0], kind, flops)
        elif base == "convolution":
            flops = _conv_flops(args, outputs[0])
        if base in ("baddbmm", "addmm", "addbmm") and kwargs.get("beta", 1) == 0 and inputs and inputs[0] is args[0]:
            inputs = inputs[1:]  # beta=0: the added tensor is never read (diffusers' baddbmm on an empty score tensor)
        self.add(name, category, flops, inputs, outputs)
        return out

    def _attention_from_bmm(self, args, base, scores, kind, flops) -> None:
        """Processors without SDPA (baddbmm + softmax + bmm): log the call at its QK^T matmul."""
        frame = self.scopes.stack[-1]
        frame.attention_calls += 1
        a = args[1] if base == "baddbmm" else args[0]
        batch_heads, lq, d = a.shape
        lk = scores.shape[-1]
        heads = getattr(frame.module, "heads", 1)
        self.attention.append(AttentionCall(kind, frame.path, batch_heads, heads, lq, lk, d, 2 * flops))


class AttentionRegions(TorchFunctionMode):
    """Records each ``F.scaled_dot_product_attention`` call as one fused operator of the ``Recorder``, and each
    ``F.rms_norm`` (torch.nn.RMSNorm: Flux's and Wan's query/key norms) as the one ``_fused_rms_norm`` kernel torch
    runs on a GPU when the weight has the input's dtype (on meta and CPU it decomposes into eight ops)."""

    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.rms_norm:
            return self._rms_norm(func, args, kwargs)
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        rec = self.recorder
        names = ("query", "key", "value", "attn_mask")
        q, k, v, mask = (args[i] if i < len(args) else kwargs.get(n) for i, n in enumerate(names))
        rec.suppress += 1
        try:
            out = func(*args, **kwargs)
            if out.dim() == 4 and out.device.type == "meta":
                # Fused GPU kernels write (batch, tokens, heads, dim) and return a transposed view, so the
                # processor's transpose(1, 2).reshape(...) afterwards is free; on meta the math path would copy.
                b, h, n, e = out.shape
                out = out.new_empty(b, n, h, e).transpose(1, 2)
        finally:
            rec.suppress -= 1
        stack = rec.scopes.stack
        kind = attention_context(stack)
        if kind is not None:
            stack[-1].attention_calls += 1
        rec.add_attention(q, k, v, mask, out, kind)
        return out

    def _rms_norm(self, func, args, kwargs):
        names = ("input", "normalized_shape", "weight", "eps")
        x, _shape, weight, _eps = (args[i] if i < len(args) else kwargs.get(n) for i, n in enumerate(names))
        # torch's own conditions for the fused kernel (rms_norm_symint): same dtypes, and not a tensor whose
        # suggested memory format is channels-last (2d or 3d); otherwise the composite runs.
        fused = (weight is None or weight.dtype == x.dtype) and not _channels_last(x)
        if not fused:
            return func(*args, **kwargs)
        rec = self.recorder
        rec.suppress += 1
        try:
            out = func(*args, **kwargs)
        finally:
            rec.suppress -= 1
        name = "aten::_fused_rms_norm"
        stack = rec.scopes.stack
        category = C.classify_op(name, attention_kind=attention_context(stack), in_norm=in_norm(stack))
        rec.add(name, category, 0, [t for t in (x, weight) if isinstance(t, torch.Tensor)], [out])
        return out
