"""How ``ldmopt.tune`` times the sites of a model while the caller's ``run()`` executes (ldmopt/patch/tune.py).

Each site is timed at its *targets*: the site module itself, or, for a site whose rules only swap children (a
GroupNorm + SiLU head keyed on a whole UNet or VAE decoder), the swapped child slots, so that the rest of the parent's
work does not drown the difference. A forward pre-hook and a forward hook on each target module stamp the start and
end of every call: a CUDA event on the current stream of the device its input tensors are on (what the call adds to
that stream's timeline, host time included where the host falls behind), ``time.perf_counter`` for CPU work. So the
timer follows the work to wherever it runs: a model offloaded to the CPU between calls, or one on ``cuda:1``.

With ``cuda_graph=True`` each configuration is captured as a CUDA graph with its site events as graph nodes
(``torch.cuda.Event(external=True)``) and replayed: GPU time only, as a model captured for deployment runs.

A site's time is exclusive: a call's time is taken off the site open around it at run time (not by module names),
so nesting across components, or modules called from outside their parent, count where they ran. Sites in ``whole``
(run within an enclosing site's fused forward; see ``tune._tune``) keep their time in the site around them, and
what runs inside them is taken off that site instead, so every configuration compares the same work.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..graphs import capture_graph
from ..nn.child_check import observer

#: (model label, module name) of a site
SiteKey = tuple[str, str]


def work_device(module: nn.Module, args: tuple, kwargs: dict) -> torch.device:
    """Where a call of ``module`` runs: the device of its first argument that has one (a tensor, or an object that
    stands for one, such as the NormedInput a fused transformer block hands its feed-forward), else of its first
    parameter or buffer (its children's too: FusedGEGLU keeps its weight in ``.proj``), else the CPU."""
    for value in (*args, *kwargs.values()):
        device = getattr(value, "device", None)
        if isinstance(device, torch.device):
            return device
    for tensor in (*module.parameters(), *module.buffers()):
        return tensor.device
    return torch.device("cpu")


class SiteTimer:
    """Hooks on the site targets (``targets``: site -> modules now at its target names), accumulating each site's
    exclusive time over one ``run()`` call; a context manager that removes every hook on exit."""

    def __init__(
        self, targets: dict[SiteKey, list[nn.Module]], whole: frozenset[SiteKey], *, in_graph: bool = False
    ) -> None:
        self.targets = targets
        self.whole = whole
        self.in_graph = in_graph  # events become nodes of a CUDA graph being captured, re-recorded at each replay
        self.cuda_devices: set[torch.device] = set()  # every CUDA device a stamp was taken on
        self.cpu_stamps = False
        self._stack: list[tuple[SiteKey, int, SiteKey | None, Any, torch.device, nn.Module]] = []
        self._spans: list[tuple[SiteKey, int, SiteKey | None, Any, Any]] = []
        self._handles: list[Any] = []

    def _stamp(self, device: torch.device) -> Any:
        if device.type == "cuda":
            self.cuda_devices.add(device)
            event = torch.cuda.Event(enable_timing=True, external=self.in_graph)
            event.record(torch.cuda.current_stream(device))
            return event
        self.cpu_stamps = True
        return time.perf_counter()

    def _charged(self, module: nn.Module, key: SiteKey) -> SiteKey | None:
        """The site whose exclusive time a call of ``module`` for site ``key`` opened now is taken off: the innermost
        open site not in ``whole`` (its own site, for a target inside another target of the same site: counted once).
        None when another site that targets the same module has just opened this very call: that site's span is
        taken off the site around them, once, and each site times the call in full."""
        if self._stack and self._stack[-1][5] is module and self._stack[-1][0] != key:
            return None
        for open_key, *_ in reversed(self._stack):
            if open_key not in self.whole:
                return open_key
        return None

    def __enter__(self) -> SiteTimer:
        for key, modules in self.targets.items():
            for index, module in enumerate(modules):

                def pre(module, args, kwargs, key=key, index=index):
                    device = work_device(module, args, kwargs)
                    self._stack.append((key, index, self._charged(module, key), self._stamp(device), device, module))

                def post(module, args, kwargs, output, key=key, index=index):
                    for depth in range(len(self._stack) - 1, -1, -1):  # the innermost open call of this target
                        open_key, open_index, charged, start, device, _ = self._stack[depth]
                        if (open_key, open_index) == (key, index):
                            # Calls opened above it and not closed are dropped, but for the same call that other
                            # sites targeting this module opened after it: their own post hooks close them next.
                            same_call = [e for e in self._stack[depth + 1 :] if e[5] is module and e[0] != key]
                            self._stack[depth:] = same_call
                            self._spans.append((key, index, charged, start, self._stamp(device)))
                            return

                # observers: a fused path never treats them as foreign hooks (ldmopt.nn.child_check); always_call:
                # a forward that raises (and is caught) closes its call too
                self._handles.append(module.register_forward_pre_hook(observer(pre), with_kwargs=True))
                self._handles.append(module.register_forward_hook(observer(post), with_kwargs=True, always_call=True))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def reset(self) -> None:
        self._stack.clear()
        self._spans.clear()

    def collect(self) -> tuple[dict[SiteKey, float], dict[SiteKey, int]]:
        """(exclusive seconds, calls) of each site since :meth:`reset`; call once the devices finished."""
        exclusive: dict[SiteKey, float] = dict.fromkeys(self.targets, 0.0)
        per_target: dict[tuple[SiteKey, int], int] = defaultdict(int)
        for key, index, charged, start, end in self._spans:
            seconds = end - start if isinstance(start, float) else start.elapsed_time(end) / 1e3
            exclusive[key] += seconds
            per_target[key, index] += 1
            if charged is not None and key not in self.whole:
                exclusive[charged] -= seconds
        calls = {key: max((per_target[key, i] for i in range(len(m))), default=0) for key, m in self.targets.items()}
        return {key: max(value, 0.0) for key, value in exclusive.items()}, calls


def synchronize(devices: set[torch.device]) -> None:
    for device in devices:
        torch.cuda.synchronize(device)


@dataclass
class Measurement:
    site_s: dict[SiteKey, float]  # median exclusive seconds per run() call
    calls: dict[SiteKey, int]
    wall_s: float  # median seconds of a run() call, hooks attached
    cuda: bool  # some site ran on a GPU (timed by CUDA events)
    cpu: bool  # some site ran on the CPU (timed by perf_counter)


def measure(
    run: Callable[[], Any],
    targets: dict[SiteKey, list[nn.Module]],
    devices: set[torch.device],
    *,
    warmup: int,
    repeats: int,
    whole: frozenset[SiteKey],
) -> Measurement:
    """Times ``run()`` and each site in it: ``warmup`` calls, then the medians of ``repeats``. ``devices``: the CUDA
    devices to wait for around a timed call (those of the model's parameters); the timer adds those it stamps on."""
    with SiteTimer(targets, whole) as timer:
        for _ in range(warmup):
            run()
        site_s, calls, wall_s = _repeat(run, timer, devices, repeats, reset=True)
    devices |= timer.cuda_devices
    return Measurement(site_s, calls, wall_s, bool(timer.cuda_devices), timer.cpu_stamps)


def _repeat(
    call: Callable[[], Any], timer: SiteTimer, devices: set[torch.device], repeats: int, *, reset: bool
) -> tuple[dict[SiteKey, float], dict[SiteKey, int], float]:
    """(median exclusive seconds per site, calls per site, median seconds per call) over ``repeats`` timed calls;
    ``reset``: the timer's spans are each call's own (a graph replay re-records the spans of its capture)."""
    per_site: dict[SiteKey, list[float]] = {key: [] for key in timer.targets}
    walls: list[float] = []
    calls: dict[SiteKey, int] = {}
    for _ in range(repeats):
        if reset:
            timer.reset()
        synchronize(devices | timer.cuda_devices)
        start = time.perf_counter()
        call()
        synchronize(devices | timer.cuda_devices)
        walls.append(time.perf_counter() - start)
        seconds, calls = timer.collect()
        for key, value in seconds.items():
            per_site[key].append(value)
    return {key: statistics.median(v) for key, v in per_site.items()}, calls, statistics.median(walls)


def _only(devices: set[torch.device]) -> torch.device:
    """The one GPU a CUDA graph is captured on (tune checks that the model's parameters are on exactly one)."""
    if len(devices) != 1:
        raise ValueError(f"a CUDA graph is captured on one GPU; the model is on {sorted(map(str, devices))}")
    return next(iter(devices))


def wall_time(
    run: Callable[[], Any], devices: set[torch.device], *, warmup: int, repeats: int, graph: bool = False
) -> float:
    """Median seconds of a ``run()`` call without any hook (the whole-call comparison); ``graph``: of a replay of
    ``run()`` captured as a CUDA graph."""
    call = capture(run, warmup, _only(devices)) if graph else run
    for _ in range(0 if graph else warmup):
        run()
    walls = []
    for _ in range(repeats):
        waited = _waited_on(devices)
        synchronize(waited)
        start = time.perf_counter()
        call()
        synchronize(waited | _waited_on(devices))
        walls.append(time.perf_counter() - start)
    return statistics.median(walls)


def _waited_on(devices: set[torch.device]) -> set[torch.device]:
    """``devices``; with none (the parameters were on the CPU when tune began: a model offloaded to the CPU between
    calls, whose hooks move it to a GPU to run), every GPU once CUDA is in use, or the timing would end at the last
    launch instead of the last kernel."""
    if devices or not torch.cuda.is_initialized():
        return devices
    return {torch.device("cuda", i) for i in range(torch.cuda.device_count())}


def capture(
    run: Callable[[], Any],
    warmup: int,
    device: torch.device,
    before_capture: Callable[[], None] | None = None,
) -> Callable[[], Any]:
    """``run()`` captured as a CUDA graph on ``device`` (:func:`ldmopt.graphs.capture_graph`, the procedure of
    benchmarks/harness.py's cuda_graphed, whose rows were measured on an H200); returns its replay, replayed once."""
    graph, _ = capture_graph(run, warmup, device, before_capture=before_capture)
    return graph.replay


def measure_graphed(
    run: Callable[[], Any],
    targets: dict[SiteKey, list[nn.Module]],
    devices: set[torch.device],
    *,
    warmup: int,
    repeats: int,
    whole: frozenset[SiteKey],
) -> Measurement:
    """As :func:`measure`, of ``run()`` captured as a CUDA graph: the site hooks fire once, while it is captured,
    and their events are nodes of the graph that each replay records again. GPU time only: no host time at all."""
    with SiteTimer(targets, whole, in_graph=True) as timer:
        device = _only(devices)
        replay = capture(run, warmup, device, before_capture=timer.reset)  # the spans are the captured calls'
        if timer.cpu_stamps or timer.cuda_devices - {device}:
            raise ValueError(
                f"ldmopt.tune(cuda_graph=True): a site ran off {device} while run() was captured there; a CUDA graph "
                "holds the work of one GPU (put the model and its inputs on it, or tune with cuda_graph=False)"
            )
        site_s, calls, wall_s = _repeat(replay, timer, devices, repeats, reset=False)
    devices |= timer.cuda_devices
    return Measurement(site_s, calls, wall_s, True, False)
