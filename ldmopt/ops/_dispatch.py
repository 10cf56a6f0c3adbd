"""Backend choice for every op: each backend declares what it refuses and why; the first that accepts runs.

Order of preference: ``cuda`` (ldmopt._C) -> ``triton`` -> ``torch`` (reference, always available). The choice is made
inside the op's implementation on real tensors, never while tracing. ``LDMOPT_BACKEND=<name>`` or
``with ldmopt.use_backend(<name>):`` forces a backend; a forced backend that cannot serve raises
:class:`BackendUnavailableError` with its reasons instead of falling through.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from .. import _env
from ._autocast import autocast_off
from ._refusals import INTERPRETER_BF16_DOT as INTERPRETER_BF16_DOT  # re-exported: the ops import them from here
from ._refusals import cuda_extension_refusals as cuda_extension_refusals
from ._refusals import stale_schema as stale_schema
from ._refusals import tensors_in
from ._refusals import triton_refusals as triton_refusals

BACKEND_NAMES = ("cuda", "triton", "torch")


@dataclass(frozen=True)
class _Policy:
    """One ``use_backend`` context: ``name`` (None: 'auto') for ``ops`` (None: every op); what it does not name
    falls to ``outer``, the enclosing context. ``inherited``: restored in a backward from its forward's context."""

    name: str | None
    ops: frozenset[str] | None
    outer: _Policy | None
    inherited: bool = False

    def names(self, op_name: str) -> bool:
        # Forcing an op forces its backward too (the backward tables are named '<op>_backward').
        return self.ops is None or op_name in self.ops or op_name.removesuffix("_backward") in self.ops


_forced: contextvars.ContextVar[_Policy | None] = contextvars.ContextVar("ldmopt_forced_backend", default=None)
#: How often each (op, backend) pair ran in this process: the patch report and tests read it.
backend_counts: Counter[tuple[str, str]] = Counter()


#: Distinct keys a reason counter keeps: reasons can name shapes, and a long-running server that sees ever-new shapes
#: must not grow them without bound; new reasons past the limit are counted under OTHER_REASONS.
MAX_REASONS = 1024
OTHER_REASONS = f"other reasons (more than {MAX_REASONS} distinct ones were seen)"


#: (op, backend, reason) -> how often an op ran its reference backend ("torch") in this process because a preferred
#: backend refused the inputs (not forced: ``use_backend`` / LDMOPT_BACKEND choices are the user's). PatchReport's
#: ``fallbacks()`` lists them.
fallback_reasons: Counter[tuple[str, str, str]] = Counter()
#: (op, ((backend, reason), ...)) -> calls: the same events, one key per call with every refusal it met (a call
#: refused by both cuda and triton counts once here, twice above); the patch report's summary lists these.
fallback_calls: Counter[tuple[str, tuple[tuple[str, str], ...]]] = Counter()


def count_bounded(counter: Counter, key: object) -> None:
    """``counter[key] += 1``, or ``counter[OTHER_REASONS] += 1`` for a new key once the counter holds MAX_REASONS."""
    if key not in counter and len(counter) >= MAX_REASONS:
        key = OTHER_REASONS
    counter[key] += 1


def snapshot_counts(counter: dict) -> dict:
    """A copy of a counter other threads may be adding keys to. ``dict.copy`` copies in C, hashing and comparing the
    counters' str / tuple keys without running Python code, so no other thread runs mid-copy; ``list(counter.items())``
    builds a tuple per item, and that allocation may run the garbage collector, whose finalizers let another thread
    in mid-iteration (seen in CI as 'dictionary changed size during iteration')."""
    return dict.copy(counter)


class BackendUnavailableError(RuntimeError):
    """A forced backend cannot serve these inputs; the message lists every reason."""


@dataclass(frozen=True)
class Backend:
    """One implementation of an op. ``refuse(*args)`` returns the reasons it cannot run them (empty: it can)."""

    name: str
    run: Callable
    refuse: Callable[..., list[str]] = field(default=lambda *args, **kwargs: [])


def _resolve(op_name: str) -> tuple[str | None, bool]:
    """(backend forced for ``op_name`` or None, whether it was inherited from the forward of a backward)."""
    if _DYNAMO_CANNOT_READ_CONTEXTVARS and torch.compiler.is_compiling():
        return _resolve_at_trace_time(op_name)
    return _resolve_now(op_name)


_NOT_FORCED = (None, False)


def _resolve_now(op_name: str) -> tuple[str | None, bool]:
    # Runs on every op call (twice in a fused conv): the common case, no context and LDMOPT_BACKEND unset, costs a
    # ContextVar read and one environment lookup.
    policy = _forced.get()
    while policy is not None:
        if policy.names(op_name):
            if policy.name is not None:
                return policy.name, policy.inherited
            break  # 'auto' here: only LDMOPT_BACKEND can still force it
        policy = policy.outer
    env = _env.getenv("LDMOPT_BACKEND")
    if not env:
        return _NOT_FORCED
    env = env.strip().lower()
    if env and env != "auto":
        if env not in BACKEND_NAMES:
            raise ValueError(f"LDMOPT_BACKEND={env!r} is not a backend; expected one of {BACKEND_NAMES} or 'auto'")
        return env, False
    return _NOT_FORCED


#: dynamo reads (and guards on) a ContextVar from torch 2.14; before, reading one inside torch.compile is a graph
#: break. There the backend forced when dynamo traces a Python decision that asks for it (the fused resnet asking
#: whether a conv reads its input in two parts, say) is baked into the graph: a use_backend or LDMOPT_BACKEND change
#: around later calls of the compiled model does not retrace it (torch._dynamo.reset() does). The fused ops themselves
#: still choose their backend when they run, from the live context.
_DYNAMO_CANNOT_READ_CONTEXTVARS = torch.torch_version.TorchVersion(torch.__version__) < (2, 14)


# its own function, so that _resolve_now stays traced (and guarded) on 2.14
@_env.dynamo_constant
def _resolve_at_trace_time(op_name: str) -> tuple[str | None, bool]:
    return _resolve_now(op_name)


def forced_backend(op_name: str) -> str | None:
    """The backend forced for ``op_name`` by the innermost context manager naming it, else by LDMOPT_BACKEND, else
    None."""
    return _resolve(op_name)[0]


@contextlib.contextmanager
def use_backend(name: str, ops: Sequence[str] | None = None) -> Iterator[None]:
    """Force backend ``name`` ('cuda', 'triton', 'torch' or 'auto') for all ops, or only for the ops named (and
    their backwards); ops not named keep what the enclosing context forces. Inside torch.compile on torch before 2.14,
    Python decisions traced from it are fixed at trace time (the ops still follow it when they run)."""
    name = name.lower()
    if name != "auto" and name not in BACKEND_NAMES:
        raise ValueError(f"use_backend: name={name!r} is not a backend; expected one of {BACKEND_NAMES} or 'auto'")
    tables = None if ops is None else _tables_named(ops)
    with _in_context(_Policy(None if name == "auto" else name, tables, _forced.get())):
        yield


#: The op name of every BackendTable (registered as each is made: the ops modules are imported with ldmopt).
TABLE_NAMES: set[str] = set()
#: Public functions of ldmopt.ops -> every table they run besides their own name's (and '<table>_backward'). A
#: backward table shared with another op (group_norm_backward, linear_backward, ...) is then forced for that op's
#: backward too.
OP_ALIASES = {
    "gn_silu_conv2d": (
        "gn_conv2d",
        "conv_epilogue",
        "gn_conv2d_stats",
        "group_norm_stats_from_sums",
        "group_norm_apply",
        "group_norm_backward",
    ),
    "layer_norm_linear": (
        "layer_norm_linear",
        "layer_norm_stats",
        "layer_norm_apply",
        "linear_epilogue",
        "linear_backward",
        "geglu_backward",
        "adaln_modulate_backward",
    ),
    "linear": ("linear", "linear_stats", "linear_epilogue"),
    "geglu": ("geglu", "linear_epilogue"),
    "layer_norm_rope": ("rms_norm",),
    "rms_norm_joint": ("rms_norm_joint", "rms_norm_backward"),
    "temporal_attention": ("temporal_attention", "temporal_attention_out"),
}


def _tables_named(ops: Sequence[str]) -> frozenset[str]:
    """The table names ``use_backend(ops=...)`` means: a public op name (ldmopt.ops.gn_silu_conv2d) or a table name
    (as the patch report counts them: gn_conv2d, linear_backward); anything else is an error, not a silent no-op."""
    if isinstance(ops, str):
        ops = (ops,)
    names = set()
    for op in ops:
        if op in OP_ALIASES:
            names.update(OP_ALIASES[op])
        elif op in TABLE_NAMES:
            names.add(op)
        else:
            known = sorted({*OP_ALIASES, *(t for t in TABLE_NAMES if not t.endswith("_backward"))})
            raise ValueError(
                f"use_backend: ops contains {op!r}, not an ldmopt op; expected names from {known} (or a backward "
                "table's own, '<name>_backward')"
            )
    return frozenset(names)


@contextlib.contextmanager
def _in_context(policy: _Policy | None) -> Iterator[None]:
    prior = _forced.get()
    token = _forced.set(policy)
    try:
        yield
    finally:
        try:
            _forced.reset(token)
        except ValueError:  # left in another context than entered (a generator resumed by a thread pool's copies)
            if _forced.get() is policy:  # ours to undo here; another context's own choice is left alone
                _forced.set(prior)


# ------------------------------------------------------------------------------------------------ eager fast path
#
# A torch.library custom op costs 10-25 us of host time per call in eager mode (the Python dispatcher, its autograd
# wrapper, a dynamo-disabled frame), several times an aten op's. Whole-model steps make hundreds of these calls, and
# small models (DiT-XL/2 at 256 px) are host-bound: that cost alone can make a patched model slower than the unfused
# one. Eager calls on plain tensors therefore run the op's implementation directly, through a torch.autograd.Function
# built from the same setup_context/backward when gradients are needed. Everything else keeps the custom op: tracing
# (torch.compile, export, torch.jit.trace), tensor subclasses (FakeTensor, DTensor), dispatch or function modes
# (FlopCounterMode, TorchDispatchMode, torch.device), meta tensors, a dual level without tangents and the profiler
# (whose per-category split reads op names); functorch transforms and tangents run the reference composition.

_EAGER: dict[object, Callable] = {}
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _no_mode_active() -> bool:
    return not (
        torch._C._len_torch_dispatch_stack()
        or torch._C._is_torch_function_mode_enabled()
        or torch._C._are_functorch_transforms_active()
        or torch._C._autograd._profiler_enabled()
        or torch._C._get_tracing_state() is not None  # torch.jit.trace (and the ONNX exporter on it)
        or torch.autograd.forward_ad._current_level >= 0  # dual tensors: their tangents would flow through aten
    )


def _eager_grad_needs(args: Sequence) -> bool | None:
    """None when an argument needs the dispatcher (a tensor subclass or a meta tensor), else whether autograd must
    record the call (grad mode on and some tensor argument requires grad)."""
    grad_mode = torch.is_grad_enabled()
    needs = False
    for a in args:
        if isinstance(a, torch.Tensor):
            if type(a) not in _PLAIN_TENSORS or a.is_meta:
                return None
            needs = needs or (grad_mode and a.requires_grad)
    return needs


def _has_tangent(t: torch.Tensor) -> bool:
    from torch.autograd.forward_ad import unpack_dual

    while torch._C._functorch.is_batchedtensor(t):  # vmap's wrappers: unpack_dual has no batching rule
        t = torch._C._functorch.get_unwrapped(t)
    return unpack_dual(t).tangent is not None


def runs_reference_composition(args: Sequence) -> bool:
    """Whether a call with ``args`` must run as its reference composition of PyTorch ops: under torch.func transforms
    (grad, vjp, vmap, jvp, jacfwd, hessian, functionalize) and for forward-mode AD with a tangent. Custom ops take no
    forward-mode rule (PyTorch would drop the tangent silently: None on dual tensors, zeros under torch.func.jvp), and
    their autograd does not run under functorch's grad transforms; the aten ops of the reference serve every one."""
    if torch._C._are_functorch_transforms_active():
        return True
    if torch.autograd.forward_ad._current_level >= 0:
        return any(_has_tangent(t) for t in tensors_in(args))
    return False


def statistics_source(x: torch.Tensor) -> torch.Tensor:
    """The tensor normalisation statistics are computed from: ``x`` detached (the fused op's backward differentiates
    through its statistics itself), except when the op runs as its reference composition, whose derivatives must
    flow through the statistics as through any other PyTorch op."""
    return x if runs_reference_composition((x,)) else x.detach()


def _reference_composition(op, args: Sequence):
    """``op``'s implementation with every op on the torch backend: differentiable PyTorch ops only. Under
    torch.compile it runs outside the graph (a graph break): the backend choice is not traceable."""
    if torch.compiler.is_compiling():
        torch._dynamo.graph_break(
            msg="ldmopt: a torch.func transform or forward-mode AD over an ldmopt op runs the op's reference "
            "composition eagerly (compile with fullgraph=False, or apply the transform outside the compiled region)"
        )
    impl = _implementation(op)
    if impl is None:
        raise NotImplementedError(
            f"{getattr(op, '_name', op)}: forward-mode AD and torch.func transforms need this torch's CustomOpDef "
            "implementation (_init_fn), which it does not expose; run the stock modules (ldmopt.unpatch(model))."
        )
    with use_backend("torch"):
        return impl(*args)


def call(op, *args):
    """``op(*args)``, through the eager fast path when nothing needs the dispatcher (see above), or as its reference
    composition where derivatives must pass through PyTorch ops (:func:`runs_reference_composition`)."""
    if not torch.compiler.is_compiling():
        fast = _EAGER.get(op)
        if fast is not None and _no_mode_active():
            needs_grad = _eager_grad_needs(args)
            if needs_grad is not None:
                return fast(needs_grad, *args)
    if runs_reference_composition(args):
        return _reference_composition(op, args)
    return op(*args)


def _implementation(op) -> Callable | None:
    # The function the custom op was defined from (CustomOpDef keeps it; None on a torch that does not).
    return getattr(op, "_init_fn", None)


def register_eager(op, mutated: Sequence[int] = ()) -> None:
    """Let ``call`` run ``op``'s implementation directly when no input needs a gradient (ops without autograd: they
    keep the custom op's error otherwise). ``mutated``: positions of the arguments the op writes, whose version
    counters are bumped as the custom op would."""
    impl = _implementation(op)
    if impl is None:
        return

    def fast(needs_grad, *args):
        if needs_grad:
            return op(*args)
        out = impl(*args)
        for i in mutated:
            torch.autograd.graph.increment_version(args[i])
        return out

    _EAGER[op] = fast


def _register_eager_autograd(op, setup: Callable, backward: Callable) -> None:
    impl = _implementation(op)
    if impl is None:
        return
    function = type(
        f"{getattr(op, '_name', 'ldmopt_op')}_eager",
        (torch.autograd.Function,),
        {
            "forward": staticmethod(impl),
            "setup_context": staticmethod(setup),
            "backward": staticmethod(backward),
        },
    )

    def fast(needs_grad, *args):
        return function.apply(*args) if needs_grad else impl(*args)

    _EAGER[op] = fast


def register_autograd_keeping_backend(
    op, backward: Callable, setup_context: Callable, differentiable: Callable | None = None
) -> None:
    """``op.register_autograd`` whose backward runs under the backends forced when the forward ran.

    On a GPU the autograd engine runs backward on its own device threads, which do not see the caller's
    ``use_backend`` context (a ContextVar): without this, ``with use_backend("torch"): loss.backward()`` would time or
    check an automatically chosen backward. The forward's context is laid over the backward's own (ops it does not
    name keep what the backward's thread forces: on a GPU's autograd threads only ``LDMOPT_BACKEND``), and a backend
    it forces that a backward op does not have (``cuda`` for the temporal attention backward) is chosen automatically
    there instead of raising. Not covered: recomputed forwards under gradient checkpointing and the compiled backward
    under torch.compile choose by their own context; ``LDMOPT_BACKEND`` forces every pass.

    With ``create_graph=True`` the gradients are routed through :class:`_DoubleBackwardRefused` unless
    ``differentiable(ctx)`` says this backward is made of PyTorch ops on saved inputs only (exact to differentiate)."""

    def setup(ctx, inputs, output):
        ctx.ldmopt_forced = _forced.get()
        setup_context(ctx, inputs, output)

    def run_backward(ctx, *grads):
        if ctx.ldmopt_forced is None:
            input_grads = backward(ctx, *grads)
        else:
            with _in_context(_inherited(ctx.ldmopt_forced, _forced.get())):
                input_grads = backward(ctx, *grads)
        if torch.is_grad_enabled() and not (differentiable is not None and differentiable(ctx)):  # create_graph
            return _refusing_double_backward(getattr(op, "_qualname", "an ldmopt op"), input_grads)
        return input_grads

    op.register_autograd(run_backward, setup_context=setup)
    _register_eager_autograd(op, setup, run_backward)


class _DoubleBackwardRefused(torch.autograd.Function):
    """Passes gradients through unchanged; differentiating them raises. The backwards are hand-written from saved
    tensors (some of them forward outputs, treated as constants), so a second derivative through them would be
    wrong or fail with a message about registering autograd."""

    @staticmethod
    def forward(ctx, op_name, *grads):
        ctx.op_name = op_name
        return tuple(g.view_as(g) for g in grads)

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError(
            f"{ctx.op_name}: double backward (differentiating a gradient taken with create_graph=True) is not "
            "supported through the fused ops' backward. Take the inner gradient with torch.func.grad or "
            "torch.func.vjp instead (the ops then run their reference composition of PyTorch ops, which supports "
            "derivatives of any order, and the result still backpropagates as usual), or run the stock modules "
            "(ldmopt.unpatch(model))."
        )


def _refusing_double_backward(op_name: str, input_grads):
    """``input_grads`` (a backward's result) with the gradients that are part of a graph routed through
    :class:`_DoubleBackwardRefused`."""
    single = not isinstance(input_grads, tuple)
    grads = (input_grads,) if single else input_grads
    linked = [i for i, g in enumerate(grads) if isinstance(g, torch.Tensor) and g.requires_grad]
    if not linked:
        return input_grads
    guarded = _DoubleBackwardRefused.apply(op_name, *(grads[i] for i in linked))
    out = list(grads)
    for i, g in zip(linked, guarded):
        out[i] = g
    return out[0] if single else tuple(out)


def _inherited(policy: _Policy | None, outer: _Policy | None) -> _Policy | None:
    if policy is None:
        return outer
    return _Policy(policy.name, policy.ops, _inherited(policy.outer, outer), inherited=True)


@dataclass
class BackendTable:
    """The backends of one op, in order of preference."""

    op_name: str
    backends: list[Backend]

    def __post_init__(self) -> None:
        TABLE_NAMES.add(self.op_name)

    def reasons(self, *args) -> dict[str, list[str]]:
        return {b.name: b.refuse(*args) for b in self.backends}

    def forced(self) -> str | None:
        """The backend forced for this op in this context (None: chosen automatically)."""
        if _DYNAMO_CANNOT_READ_CONTEXTVARS:
            forced, inherited = _resolve(self.op_name)
        else:  # what _resolve calls there, one Python call fewer on every op call
            forced, inherited = _resolve_now(self.op_name)
        if inherited and forced not in {b.name for b in self.backends}:
            return None  # the forward's backend has no backward of this op: choose automatically
        return forced

    def select(self, *args) -> Backend:
        forced = self.forced()
        if forced is not None:
            for backend in self.backends:
                if backend.name == forced:
                    reasons = backend.refuse(*args)
                    if reasons:
                        raise BackendUnavailableError(
                            f"ldmopt.{self.op_name}: backend {forced!r} was forced but cannot run these inputs: "
                            + "; ".join(reasons)
                        )
                    return backend
            raise BackendUnavailableError(
                f"ldmopt.{self.op_name}: backend {forced!r} was forced but this op has only "
                f"{[b.name for b in self.backends]}"
            )
        for backend in self.backends:
            if not backend.refuse(*args):
                return backend
        raise BackendUnavailableError(f"ldmopt.{self.op_name}: no backend can run these inputs: {self.reasons(*args)}")

    def __call__(self, *args):
        backend = self.select(*args)
        if backend.name == "torch" and self.forced() is None:
            self.record_refusals(args)
        backend_counts[(self.op_name, backend.name)] += 1
        return launch(backend, args)

    def record_refusals(self, args: Sequence) -> None:
        """Count in ``fallback_reasons`` why each preferred backend refused these inputs (the reference runs), and
        in ``fallback_calls`` the call with all of them."""
        refusals = []
        for other in self.backends:
            if other.name != "torch":
                for reason in other.refuse(*args):
                    count_bounded(fallback_reasons, (self.op_name, other.name, reason))
                    refusals.append((other.name, reason))
        count_bounded(fallback_calls, (self.op_name, tuple(refusals)))


def launch(backend: Backend, args: Sequence):
    """``backend.run(*args)``, a Triton one with the inputs' GPU made current: Triton launches on the current
    device's current stream, so a model on cuda:1 (a device_map, ``--device cuda:1``) while cuda:0 is current would
    run its kernels on the wrong GPU. (The cuda backend's C++ ops set the device themselves.)

    Always with torch.autocast off: the op's operands were cast for autocast before the op (ops._autocast), and a
    reference backend's own F.conv2d / matmul must not cast them again (a compiled graph runs them without autocast,
    so eager and compiled results would differ, and the reference's fp32 math would run in 16 bits)."""
    first = None
    for a in args:  # every op's inputs share one device
        if isinstance(a, torch.Tensor):
            first = a
            break
    # The common case in one C call: CPU or CUDA tensors with no autocast on (_is_any_autocast_enabled covers both
    # device types, not every one: an MPS tensor takes the context's own check).
    plain = first is not None and (first.is_cuda or first.is_cpu) and not torch._C._is_any_autocast_enabled()
    if plain:
        return _run_on_device(backend, args, first)
    with autocast_off(first.device.type if first is not None else "cpu"):
        return _run_on_device(backend, args, first)


def _run_on_device(backend: Backend, args: Sequence, first: torch.Tensor | None):
    triton_gpu = backend.name == "triton" and first is not None and first.is_cuda
    if triton_gpu and first.get_device() != torch.cuda.current_device():
        with torch.cuda.device(first.device):
            return backend.run(*args)
    return backend.run(*args)
