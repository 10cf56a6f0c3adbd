"""Operator recorder for the analytic model: one record per ATen operator (and per attention call).

``Recorder`` is a ``TorchDispatchMode`` that logs, for every operator that is not a view, its category, FLOPs
(matmul, convolution and attention formulas: 2 FLOPs per multiply-add, as torch.utils.flop_counter counts), the
minimum HBM bytes (each tensor input read once, each output written once; broadcast dimensions read once), and
which earlier record produced each input (the data flow used by the fusion model). ``AttentionRegions`` is a
``TorchFunctionMode`` that turns each ``F.scaled_dot_product_attention`` call into ONE record, as a fused attention
kernel runs on a GPU (on meta tensors PyTorch would otherwise decompose it into the math path).

A training step records its backward pass too (``phase="backward"``): the autograd engine runs backward operators
outside every module's forward, so each is attributed to the module whose forward operator created its autograd
node (matched by the node's sequence number), and a fused attention's backward is one record, as FlashAttention's
backward kernel runs it.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

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
    phase: str = "forward"  # "forward" (loss included), "backward" or "optimizer"
    #: ldmopt's conv and GEMM ops: whose TF32 setting their fp32 products follow, PyTorch's "conv" or "matmul" (their
    #: kernels pick tl.dot's precision so); "" for the others, whose rate the cost model reads from the op name
    fp32_follows: str = ""
    #: a convolution's (kernel height, kernel width, output channels, stride), for the fused conv's placement (a
    #: Conv3d's first two kernel sides: ldmopt runs the temporal (3, 1, 1) ones as (3, 1) convs); a GEMM's as a 1x1
    #: conv's
    conv: tuple[int, ...] = ()
    approximate: str = ""  # gelu's form: "none" (erf) or "tanh"

    @property
    def bytes(self) -> int:
        return sum(self.in_bytes) + self.out_bytes

    @property
    def base(self) -> str:
        return C.op_base_name(self.name)[1]


def _processor_name(module: torch.nn.Module) -> str:
    processor = getattr(module, "processor", None)
    return qualified_name(type(processor)) if processor is not None else ""


@dataclass(frozen=True)
class Site:
    """Where an operator ran, as the cost model reads it: the innermost running module and its context."""

    path: str = ""
    layer: str | None = None  # kind of the enclosing attention module, if any
    owner: str = ""
    call: int = 0
    processor: str = ""
    attention_kind: str | None = None  # set when the op runs directly in an attention module
    in_norm: bool = False


_NO_SITE = Site()


def site_of(stack) -> Site:
    if not stack:
        return _NO_SITE
    top = stack[-1]
    return Site(
        path=top.path,
        layer=next((f.attention_kind for f in reversed(stack) if f.role == "attention"), None),
        owner=qualified_name(type(top.module)),
        call=top.call,
        processor=_processor_name(top.module),
        attention_kind=attention_context(stack),
        in_norm=in_norm(stack),
    )


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


def _conv_backward_flops(args: tuple) -> int:
    """convolution_backward(grad_out, input, weight, bias_sizes, stride, padding, dilation, transposed,
    output_padding, groups, output_mask): the input gradient and the weight gradient each cost the forward's
    FLOPs (the bias gradient is a reduction)."""
    grad_out, x, w, transposed, mask = args[0], args[1], args[2], bool(args[7]), args[10]
    spatial = x.shape[2:] if transposed else grad_out.shape[2:]
    forward = 2 * x.shape[0] * math.prod(spatial) * math.prod(w.shape)
    return forward * (int(bool(mask[0])) + int(bool(mask[1])))


_LDMOPT_GEMMS = frozenset({"linear_fwd", "linear_stats_fwd", "layer_norm_linear_fwd", "geglu_fwd"})


def _ldmopt_flops(func, base: str, args: tuple, kwargs: dict, out: torch.Tensor) -> int:
    """FLOPs of ldmopt's own ops that do matrix work (a model analysed as ldmopt.patch left it), by the formulas
    of the ATen ops they replace: the fused conv (and its 1x1 shortcut) on its output grid, the GEMMs on their rows,
    the temporal attention over frames (its backward recomputing the scores, as FlashAttention's)."""
    named = {a.name: v for a, v in zip(func._schema.arguments, args)} | kwargs
    if base == "gn_conv2d":
        pixels = out.shape[0] * math.prod(out.shape[2:])
        shortcut = named.get("shortcut_weight")
        flops = 2 * pixels * math.prod(named["weight"].shape)
        return flops + (2 * pixels * math.prod(shortcut.shape) if isinstance(shortcut, torch.Tensor) else 0)
    if base in _LDMOPT_GEMMS:
        x = named["x"]
        return 2 * (x.numel() // x.shape[-1]) * math.prod(named["weight"].shape)
    if base.startswith("temporal_attention"):
        q, v = named["q"], named["v"]  # (B, F, N, heads, head_dim)
        frames, d, dv = q.shape[1], q.shape[-1], v.shape[-1]
        sequences = q.numel() // (frames * d)
        per_pair = 3 * d + 2 * dv if base == "temporal_attention_bwd" else d + dv
        return 2 * sequences * frames * frames * per_pair
    return 0


def _ldmopt_fp32_follows(func, base: str, args: tuple, kwargs: dict) -> str:
    """Whose TF32 setting an ldmopt op's fp32 products follow (kernels/_common.torch_fp32_precision): the fused conv
    its ``fp32_precision`` argument ("matmul" for a Linear read as a 1x1 conv), the GEMMs nn.Linear's; "" for ops
    without matrix products."""
    if base == "gn_conv2d":
        named = {a.name: v for a, v in zip(func._schema.arguments, args)} | kwargs
        return named.get("fp32_precision", "conv")
    return "matmul" if base in _LDMOPT_GEMMS else ""


def _sdpa_flops(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int, int, int]:
    """(flops, batch*heads, q_len, kv_len, head_dim) of one attention: QK^T and PV, 2 FLOPs per multiply-add."""
    batch_heads = math.prod(q.shape[:-2])
    lq, d = q.shape[-2], q.shape[-1]
    lk, dv = k.shape[-2], v.shape[-1]
    return 2 * batch_heads * lq * lk * (d + dv), batch_heads, lq, lk, d


class Recorder(TorchDispatchMode):
    """Dispatch mode that records operators (see the module docstring). Use inside ``ModuleScopes``.

    ``track_sites=True`` (a training step) remembers the site of each forward operator by the sequence number of the
    autograd node it creates, for the backward operators that node runs. ``phase`` labels operators run outside
    autograd's backward (set it to "optimizer" around an optimizer step)."""

    def __init__(self, scopes: ModuleScopes, *, track_sites: bool = False) -> None:
        super().__init__()
        self.scopes = scopes
        self.records: list[OpRecord] = []
        self.attention: list[AttentionCall] = []
        self.suppress = 0
        self.phase = "forward"
        self.track_sites = track_sites
        self._sites: dict[int, Site] = {}  # autograd sequence number -> site of the forward op that made the node
        # Held weakly: a reference kept here would make autograd copy each parameter's gradient where it would
        # otherwise take the tensor (AccumulateGrad steals a gradient nobody else holds).
        self._producer: WeakIdKeyDictionary = WeakIdKeyDictionary()

    @contextlib.contextmanager
    def suppressed(self):
        """Operators run inside are not recorded (the insides of a fused region, data that is not work)."""
        self.suppress += 1
        try:
            yield
        finally:
            self.suppress -= 1

    @contextlib.contextmanager
    def in_phase(self, phase: str):
        """Operators run inside belong to ``phase`` ("backward": attributed through their autograd node)."""
        before, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = before

    # ------------------------------------------------------------------ data flow
    def producer_of(self, t: torch.Tensor) -> int:
        return self._producer.get(t, -1)

    def _produce(self, outputs: list[torch.Tensor], index: int) -> None:
        for t in outputs:
            self._producer[t] = index

    def current(self) -> tuple[str, Site]:
        """(phase, site) of the operator about to be recorded. In the backward phase, the site of the forward op
        whose autograd node runs it (a model's own ``autograd.grad`` inside its forward stays forward)."""
        if self.phase == "backward":
            node = torch._C._current_autograd_node()
            return "backward", _NO_SITE if node is None else self._sites.get(node._sequence_nr(), _NO_SITE)
        return self.phase, site_of(self.scopes.stack)

    def _note_site(self, base: str) -> None:
        """Remember the running module for the autograd node the current forward op just created (autograd
        numbers a node before it calls the op, or before a custom Function's forward, whose ops run without grad;
        the first op to see the number is the one that made it)."""
        if self.phase == "backward":
            return
        seq = torch._C._autograd._get_sequence_nr() - 1
        if seq not in self._sites:
            site = site_of(self.scopes.stack)
            if C.is_norm_op(base):
                # One native kernel does this norm's backward (classified by its name); any other op the engine
                # runs under its node is the accumulation of a gradient, elementwise work, not normalisation.
                site = replace(site, in_norm=False)
            self._sites[seq] = site

    def add(self, name, category, flops, inputs, outputs, *, out_bytes=None, at=None, fp32_follows="") -> OpRecord:
        """Record one operator; ``at`` = (phase, site), by default where the recorder is now."""
        phase, site = at if at is not None else self.current()
        rec = OpRecord(
            index=len(self.records),
            name=name,
            category=category,
            flops=int(flops),
            in_bytes=tuple(tensor_bytes(t) for t in inputs),
            out_bytes=sum(t.numel() * t.element_size() for t in outputs) if out_bytes is None else out_bytes,
            producers=tuple(self.producer_of(t) for t in inputs),
            path=site.path,
            temporal=is_temporal_path(site.path),
            layer=site.layer,
            dtype=str(outputs[0].dtype if outputs else inputs[0].dtype if inputs else "").replace("torch.", ""),
            owner=site.owner,
            call=site.call,
            processor=site.processor,
            phase=phase,
            fp32_follows=fp32_follows,
        )
        for p in rec.producers:
            # The fusion model reads the forward data flow: a backward op reading a saved tensor is not a consumer.
            if p >= 0 and self.records[p].phase == phase:
                self.records[p].consumers.append(rec.index)
        self.records.append(rec)
        self._produce(outputs, rec.index)
        return rec

    def add_attention(self, q, k, v, mask, out, kind: str | None, at=None) -> None:
        flops, batch_heads, lq, lk, d = _sdpa_flops(q, k, v)
        category = C.ATTENTION_KINDS.get(kind, C.ATTN_UNATTRIBUTED)
        inputs = [t for t in (q, k, v, mask) if isinstance(t, torch.Tensor)]
        rec = self.add("attention", category, flops, inputs, [out], at=at)
        heads = q.shape[-3] if q.dim() >= 4 else 1
        self.attention.append(AttentionCall(kind or "unattributed", rec.path, batch_heads, heads, lq, lk, d, flops))

    def add_attention_backward(self, q, k, v, mask, out, grad_out, grads, kind: str | None, at) -> None:
        """FlashAttention's backward: recompute the scores (QK^T), then dV = P^T dO, dP = dO V^T, dQ = dS K and
        dK = dS^T Q: 2.5x the forward's FLOPs at equal head dims; reads q, k, v, out and dO, writes dq, dk, dv."""
        batch_heads = math.prod(q.shape[:-2])
        lq, d, lk, dv = q.shape[-2], q.shape[-1], k.shape[-2], v.shape[-1]
        flops = 2 * batch_heads * lq * lk * (3 * d + 2 * dv)
        category = C.ATTENTION_KINDS.get(kind, C.ATTN_UNATTRIBUTED)
        inputs = [t for t in (q, k, v, mask, out, grad_out) if isinstance(t, torch.Tensor)]
        self.add("attention_backward", category, flops, inputs, [g for g in grads if g is not None], at=at)

    # ------------------------------------------------------------------ dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.track_sites:
            self._note_site(func._schema.name.split("::")[-1])
        if self.suppress:
            return out
        namespace = func.namespace
        base = func._schema.name.split("::")[-1]
        inputs = _tensors((args, kwargs))
        outputs = _tensors(out)
        if namespace == "profiler" or not any(t.is_meta for t in (*inputs, *outputs)):
            # Host work: record_function ranges, and an optimizer's step counters, which live on the CPU.
            return out
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
            # What it writes: its first argument, a whole list for a foreach op (which returns nothing).
            outputs = outputs[:1] or (_tensors(args[0]) if args else inputs[:1])
        at = self.current()
        phase, site = at
        kind = site.attention_kind
        name = f"{namespace}::{base}"
        if base.startswith("_scaled_dot_product") and "backward" not in base and len(args) >= 3:
            self.add_attention(args[0], args[1], args[2], None, outputs[0], kind, at=at)
            return out
        category = C.classify_op(name, attention_kind=kind, in_norm=site.in_norm)
        if base in _ALLOCATIONS:
            self.add(name, category, 0, [], outputs, out_bytes=0, at=at)
            return out
        flops, fp32_follows, conv = 0, "", ()
        if base in ("mm", "addmm", "_addmm_activation", "bmm", "baddbmm"):
            flops = _mm_flops(base, args, outputs[0])
            conv = (1, 1, outputs[0].shape[-1], 1)
            in_attention = kind is not None and base in ("bmm", "baddbmm") and phase != "backward"
            if in_attention and self.scopes.stack[-1].attention_calls == 0:
                self._attention_from_bmm(args, base, outputs[0], kind, flops)
        elif base == "convolution":
            flops = _conv_flops(args, outputs[0])
            w = args[1]
            conv = (*w.shape[2:4], w.shape[0], int(args[3][0]))
        elif base == "convolution_backward":
            flops = _conv_backward_flops(args)
        elif namespace == "ldmopt" and outputs:
            flops = _ldmopt_flops(func, base, args, kwargs, outputs[0])
            fp32_follows = _ldmopt_fp32_follows(func, base, args, kwargs)
        if base in ("baddbmm", "addmm", "addbmm") and kwargs.get("beta", 1) == 0 and inputs and inputs[0] is args[0]:
            inputs = inputs[1:]  # beta=0: the added tensor is never read (diffusers' baddbmm on an empty score tensor)
        rec = self.add(name, category, flops, inputs, outputs, at=at, fp32_follows=fp32_follows)
        rec.conv = conv
        if base in ("gelu", "gelu_"):
            rec.approximate = kwargs.get("approximate", args[1] if len(args) > 1 else "none")
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


class _FusedRegion(torch.autograd.Function):
    """One fused GPU kernel in a recorded training step: ``run()`` computes the output (the recorder suppressed),
    and the backward records the kernel's backward as one operator through ``record_backward(grad_out)``, which
    returns the inputs' gradients."""

    @staticmethod
    def forward(ctx, run, record_backward, *inputs):
        ctx.record_backward = record_backward
        return run()

    @staticmethod
    def backward(ctx, grad_out):
        record_backward, ctx.record_backward = ctx.record_backward, None  # once: let the closure go
        return None, None, *record_backward(grad_out, ctx.needs_input_grad[2:])


def _needs_grad(tensors) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


class AttentionRegions(TorchFunctionMode):
    """Records each ``F.scaled_dot_product_attention`` call as one fused operator of the ``Recorder``, and each
    ``F.rms_norm`` (torch.nn.RMSNorm: Flux's and Wan's query/key norms) as the one ``_fused_rms_norm`` kernel torch
    runs on a GPU when the weight has the input's dtype (on meta and CPU it decomposes into eight ops). Under
    autograd, each backward is one record as well."""

    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def _suppressed(self, func, args, kwargs):
        with self.recorder.suppressed():
            return func(*args, **kwargs)

    def _empty_grads(self, tensors, needed) -> list[torch.Tensor | None]:
        return [
            self._suppressed(torch.empty_like, (t,), {}) if isinstance(t, torch.Tensor) and need else None
            for t, need in zip(tensors, needed)
        ]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.rms_norm:
            return self._rms_norm(func, args, kwargs)
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        rec = self.recorder
        names = ("query", "key", "value", "attn_mask")
        q, k, v, mask = (args[i] if i < len(args) else kwargs.get(n) for i, n in enumerate(names))

        def run():
            out = self._suppressed(func, args, kwargs)
            if out.dim() == 4 and out.device.type == "meta":
                # Fused GPU kernels write (batch, tokens, heads, dim) and return a transposed view, so the
                # processor's transpose(1, 2).reshape(...) afterwards is free; on meta the math path would copy.
                b, h, n, e = out.shape
                out = self._suppressed(out.new_empty, ((b, n, h, e),), {}).transpose(1, 2)
            return out

        stack = rec.scopes.stack
        kind = attention_context(stack)
        if kind is not None:
            stack[-1].attention_calls += 1
        at = rec.current()
        inputs = (q, k, v, mask) if isinstance(mask, torch.Tensor) else (q, k, v)  # a learned bias gets its gradient
        if not _needs_grad(inputs):
            out = run()
            rec.add_attention(q, k, v, mask, out, kind, at=at)
            return out
        result: list[torch.Tensor] = []

        def record_backward(grad_out, needed):
            grads = self._empty_grads(inputs, needed)
            rec.add_attention_backward(q, k, v, mask, result[0], grad_out, grads, kind, ("backward", at[1]))
            return grads

        out = _FusedRegion.apply(run, record_backward, *inputs)
        # Detached: the output itself would hold its grad_fn, whose context holds this closure (a cycle keeping the
        # recorder and the model alive); only its size is needed.
        result.append(out.detach())
        rec.add_attention(q, k, v, mask, out, kind, at=at)
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
        stack = rec.scopes.stack
        at = rec.current()
        category = C.classify_op("aten::_fused_rms_norm", attention_kind=attention_context(stack),
                                 in_norm=in_norm(stack))  # fmt: skip
        tensors = [t for t in (x, weight) if isinstance(t, torch.Tensor)]
        if not _needs_grad(tensors):
            out = self._suppressed(func, args, kwargs)
            rec.add("aten::_fused_rms_norm", category, 0, tensors, [out], at=at)
            return out

        def record_backward(grad_out, needed):
            grads = self._empty_grads(tensors, needed)
            outputs = [g for g in grads if g is not None]
            rec.add("aten::_fused_rms_norm_backward", category, 0, [grad_out, *tensors], outputs,
                    at=("backward", at[1]))  # fmt: skip
            return grads

        out = _FusedRegion.apply(lambda: self._suppressed(func, args, kwargs), record_backward, *tensors)
        rec.add("aten::_fused_rms_norm", category, 0, tensors, [out], at=at)
        return out
