"""CUDA graphs around a denoiser's forward: ``ldmopt.cuda_graphs(pipe)`` replays each call instead of running it.

Why: at SD-class sizes a denoising step is bound by host time on a fast GPU (2026-12-04 on an H200: stock SD1.5
22.1 ms a step eager against 10.1 ms as a CUDA graph, and a patched step more so, since each fused module spends
its own Python on argument checks and backend choice). A graph replay launches the whole step's kernels with one
call, so what is left is the GPU's time. Unlike ``torch.compile(mode="reduce-overhead")`` nothing is traced or
compiled: the forward runs as it is (patched or not) a few times and is then captured.

How a call goes: the call's arguments are flattened (torch's pytree: tuples, lists, dicts, diffusers' output
classes); the tensors' shapes, strides, dtypes and devices and every other argument's value form the key. The first
call with a key copies its tensors into static buffers, runs the forward ``warmup_calls`` times on a side stream (so
lazy initialisation, Triton's autotuning and ldmopt's statistics hand-overs settle outside the graph), captures one
more call and replays it. Later calls with the key copy their tensors into those buffers and replay. The outputs are
cloned out of the graph's static buffers (``clone_outputs=False`` returns the buffers themselves, which the next call
may overwrite, whatever its signature: the graphs of one model share a memory pool). That pool keeps the captured
calls' activations reserved, about one forward's worth for the largest signature held; ``reset()`` or ``remove()``
hands it back to PyTorch's caching allocator.

Each call that cannot replay runs the forward eagerly, and :class:`CudaGraphs` counts it under its reason
(``graphs.eager_calls``, also in ``str(graphs)``); a reason is warned once per model. The reasons: autograd
recording (pipelines run under ``torch.no_grad``), train mode, tensors off CUDA or on several devices, an argument
that is neither a tensor nor a hashable value, a non-tensor argument that takes a new value call after call (more than
``MAX_VALUE_VARIANTS`` graphs for the same tensors: a Python-number timestep), hooks inside the model whose Python
would run only at capture (diffusers' cache hooks, accelerate's offloading hooks, forward hooks on submodules), a
capture that failed (the key then stays eager). Under autocast the capture casts from the weights themselves, not
from autocast's weight cache, which is freed when the caller's autocast region ends.

What a graph cannot see: it replays the kernels and addresses of its capture. Parameters and buffers that move or
are replaced (``.to()``, ``.data =``, ``load_state_dict(assign=True)``) are noticed on each call (their addresses,
those of a quantized weight's parts, are compared with the capture's, the objects held weakly) and the graphs
recaptured; if that happens on more than ``MAX_RECAPTURES`` calls the wrapper stays eager. Not noticed (walking the
model's modules on every call would cost about 0.7 ms of host time for SD1.5's UNet, on the CI machine's CPU,
2026-12-07): a parameter replaced while something else still holds the old one, new LoRA layers or adapter scales,
hooks added after a capture (global module hooks at any time), ``ldmopt.patch``: call ``graphs.reset()`` after such
changes, which also forgets why calls ran eagerly (``ldmopt.patch``/``unpatch`` refuse a graphed model).
"""

from __future__ import annotations

import functools
import inspect
import threading
import warnings
import weakref
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from .ops._dispatch import MAX_REASONS, count_bounded

#: where a graphed model keeps its wrapper (instance attribute; also what ldmopt.patch checks)
GRAPHED = "_ldmopt_cuda_graphs"
#: the pipeline components graphed by default: the denoisers and the ControlNets beside them, called every step
DENOISERS = ("unet", "transformer", "transformer_2", "prior", "decoder", "controlnet")
#: calls on which the parameters moved before the wrapper gives up and stays eager
MAX_RECAPTURES = 2
#: graphs captured for one set of tensor shapes that differ only in a non-tensor argument's value; a further value
#: runs eagerly (a Python-number timestep would otherwise capture a graph every step)
MAX_VALUE_VARIANTS = 3
#: Signatures a wrapper remembers beyond its graphs (their value variants, and the ones whose capture failed), least
#: recently seen forgotten first: a server that sees ever-new shapes must not grow them without bound. A forgotten
#: failed signature is tried once more when it returns.
MAX_REMEMBERED_KEYS = 256
_MISSING = object()
_SCALARS = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, torch.memory_format)


def capture_graph(
    run: Callable[[], Any],
    warmup: int,
    device: torch.device,
    *,
    pool: Any = None,
    before_capture: Callable[[], None] | None = None,
) -> tuple[torch.cuda.CUDAGraph, Any]:
    """``run()`` captured as a CUDA graph on ``device``, after ``warmup`` (at least one) calls on a side stream as
    capture requires (which also keeps Triton's compilation and autotuning out of the graph), all on ``device``'s
    streams. Returns the graph, replayed once (the first launch uploads it), and what the captured call returned:
    its tensors are the graph's static outputs."""
    with torch.cuda.device(device):
        side = torch.cuda.Stream(device)
        caller = torch.cuda.current_stream(device)
        side.wait_stream(caller)
        with torch.cuda.stream(side):
            for _ in range(max(warmup, 1)):
                run()
        caller.wait_stream(side)
        if before_capture is not None:
            before_capture()
        graph = torch.cuda.CUDAGraph()
        try:
            stream = torch.cuda.Stream(device)
            with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                output = run()
        except BaseException:
            # torch.cuda.graph ends the capture before it restores the stream: put the caller's stream back.
            torch.cuda.set_stream(caller)
            raise
        graph.replay()
    return graph, output


class CudaBackend:
    """Captures with torch.cuda (the tests stand in a backend that runs on the CPU)."""

    def __init__(self):
        self._last_stream: dict[torch.device, Any] = {}

    def supports(self, device: torch.device) -> str | None:
        if device.type != "cuda":
            return f"tensors on {device}: CUDA graphs hold CUDA work only"
        return None

    def new_pool(self, device: torch.device) -> Any:
        with torch.cuda.device(device):
            return torch.cuda.graph_pool_handle()

    def capture(self, run: Callable[[], Any], warmup: int, device: torch.device, pool: Any) -> tuple[Callable, Any]:
        graph, output = capture_graph(run, warmup, device, pool=pool)

        def replay():
            graph.replay()
            self._last_stream[device] = torch.cuda.current_stream(device)

        self._last_stream[device] = torch.cuda.current_stream(device)
        return replay, output

    def order_after_last_replay(self, device: torch.device) -> None:
        """Before a call copies into static buffers: a replay on another stream must be done with them (and with the
        shared pool) first."""
        last = self._last_stream.get(device)
        current = torch.cuda.current_stream(device)
        if last is not None and last != current:
            current.wait_stream(last)


_BACKEND: Any = CudaBackend()


class _Eager(Exception):
    """A call that runs eagerly; the message is the reason counted."""


def _remembered(table: OrderedDict, key: Any, default: Any) -> Any:
    """``table.setdefault(key, default)``, as the most recently seen of at most MAX_REMEMBERED_KEYS keys."""
    if key in table:
        table.move_to_end(key)
        return table[key]
    if len(table) >= MAX_REMEMBERED_KEYS:
        table.popitem(last=False)
    table[key] = default
    return default


@dataclass
class _Graph:
    static_inputs: list[torch.Tensor]
    replay: Callable[[], Any]
    output: Any  # the captured call's return value: its tensors are overwritten by each replay


def _tensor_key(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad, t.is_inference())


def _static_copy(t: torch.Tensor) -> torch.Tensor:
    """A buffer with ``t``'s values and, where ``t`` is dense, its strides; an expanded or overlapping view (diffusers'
    ``t.expand(batch)`` timesteps) gets a dense buffer, which later calls' views can be copied into."""
    return torch.empty_like(t).copy_(t)


def _stateful_hooks(model: nn.Module) -> str:
    """What in ``model`` runs Python a graph would not replay: diffusers' hooks (caches such as FasterCache or
    Pyramid Attention Broadcast decide per step), accelerate's (offloading: the root's wraps its forward, so it runs
    inside the wrapped call), torch forward hooks on submodules. "" when nothing does. The root's own torch hooks run
    outside its forward, on every call, and are fine."""
    for name, module in model.named_modules():
        where = name or "the model"
        if getattr(getattr(module, "_diffusers_hook", None), "hooks", None):
            return f"diffusers hooks on {where} ({', '.join(module._diffusers_hook.hooks)})"
        if getattr(module, "_hf_hook", None) is not None:
            return f"accelerate hooks on {where} (offloading or device placement)"
        if module is not model and (module._forward_hooks or module._forward_pre_hooks):
            return f"forward hooks on {name}"
    return ""


_PLAIN = (torch.Tensor, nn.Parameter)


def _gone_or_parts(t: torch.Tensor | None) -> Any:
    return -1 if t is None else _data_addresses(t)


def _data_addresses(t: torch.Tensor) -> Any:
    """Where ``t``'s data lies: its data pointer, or for a wrapper subclass (quantized weights: data_ptr() is 0) the
    pointers of the tensors it is made of."""
    if type(t) in _PLAIN or not hasattr(t, "__tensor_flatten__"):
        return t.data_ptr()
    names, _ = t.__tensor_flatten__()
    return tuple(_data_addresses(getattr(t, name)) for name in names)


class GraphedMethod:
    """The wrapper installed as a model's method (``forward``): a CUDA graph per call signature (module docstring)."""

    def __init__(
        self, model: nn.Module, label: str, *, method: str, max_graphs: int, warmup_calls: int, clone_outputs: bool
    ):
        self.model = model
        self.label = label
        self.method = method
        self.max_graphs = max_graphs
        self.warmup_calls = warmup_calls
        self.clone_outputs = clone_outputs
        self.inner = getattr(model, method)  # the bound method, or one already wrapped by an instance attribute
        self.saved_method = model.__dict__.get(method, _MISSING)
        self.graphs: OrderedDict[Any, _Graph] = OrderedDict()  # least recently used first
        self.refused: OrderedDict[Any, str] = OrderedDict()  # keys whose capture failed, with the reason: eager
        self.eager_calls: Counter[str] = Counter()
        self.captures = 0
        self.replays = 0  # calls answered by a replay, over every graph captured (evicted ones included)
        self.evicted = 0
        self.recaptures = 0
        self.disabled: str | None = None
        self._warned: set[str] = set()
        self._lock = threading.RLock()
        self._pool: Any = None
        self._weights: list[weakref.ref] = []  # weak: a replaced parameter then reads as moved, and is not kept alive
        self._addresses: list[int] = []
        # keys captured per key with the non-tensor values left out
        self._variants: OrderedDict[Any, set] = OrderedDict()
        functools.update_wrapper(self, self.inner)  # __wrapped__, __doc__, __name__: inspect.signature still works
        self.__signature__ = inspect.signature(self.inner)

    # -- a call -----------------------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # traced by torch.compile: the forward itself ("reduce-overhead" graphs it)
            return self.inner(*args, **kwargs)
        # One call at a time through the graphs: calls from two threads would share the static buffers.
        with self._lock:
            try:
                key, tensors_key, leaves, spec, device = self._key(args, kwargs)
                graph = self.graphs.get(key)
                if graph is None:
                    if key in self.refused:
                        self.refused.move_to_end(key)  # seen again: the most recently seen, last forgotten
                        raise _Eager(self.refused[key])
                    return self._capture(key, tensors_key, leaves, spec, device, args, kwargs)
                if tensors_key in self._variants:
                    self._variants.move_to_end(tensors_key)
                return self._replay(key, graph, leaves, device)
            except _Eager as why:
                reason = str(why)
        return self._eager(reason, args, kwargs)

    def _replay(self, key: Any, graph: _Graph, leaves: list[Any], device: torch.device) -> Any:
        self.graphs.move_to_end(key)
        _BACKEND.order_after_last_replay(device)  # the static buffers are shared with the previous call's replay
        for static, t in zip(graph.static_inputs, (leaf for leaf in leaves if isinstance(leaf, torch.Tensor))):
            static.copy_(t)
        graph.replay()
        self.replays += 1
        return self._returned(graph.output)

    def _key(self, args: tuple, kwargs: dict) -> tuple[Any, Any, list[Any], Any, torch.device]:
        """The call's signature, the same with the non-tensor values left out (their types kept), its flattened
        arguments and their spec, and the device of its tensors."""
        if self.disabled is not None:
            raise _Eager(self.disabled)
        if self.model.training:
            raise _Eager("train mode (dropout and other training behaviour would be frozen in the graph)")
        grad = torch.is_grad_enabled()
        leaves, spec = pytree.tree_flatten((args, kwargs))
        parts: list[Any] = [spec, grad, torch.is_inference_mode_enabled()]
        tensors_only = list(parts)
        devices: set[torch.device] = set()
        inputs_need_grad = False
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor):
                parts.append(_tensor_key(leaf))
                tensors_only.append(parts[-1])
                devices.add(leaf.device)
                inputs_need_grad |= leaf.requires_grad
                continue
            if not isinstance(leaf, _SCALARS):
                try:
                    hash(leaf)
                except TypeError:
                    raise _Eager(f"argument {i} is a {type(leaf).__name__}, neither a tensor nor hashable") from None
            parts.append((type(leaf), leaf))
            tensors_only.append(type(leaf))
        if not devices:
            raise _Eager("no tensor arguments")
        if len(devices) > 1:
            raise _Eager(f"tensors on several devices ({sorted(map(str, devices))}): a graph holds one GPU's work")
        (device,) = devices
        refusal = _BACKEND.supports(device)
        if refusal is not None:
            raise _Eager(refusal)
        if grad and (inputs_need_grad or any(p.requires_grad for p in self.model.parameters())):
            raise _Eager("autograd is recording: call the model under torch.no_grad() or torch.inference_mode()")
        autocast = torch.is_autocast_enabled(device.type) and torch.get_autocast_dtype(device.type)
        parts.append(autocast)
        tensors_only.append(autocast)
        if self._addresses and self._current_addresses() != self._addresses:
            self._weights_moved()
        return tuple(parts), tuple(tensors_only), leaves, spec, device

    def _current_addresses(self) -> list[Any]:
        # Checked on every call: one list comprehension of C calls (686 weights in SD1.5's UNet).
        return [w.data_ptr() if type(w := ref()) in _PLAIN else _gone_or_parts(w) for ref in self._weights]

    def _weights_moved(self) -> None:
        self.recaptures += 1
        self._drop()
        if self.recaptures > MAX_RECAPTURES:
            self.disabled = (
                f"parameters moved on {self.recaptures} calls (offloading hooks, .to() between calls): eager from "
                "then on"
            )
            raise _Eager(self.disabled)

    def _capture(
        self, key: Any, tensors_key: Any, leaves: list[Any], spec: Any, device: torch.device, args: tuple, kwargs: dict
    ) -> Any:
        variants = _remembered(self._variants, tensors_key, set())
        if key not in variants and len(variants) >= MAX_VALUE_VARIANTS:
            raise _Eager(
                f"a non-tensor argument took more than {MAX_VALUE_VARIANTS} values with the same tensors (a Python-"
                "number timestep or scale?): each value would be a graph of its own; pass it as a tensor"
            )
        hooked = _stateful_hooks(self.model)
        if hooked:
            raise _Eager(f"{hooked}: their Python would run once, at capture, and never on replays")
        if len(self.graphs) >= self.max_graphs:  # the least recently used graph makes room
            self.graphs.popitem(last=False)
            self.evicted += 1
        if not self.graphs:  # no graph holds the pool: a fresh one (a pool nothing uses may not be captured into)
            self._pool = None
        autocast = torch.is_autocast_enabled(device.type) and torch.get_autocast_dtype(device.type)

        def run():
            if not autocast:
                return self.inner(*static_args, **static_kwargs)
            # Autocast's cache of cast weights is freed when the caller's autocast region ends: a graph must cast
            # from the weights themselves (torch.cuda.make_graphed_callables refuses the cache for that reason).
            with torch.autocast(device.type, dtype=autocast, cache_enabled=False):
                return self.inner(*static_args, **static_kwargs)

        try:
            if self._pool is None:
                self._pool = _BACKEND.new_pool(device)
            static_leaves = [_static_copy(x) if isinstance(x, torch.Tensor) else x for x in leaves]
            static_args, static_kwargs = pytree.tree_unflatten(static_leaves, spec)
            replay, output = _BACKEND.capture(run, self.warmup_calls, device, self._pool)
        except Exception as exc:  # the key stays eager; the reason names what capture raised
            first_line = str(exc).splitlines()[0][:160] if str(exc) else ""
            _remembered(self.refused, key, f"capture failed: {type(exc).__name__}: {first_line}")
            if not self.graphs:
                self._pool = None  # a failed capture keeps its hold on the pool
            return self._eager(self.refused[key], args, kwargs)
        self.captures += 1
        variants.add(key)
        if not self._addresses:  # after the capture: where the graph reads the weights (warm-up may have moved them)
            weights = [*self.model.parameters(), *self.model.buffers()]
            self._weights = [weakref.ref(w) for w in weights]
            self._addresses = [_data_addresses(w) for w in weights]
        self.replays += 1
        graph = _Graph([x for x in static_leaves if isinstance(x, torch.Tensor)], replay, output)
        self.graphs[key] = graph  # the capture replayed it once: its output buffers hold this call's result
        return self._returned(output)

    def _returned(self, output: Any) -> Any:
        if not self.clone_outputs:
            return output
        return pytree.tree_map_only(torch.Tensor, torch.Tensor.clone, output)

    def _eager(self, reason: str, args: tuple, kwargs: dict) -> Any:
        count_bounded(self.eager_calls, reason)  # a capture's error text may name shapes: bounded like the others
        if reason not in self._warned and len(self._warned) < MAX_REASONS:
            self._warned.add(reason)
            warnings.warn(f"ldmopt.cuda_graphs: {self.label} runs eagerly: {reason}", RuntimeWarning, stacklevel=3)
        return self.inner(*args, **kwargs)

    def __reduce__(self):
        # deepcopy and pickle of a graphed model reach here: a copy cannot share the graphs, nor the lock.
        raise TypeError(
            f"ldmopt.cuda_graphs: {self.label}.{self.method} is replayed from CUDA graphs, which cannot be copied or "
            "pickled; remove them first (graphs.remove()), copy, then graph again (state_dict() needs no removal)"
        )

    # -- management -------------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Drop every graph and static buffer, and forget the decisions to run eagerly (failed captures, value
        variants, moved parameters): the next call of each signature captures again (after a change to the model,
        or the cause of an eager reason fixed). The counts of past calls (captures, replays, eager calls by reason)
        are history and stay."""
        with self._lock:  # not in the middle of another thread's capture
            self._drop()
            self.disabled = None
            self.recaptures = 0
            self._warned.clear()

    def _drop(self) -> None:
        self.graphs.clear()
        self.refused.clear()
        self._variants.clear()
        self._weights, self._addresses = [], []
        self._pool = None

    def summary(self) -> str:
        lines = [
            f"{self.label}: {len(self.graphs)} graphs held ({self.captures} captured, {self.evicted} evicted, "
            f"{self.recaptures} recaptures after parameters moved), {self.replays} replays, "
            f"{sum(self.eager_calls.values())} eager calls"
        ]
        lines += [f"  eager x{n}: {reason}" for reason, n in self.eager_calls.most_common()]
        return "\n".join(lines)


class CudaGraphs:
    """What :func:`cuda_graphs` installed: one :class:`GraphedMethod` per graphed model (``wrappers``, by component
    name), the pipeline's other models with why they were left (``skipped``). ``str()`` summarises graphs, replays
    and eager calls with their reasons; ``remove()`` puts the models' forwards back."""

    def __init__(self, wrappers: dict[str, GraphedMethod], skipped: dict[str, str]):
        self.wrappers = wrappers
        self.skipped = skipped

    @property
    def eager_calls(self) -> Counter[str]:
        """Calls that ran eagerly, by reason, over every graphed model."""
        return sum((w.eager_calls for w in self.wrappers.values()), Counter())

    @property
    def replays(self) -> int:
        return sum(w.replays for w in self.wrappers.values())

    def reset(self) -> None:
        """Drop every graph: call after changing a graphed model (LoRA layers or scales, hooks, replaced modules)."""
        for wrapper in self.wrappers.values():
            wrapper.reset()

    def remove(self) -> None:
        """Put each model's forward back as it was before :func:`cuda_graphs` and free its graphs; a model whose
        method was replaced since is left as it is and named in the RuntimeError raised after the others."""
        errors = []
        for wrapper in self.wrappers.values():
            try:
                _uninstall(wrapper)
            except RuntimeError as exc:
                errors.append(str(exc))
        if errors:
            raise RuntimeError("\n".join(errors))

    def __str__(self) -> str:
        lines = ["ldmopt.cuda_graphs:"]
        lines += ["  " + line for w in self.wrappers.values() for line in w.summary().splitlines()]
        lines += [f"  {label}: not graphed ({why})" for label, why in self.skipped.items()]
        return "\n".join(lines)

    __repr__ = __str__


def _install(model: nn.Module, label: str, **options: Any) -> GraphedMethod:
    if GRAPHED in model.__dict__:
        raise ValueError(f"ldmopt.cuda_graphs: {label} is already graphed; remove those graphs first")
    if type(model).__name__ == "OptimizedModule":
        raise ValueError(
            f"ldmopt.cuda_graphs: {label} is compiled (torch.compile); graph the model itself, or compile with "
            'mode="reduce-overhead", which captures CUDA graphs of its own'
        )
    method = options["method"]
    if not callable(getattr(model, method, None)):
        raise ValueError(f"ldmopt.cuda_graphs: method={method!r} is not a method of {label} ({type(model).__name__})")
    wrapper = GraphedMethod(model, label, **options)
    # An instance attribute: nn.Module.__call__ calls it as forward; the class's method is untouched.
    model.__dict__[method] = wrapper
    model.__dict__[GRAPHED] = wrapper
    return wrapper


def _uninstall(wrapper: GraphedMethod) -> None:
    with wrapper._lock:  # not while another thread replays or captures
        _uninstall_locked(wrapper)


def _uninstall_locked(wrapper: GraphedMethod) -> None:
    model = wrapper.model
    if model.__dict__.get(GRAPHED) is not wrapper:
        return  # removed already
    method = wrapper.method
    current = model.__dict__.get(method)
    if current is not wrapper:
        if _reaches(model, current, wrapper):
            by = "the class's" if current is None else getattr(current, "__qualname__", type(current).__qualname__)
            raise RuntimeError(  # named, not repr()'d: a bound method's or partial's repr prints the whole model
                f"ldmopt.cuda_graphs: {wrapper.label}.{method} was replaced since the graphs were installed (by "
                f"{by}), which still calls them; restore it first, or it would be lost"
            )
        # Dropped by whoever replaced it (accelerate's offload hooks, re-installed by a pipeline after each call,
        # put back the forward they saved before the graphs): nothing to restore, only the graphs to free.
        warnings.warn(
            f"ldmopt.cuda_graphs: {wrapper.label}.{method} was replaced since the graphs were installed, and the "
            "replacement no longer calls them (offload hooks re-installed?); their graphs are freed",
            RuntimeWarning,
            stacklevel=4,
        )
        del model.__dict__[GRAPHED]
        wrapper.reset()
        return
    if wrapper.saved_method is _MISSING:
        del model.__dict__[method]
    else:
        model.__dict__[method] = wrapper.saved_method
    del model.__dict__[GRAPHED]
    wrapper.reset()


def _reaches(model: nn.Module, method: Any, wrapper: GraphedMethod) -> bool:
    """Whether ``method`` (the model's method now) still calls ``wrapper``: is it, or wraps it (``__wrapped__``, a
    partial's function, accelerate's ``_old_forward``), a few levels deep."""
    seen = [method, model.__dict__.get("_old_forward")]
    for _ in range(8):
        if any(f is wrapper for f in seen):
            return True
        seen = [g for f in seen for g in (getattr(f, "__wrapped__", None), getattr(f, "func", None)) if g is not None]
        if not seen:
            return False
    return False


def cuda_graphs(
    pipe_or_model: Any,
    *,
    components: Iterable[str] = DENOISERS,
    method: str = "forward",
    max_graphs: int = 8,
    warmup_calls: int = 3,
    clone_outputs: bool = True,
) -> CudaGraphs:
    """Replay the denoiser of a diffusers pipeline (or ``pipe_or_model`` itself, an ``nn.Module``) as CUDA graphs,
    one per call signature; patched by ``ldmopt.patch`` or not (patch first). See the module docstring.

    Args:
        components: the pipeline's components to graph (default: its denoisers, ``DENOISERS``); the others are
            listed in the result's ``skipped``. Ignored for a model.
        method: the method replayed (default ``forward``, which ``model(...)`` calls; e.g. ``"decode"`` for a VAE
            given as the model).
        max_graphs: graphs kept per model; a new signature beyond them replaces the least recently used one.
        warmup_calls: eager calls (on a side stream) before each capture.
        clone_outputs: return copies of the graph's output buffers (default). False returns the buffers themselves,
            which the next call may overwrite (the graphs share a memory pool): consume them before the next call.

    Returns the installed :class:`CudaGraphs`; ``.remove()`` (or :func:`remove_cuda_graphs`) undoes it.
    """
    if not isinstance(max_graphs, int) or isinstance(max_graphs, bool) or max_graphs < 1:
        raise ValueError(f"ldmopt.cuda_graphs: max_graphs={max_graphs!r} is not supported; expected an int >= 1")
    if not isinstance(warmup_calls, int) or isinstance(warmup_calls, bool) or warmup_calls < 1:
        raise ValueError(f"ldmopt.cuda_graphs: warmup_calls={warmup_calls!r} is not supported; expected an int >= 1")
    options = {
        "method": method,
        "max_graphs": max_graphs,
        "warmup_calls": warmup_calls,
        "clone_outputs": bool(clone_outputs),
    }
    if isinstance(pipe_or_model, nn.Module):
        label = type(pipe_or_model).__name__
        return CudaGraphs({label: _install(pipe_or_model, label, **options)}, {})
    found = getattr(pipe_or_model, "components", None)
    if not isinstance(found, dict):
        raise TypeError(
            "ldmopt.cuda_graphs: expected a diffusers pipeline or a torch.nn.Module, got "
            f"{type(pipe_or_model).__name__}"
        )
    wanted = [components] if isinstance(components, str) else list(components)
    models = {name: m for name, m in found.items() if isinstance(m, nn.Module)}
    chosen = [name for name in wanted if name in models]
    if not chosen:
        raise ValueError(
            f"ldmopt.cuda_graphs: none of components={wanted} is a model of this {type(pipe_or_model).__name__} "
            f"(its models: {sorted(models)})"
        )
    wrappers: dict[str, GraphedMethod] = {}
    try:
        for name in chosen:
            wrappers[name] = _install(models[name], name, **options)
    except BaseException:
        for wrapper in wrappers.values():
            _uninstall(wrapper)
        raise
    skipped = {name: f"not in components={tuple(wanted)}" for name in models if name not in wrappers}
    return CudaGraphs(wrappers, skipped)


def remove_cuda_graphs(pipe_or_model: Any) -> int:
    """Undo :func:`cuda_graphs` on a pipeline's models (or a model) without its handle; returns how many."""
    if isinstance(pipe_or_model, nn.Module):
        models = [pipe_or_model]
    else:
        models = [m for m in getattr(pipe_or_model, "components", {}).values() if isinstance(m, nn.Module)]
    wrappers = [m.__dict__[GRAPHED] for m in models if GRAPHED in m.__dict__]
    for wrapper in wrappers:
        _uninstall(wrapper)
    return len(wrappers)


def graphed_models(models: Iterable[nn.Module]) -> list[nn.Module]:
    """Those of ``models`` (or their submodules) that :func:`cuda_graphs` wraps."""
    return [m for model in models for m in model.modules() if GRAPHED in m.__dict__]
