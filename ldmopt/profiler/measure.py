"""``profile``: run a model, pipeline or function under torch.profiler and classify its time by operator category.

On a GPU the classified time is CUDA kernel time (each kernel attributed to the operator that launched it, or
classified by its name when no operator did); on CPU it is the self CPU time of the operators (host overhead outside
operators is reported apart). Attention is split into spatial self / cross / temporal with ``record_function`` scopes
opened by forward hooks on every diffusers attention module; backward operators inherit the scope of their forward
operator through the autograd sequence number.
"""

from __future__ import annotations

import inspect
import os
import re
import shutil
import socket
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from . import _kineto_log
from . import categories as C
from .scopes import ATTENTION_SCOPE, MODULE_SCOPE, NORM_SCOPE, ModuleScopes
from .settings import check_setting, positive, refuse_setting_with_inputs

_OP_NAME = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)::[A-Za-z_]")
_NOT_OPS = {"autograd", "profiler"}
_BACKWARD_NODE = "autograd::engine::evaluate_function"
#: record_function range around each fetch from ``data``: its time is data_wait_s, its operators are not the model's
DATA_SCOPE = "ldmopt.dataloader"


@dataclass
class CategoryTime:
    time_us: float = 0.0
    count: int = 0
    top: dict[str, list[float]] = field(default_factory=dict)  # kernel/op name -> [time_us, count]

    def add(self, name: str, time_us: float, call: bool = True) -> None:
        """``call``: the event is a call of its own (a kernel, an operator called from Python), not an operator
        another one called inside it (counted in ``top`` by its name, not as a call of the category)."""
        self.time_us += time_us
        self.count += call
        slot = self.top.setdefault(name, [0.0, 0])
        slot[0] += time_us
        slot[1] += 1


@dataclass
class Profile:
    """Measured breakdown of the active steps. ``time_kind`` says what was measured (CUDA or CPU time)."""

    device: str
    time_kind: str
    mode: str  # "inference" or "training"
    steps: int
    categories: dict[str, CategoryTime]
    launches: int  # GPU: kernel launches; CPU: operator calls (not those an operator makes inside it)
    wall_s: float  # wall time of the active steps
    host_overhead_s: float = 0.0  # CPU runs: wall time outside operators
    data_wait_s: float = 0.0  # training with a data iterable: time spent fetching batches
    trace_path: str | None = None
    tensorboard_dir: str | None = None
    notes: list[str] = field(default_factory=list)
    #: What ran: the model (zoo name or class, tiny, patched), its inputs' setting where known, its dtype.
    setting: str = ""
    _prof: Any = field(default=None, repr=False)

    @property
    def total_us(self) -> float:
        return sum(c.time_us for c in self.categories.values())

    def shares(self) -> dict[str, float]:
        total = self.total_us
        return {k: (c.time_us / total if total else 0.0) for k, c in self.categories.items()}

    def classified_share(self) -> float:
        """Fraction of the time in named categories (not "other", not unattributed attention)."""
        shares = self.shares()
        return 1.0 - shares[C.OTHER] - shares[C.ATTN_UNATTRIBUTED]

    def attention_split(self) -> dict[str, float]:
        total = sum(self.categories[c].time_us for c in C.ATTENTION)
        return {c.split(".")[1]: (self.categories[c].time_us / total if total else 0.0) for c in C.ATTENTION}

    def top(self, category: str, n: int = 5) -> list[tuple[str, float, int]]:
        """The ``n`` kernels (GPU) or operators (CPU) with most time in ``category``: (name, time_us, count)."""
        items = sorted(self.categories[category].top.items(), key=lambda kv: -kv[1][0])
        return [(name, t, int(cnt)) for name, (t, cnt) in items[:n]]

    def export_chrome_trace(self, path: str) -> str:
        if self._prof is None:
            raise RuntimeError("this Profile holds no profiler session to export")
        return _save_trace(self._prof, path)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": f"measured ({self.time_kind} on {self.device})",
            "setting": self.setting,
            "device": self.device,
            "time_kind": self.time_kind,
            "mode": self.mode,
            "steps": self.steps,
            "total_us": self.total_us,
            "per_step_us": self.total_us / max(self.steps, 1),
            "launches": self.launches,
            "wall_s": self.wall_s,
            "host_overhead_s": self.host_overhead_s,
            "data_wait_s": self.data_wait_s,
            "classified_share": self.classified_share(),
            "categories": {
                k: {"label": C.LABELS[k], "time_us": c.time_us, "count": c.count, "share": s, "top": self.top(k)}
                for (k, c), s in zip(self.categories.items(), self.shares().values())
            },
            "attention_split": self.attention_split(),
            "trace_path": self.trace_path,
            "tensorboard_dir": self.tensorboard_dir,
            "notes": self.notes,
        }

    def table(self, top: int = 3) -> str:
        from .report import format_profile

        return format_profile(self, top=top)

    def __str__(self) -> str:
        return self.table()


def check_device(device: str | torch.device | None) -> str | torch.device | None:
    """``device`` unchanged if it names a torch device this machine has; ValueError saying why not otherwise."""
    if device is None:
        return None
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device {str(device)!r} is not a torch device (cpu, cuda, cuda:1, ...)") from exc
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r}: no CUDA GPU is available here (use cpu)")
    if kind == "meta":
        raise ValueError(_meta_refusal(f"device {str(device)!r}"))
    return device


def _meta_refusal(what: str) -> str:
    return (
        f"{what}: profile measures real execution, and meta tensors compute nothing (their time would be dispatcher "
        "overhead); profile on cpu or cuda, or count FLOPs and project the time on meta with ldmopt.analyze "
        "(ldmopt analyze)"
    )


def _save_trace(prof, path: str) -> str:
    """Kineto saves a session once; later requests copy the first file."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    first = getattr(prof, "_ldmopt_trace", None)
    if first is None:
        prof.export_chrome_trace(path)
        # Kineto only logs a failure to open the file (on stderr) and returns normally.
        if not os.path.isfile(path):
            raise OSError(f"torch.profiler did not write the Chrome trace {path!r} (see its error above)")
        prof._ldmopt_trace = path
    elif os.path.abspath(first) != os.path.abspath(path):
        shutil.copyfile(first, path)
    return path


# ---------------------------------------------------------------------------------------------- classification


def _op_namespace(name: str) -> str | None:
    m = _OP_NAME.match(name)
    return m.group(1) if m and m.group(1) not in _NOT_OPS else None


def _chain(evt):
    while evt is not None:
        yield evt
        evt = evt.cpu_parent


def _scope_of(evt, forward_scopes: dict[int, str]) -> str | None:
    for e in _chain(evt):
        if e.name.startswith((ATTENTION_SCOPE, NORM_SCOPE, MODULE_SCOPE)):  # the innermost scope speaks
            return e.name
        if e.name.startswith(_BACKWARD_NODE) and e.sequence_nr >= 0:
            return forward_scopes.get(e.sequence_nr)
    return None


#: Kernels that only convert a tensor's layout, whichever operator launched them (the studies' "layout conversions").
_LAYOUT_KERNEL = re.compile(r"nchwToNhwc|nhwcToNchw", re.I)


def _classify(evt, forward_scopes: dict[int, str]) -> str:
    outermost = None
    for e in _chain(evt):
        namespace = _op_namespace(e.name)
        if namespace == "ldmopt":
            return C.ldmopt_category(e.name)
        if namespace is not None:
            outermost = e.name
    if outermost is None:
        return C.OTHER
    scope = _scope_of(evt, forward_scopes)
    kind = scope[len(ATTENTION_SCOPE) :].split("::")[0] if scope and scope.startswith(ATTENTION_SCOPE) else None
    return C.classify_op(outermost, attention_kind=kind, in_norm=bool(scope and scope.startswith(NORM_SCOPE)))


def _forward_scopes(events) -> dict[int, str]:
    """sequence_nr of each forward operator run inside a scope -> that scope (for its backward)."""
    scopes: dict[int, str] = {}
    for e in events:
        if e.sequence_nr >= 0 and _op_namespace(e.name) and e.sequence_nr not in scopes:
            scope = _scope_of(e, {})
            if scope is not None:
                scopes[e.sequence_nr] = scope
    return scopes


def _in_data_fetch(evt) -> bool:
    return any(e.name == DATA_SCOPE for e in _chain(evt))


def _is_annotation(evt) -> bool:
    """GPU-timeline copies of record_function ranges (gpu_user_annotation) span kernels; they are not kernels."""
    return bool(getattr(evt, "is_user_annotation", False)) or "annotation" in str(getattr(evt, "activity_type", ""))


def classify_events(events, on_gpu: bool, ldmopt_kernels: frozenset[str] = frozenset()):
    """(categories, launches) from a torch.profiler event list. Work inside a batch fetch from ``data`` (collate,
    augmentation, host-to-device copies) is left out: it is reported as data_wait_s, not as the model's."""
    from torch.autograd import DeviceType

    cats = {c: CategoryTime() for c in C.CATEGORIES}
    forward_scopes = _forward_scopes(events)
    ops = [e for e in events if e.device_type == DeviceType.CPU and _op_namespace(e.name)]
    data_ops = {e.id for e in ops if _in_data_fetch(e)}
    cpu_ops = [e for e in ops if e.id not in data_ops]
    launches = 0
    if on_gpu:
        by_id = {e.id: e for e in cpu_ops}
        for e in events:
            if e.device_type != DeviceType.CUDA or _is_annotation(e):
                continue
            link = getattr(e, "linked_correlation_id", 0)
            if link and link in data_ops:  # e.g. the batch's host-to-device copy
                continue
            launches += 1
            op = by_id.get(link)
            if op is None:  # CUDA graphs, compiled regions: only the kernel name is known
                cat = C.classify_kernel(e.name, ldmopt_kernels)
            elif _LAYOUT_KERNEL.search(e.name):  # cuDNN's own layout transforms inside aten::cudnn_convolution
                cat = C.LAYOUT
            else:
                cat = C.ldmopt_category(e.name) if e.name in ldmopt_kernels else _classify(op, forward_scopes)
            cats[cat].add(e.name, e.time_range.elapsed_us())
    else:
        for e in cpu_ops:  # self time of every operator; a call is one no other operator called
            outermost = not any(_op_namespace(parent.name) for parent in _chain(e.cpu_parent))
            launches += outermost
            cats[_classify(e, forward_scopes)].add(e.name, e.self_cpu_time_total, outermost)
    return cats, launches


# ---------------------------------------------------------------------------------------------- running


def _call(target, inputs):
    from .. import configs

    if isinstance(inputs, configs.ModelInputs):
        return configs.run_model(target, inputs)
    if inputs is None:
        return target()
    if isinstance(inputs, dict):
        return target(**inputs)
    if isinstance(inputs, (tuple, list)):
        return target(*inputs)
    return target(inputs)


def _first_tensor(out) -> torch.Tensor:
    from torch.utils._pytree import tree_flatten

    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    for leaf in tree_flatten(out)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            return leaf
    raise ValueError("training mode needs a floating-point tensor output to build a loss (or pass loss_fn)")


def _modules_of(target) -> dict[str, nn.Module]:
    if isinstance(target, nn.Module):
        return {"": target}
    components = getattr(target, "components", None)
    if isinstance(components, dict):
        return {k: v for k, v in components.items() if isinstance(v, nn.Module)}
    owner = getattr(target, "__self__", None)
    return {"": owner} if isinstance(owner, nn.Module) else {}


def _resolve_target(target, *, device, dtype, tiny, resolution, frames, batch, inputs):
    from .. import configs

    refuse_setting_with_inputs(inputs, resolution=resolution, frames=frames, batch=batch)
    if not isinstance(target, str):
        _refuse_zoo_settings(target, dtype=dtype, tiny=tiny, resolution=resolution, frames=frames, batch=batch)
        if inputs is None and isinstance(target, nn.Module) and hasattr(target, "ldmopt_zoo_name"):
            check_setting(target, resolution=resolution, frames=frames, batch=batch)
            inputs = configs.example_inputs(target, resolution=resolution, frames=frames, batch=batch)
        return target, inputs
    if inputs is None:
        check_setting(target, resolution=resolution, frames=frames, batch=batch, tiny=tiny)
    device = check_device(device) or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtype or (torch.float16 if str(device).startswith("cuda") else torch.float32)
    model = configs.build_model(target, device=device, dtype=dtype, tiny=tiny, frames=frames)
    if inputs is None:
        inputs = configs.example_inputs(model, resolution=resolution, frames=frames, batch=batch)
    return model, inputs


def _refuse_zoo_settings(target, **settings) -> None:
    """Settings only a zoo name uses, given (not at profile()'s default) with a module or callable, which runs as it
    is: a ValueError naming them. A model from configs.build_model also takes resolution/frames/batch (its example
    inputs are made at that setting)."""
    defaults = {name: p.default for name, p in inspect.signature(profile).parameters.items()}
    if isinstance(target, nn.Module) and hasattr(target, "ldmopt_zoo_name"):
        settings = {name: settings[name] for name in ("dtype", "tiny")}
    ignored = {name: value for name, value in settings.items() if value != defaults[name]}
    if ignored:
        args = ", ".join(f"{name}={value!r}" for name, value in ignored.items())
        raise ValueError(
            f"{args} with a {type(target).__name__} target would be ignored: a module or callable runs as it is; "
            "only a zoo name is built in dtype/tiny and given example inputs at resolution/frames/batch (a model "
            f"from configs.build_model takes those three too); drop {'it' if len(ignored) == 1 else 'them'} (cast or "
            "move the model yourself and pass inputs at the setting you want; device= picks where time is measured)"
        )


def _device_of(target, inputs, modules, device) -> str:
    """Where the work runs: ``device`` if given, else the parameters of the hooked modules, else the inputs."""
    from torch.utils._pytree import tree_flatten

    if device is not None:
        return torch.device(device).type
    roots = _modules_of(target) if modules is None else _modules_of(modules)
    for module in roots.values():
        for p in module.parameters():
            return p.device.type
    leaves = tree_flatten(getattr(inputs, "kwargs", inputs))[0]
    return next((x.device.type for x in leaves if isinstance(x, torch.Tensor)), "cpu")


def describe_setting(name: str | None, target, inputs) -> str:
    """'sd15 (tiny, patched), 64x64, 4 frames, batch 2, float16': what a profile ran, for its header and JSON."""
    from .. import configs
    from ..patch.core import is_patched

    roots = _modules_of(target)
    module = target if isinstance(target, nn.Module) else None
    if name is None and module is not None:
        name = getattr(module, "ldmopt_zoo_name", None) or type(module).__name__
    elif name is None:  # a pipeline by its class, a function by its name
        name = type(target).__name__ if hasattr(target, "components") else getattr(target, "__qualname__", None)
    label = name or type(target).__name__
    patched = (module is not None or hasattr(target, "components")) and is_patched(target)
    flags = [f for f, on in (("tiny", getattr(module, "ldmopt_tiny", False)), ("patched", patched)) if on]
    parts = [label + (f" ({', '.join(flags)})" if flags else "")]
    if isinstance(inputs, configs.ModelInputs):
        if inputs.resolution:
            parts.append("x".join(map(str, inputs.resolution)))
        if inputs.frames:
            parts.append(f"{inputs.frames} frames")
        if inputs.batch:
            parts.append(f"batch {inputs.batch}")
    dtypes = {p.dtype for root in roots.values() for p in root.parameters() if p.is_floating_point()}
    if dtypes:
        parts.append("/".join(sorted(str(d).removeprefix("torch.") for d in dtypes)))
    return ", ".join(parts)


def profile(
    target: nn.Module | Callable | str,
    *,
    inputs: Any = None,
    steps: int = 3,
    warmup: int = 1,
    wait: int | None = None,
    training: bool = False,
    optimizer: torch.optim.Optimizer | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    data: Iterable | None = None,
    modules: nn.Module | dict[str, nn.Module] | None = None,
    scopes: bool = True,
    trace: str | None = None,
    tensorboard: str | None = None,
    wandb: bool | str | dict | None = None,
    record_shapes: bool = False,
    device: str | None = None,
    dtype: torch.dtype | None = None,
    tiny: bool = False,
    resolution: int | tuple[int, int] | None = None,
    frames: int | None = None,
    batch: int | None = None,
) -> Profile:
    """Profile ``steps`` calls of ``target`` after ``wait`` + ``warmup`` unrecorded ones and classify the time.

    ``target``: an ``nn.Module`` (called with ``inputs``: ``configs.ModelInputs``, kwargs dict, args tuple or one
    tensor; zoo models built by ``configs.build_model`` default to ``configs.example_inputs``), a diffusers
    pipeline (``pipe(**inputs)``, hooks on all its module components), any callable (``fn(**inputs)``/``fn()``), or
    a zoo name (built with random weights on ``device``; ``tiny=True`` for the tiny variant). ``modules`` are the
    modules to hook for attention scopes when ``target`` is a plain callable (a module or a name -> module dict).
    CUDA kernel time is measured when ``device`` is CUDA, or else when the hooked modules' parameters (or the
    inputs) are on a CUDA device.

    ``training=True`` runs forward + backward + optimizer step per step (AdamW if no ``optimizer``; loss is
    ``loss_fn(output)`` or the mean square of the first output tensor); for a plain callable the callable is the
    whole step and ``training`` only labels the run. ``data`` is an iterable of inputs drawn once per step, whose
    fetch time is reported as data-loading stalls. The schedule is torch.profiler's
    wait/warmup/active; ``wait`` defaults to 1 in training (as in the studies) and 0 otherwise.

    ``trace`` writes a Chrome trace; ``tensorboard`` a log directory (profiler trace + scalar event files);
    ``wandb`` logs the breakdown to Weights & Biases (True, a project name or ``wandb.init`` kwargs).
    """
    from .logging import check_logging_available, log_profile

    check_logging_available(tensorboard=tensorboard, wandb=wandb)
    positive("steps", steps)
    for name, value in (("warmup", warmup), ("wait", wait)):
        if value is not None and (not isinstance(value, int) or value < 0):
            raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    if trace:  # before the run, so a path that cannot be written fails first
        if os.path.isdir(trace):
            raise ValueError(f"trace {trace!r} is a folder; give a file name such as {os.path.join(trace, 't.json')}")
        os.makedirs(os.path.dirname(os.path.abspath(trace)), exist_ok=True)
    named = target if isinstance(target, str) else None
    target, inputs = _resolve_target(target, device=device, dtype=dtype, tiny=tiny, resolution=resolution,
                                     frames=frames, batch=batch, inputs=inputs)  # fmt: skip
    wait = (1 if training else 0) if wait is None else wait
    where = _device_of(target, inputs, modules, check_device(device))
    if where == "meta":
        raise ValueError(_meta_refusal("the model's parameters (or the inputs) are on the meta device"))
    on_gpu = where == "cuda" and torch.cuda.is_available()
    hooked = _modules_of(target) if modules is None else modules
    modes = {m: m.training for root in _modules_of(target).values() for m in root.modules()}
    step_fn = _make_step(target, inputs, training, optimizer, loss_fn, data, (wait, warmup, steps))

    activities = [torch.profiler.ProfilerActivity.CPU]
    if on_gpu:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    captured: dict[str, Any] = {}

    def on_ready(prof):
        captured["events"] = prof.events()
        if trace:
            _save_trace(prof, trace)
        if tensorboard:
            # The profiler plugin's naming: <worker>.<ms>.pt.trace.json in the log directory.
            os.makedirs(tensorboard, exist_ok=True)
            name = f"{socket.gethostname()}_{os.getpid()}.{int(time.time() * 1000)}.pt.trace.json"
            _save_trace(prof, os.path.join(tensorboard, name))

    with warnings.catch_warnings():  # warmup=0 is the caller's choice (one-shot runs), not worth torch's warning
        warnings.filterwarnings("ignore", message="Profiler won't be using warmup")
        schedule = torch.profiler.schedule(wait=wait, warmup=warmup, active=steps, repeat=1)
    wall = data_wait = 0.0
    scope_ctx = ModuleScopes(hooked, annotate=True) if scopes and hooked else None
    profiler = torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=on_ready,
                                      record_shapes=record_shapes)  # fmt: skip
    with _kineto_log.filtered(), profiler as prof:
        if scope_ctx is not None:
            scope_ctx.__enter__()
        try:
            for i in range(wait + warmup + steps):
                start = time.perf_counter()
                fetch = step_fn()
                if on_gpu:
                    torch.cuda.synchronize()
                if i >= wait + warmup:
                    wall += time.perf_counter() - start
                    data_wait += fetch
                prof.step()
        finally:
            if scope_ctx is not None:
                scope_ctx.__exit__(None, None, None)
            for module, was_training in modes.items():  # training mode switched to train(); restore
                module.training = was_training

    from .categories import ldmopt_kernel_names

    cats, launches = classify_events(
        captured.get("events", []), on_gpu, ldmopt_kernel_names() if on_gpu else frozenset()
    )
    result = Profile(
        device="cuda" if on_gpu else "cpu",
        time_kind="CUDA kernel time" if on_gpu else "CPU operator self time",
        mode="training" if training else "inference",
        steps=steps,
        categories=cats,
        launches=launches,
        wall_s=wall,
        data_wait_s=data_wait,
        trace_path=trace,
        tensorboard_dir=tensorboard,
        setting=describe_setting(named, target, inputs),
        _prof=prof,
    )
    if not on_gpu:
        result.host_overhead_s = max(0.0, wall - data_wait - result.total_us / 1e6)  # the fetch's ops are not in total
        result.notes.append("measured on CPU: CPU operator time, not GPU kernel time; shares differ from a GPU run")
    if not scopes or not hooked:
        result.notes.append("no attention scopes: attention time is unattributed (pass modules= for a callable)")
    log_profile(result, tensorboard=tensorboard, wandb=wandb)
    return result


def _make_step(
    target, inputs, training, optimizer, loss_fn, data, schedule: tuple[int, int, int]
) -> Callable[[], float]:
    """A closure running one step and returning the seconds spent waiting for data (a batch per step of
    ``schedule``: wait, warmup, steps)."""
    batches_needed = sum(schedule)

    def too_short(yielded: int) -> ValueError:
        counts = " + ".join(map(str, schedule))
        return ValueError(
            f"data yielded {yielded} batches; profile draws one per step and needs wait + warmup + steps = {counts} "
            f"= {batches_needed}: pass more batches (or an endless iterable), or lower steps/warmup/wait"
        )

    if data is not None and hasattr(data, "__len__") and len(data) < batches_needed:
        raise too_short(len(data))  # before anything runs
    iterator = iter(data) if data is not None else None
    fetched = 0
    params: list[nn.Parameter] = []
    if training:
        modules = _modules_of(target)
        if not isinstance(target, nn.Module) and isinstance(getattr(target, "components", None), dict):
            # A diffusers pipeline's __call__ runs under torch.no_grad: its output has no graph to differentiate.
            raise ValueError(
                f"training=True: {type(target).__name__} is a pipeline, whose call runs without gradients, so no "
                "backward could follow; profile its denoiser (e.g. pipe.unet or pipe.transformer, with inputs) for a "
                "training step, or pass a callable that runs your own training step"
            )
        params = [p for module in modules.values() for p in module.parameters() if p.requires_grad]
        if modules and not params:
            # Refused as analyze(training=True) refuses it: a profile labelled "training" would hold a forward only.
            raise ValueError(
                f"training=True: {type(target).__name__} has no parameter that requires a gradient, so no backward "
                "or optimizer step would run, only the forward; unfreeze some (requires_grad_(True)), or profile "
                "with training=False (a callable that runs its own training step is profiled as it is)"
            )
        for module in modules.values():
            module.train()
        if optimizer is None and params:
            optimizer = torch.optim.AdamW(params, lr=1e-5)

    def step() -> float:
        nonlocal fetched
        waited = 0.0
        batch_inputs = inputs
        if iterator is not None:
            start = time.perf_counter()
            with torch.profiler.record_function(DATA_SCOPE):
                try:
                    batch_inputs = next(iterator)
                except StopIteration:
                    raise too_short(fetched) from None
            fetched += 1
            waited = time.perf_counter() - start
        if not training:
            with torch.no_grad():  # as diffusers pipelines run: inference tensors would hand no statistics over
                _call(target, batch_inputs)
            return waited
        out = _call(target, batch_inputs)
        if params:
            loss = loss_fn(out) if loss_fn is not None else _first_tensor(out).float().pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return waited

    return step
