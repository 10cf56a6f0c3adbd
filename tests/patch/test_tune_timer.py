"""ldmopt.tune's timer: per-site times from module hooks (a fake clock and fake CUDA events), whole calls, CUDA-graph
capture and replay, and one end-to-end run of the real timer."""

from __future__ import annotations

import contextlib
import importlib

import pytest
import torch
from torch import nn

import ldmopt
from tests.support.cuda_graph_api import mock_cuda_graph_api

from .helpers import assert_outputs_close, output_tensor
from .test_tune import _fake_measure, _fused_faster_for, _patched_keys, _run, _unet, tune_module, tune_timer


class _Clock:
    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


class _Costly(nn.Module):
    def __init__(self, clock, seconds, *inner):
        super().__init__()
        self.clock, self.seconds, self.inner = clock, seconds, nn.ModuleList(inner)

    def forward(self, x):
        self.clock.now += self.seconds
        for module in self.inner:
            x = module(x)
        return x


def _toy(clock):
    """outer (5 s of its own) around mid (4 s) around inner (3 s); keys are their names."""
    inner = _Costly(clock, 3.0)
    mid = _Costly(clock, 4.0, inner)
    outer = _Costly(clock, 5.0, mid)
    return outer, {("", "outer"): [outer], ("", "mid"): [mid], ("", "inner"): [inner]}


def test_site_times_exclude_what_ran_inside_them(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(tune_timer, "time", clock)
    outer, targets = _toy(clock)
    runs = []

    def run():
        runs.append(1)
        outer(torch.ones(1))
        clock.now += 100.0  # outside every site

    measured = tune_timer.measure(run, targets, set(), warmup=2, repeats=3, whole=frozenset())
    assert len(runs) == 5
    assert measured.site_s == {("", "outer"): 5.0, ("", "mid"): 4.0, ("", "inner"): 3.0}
    assert measured.calls == dict.fromkeys(targets, 1) and measured.wall_s == 112.0
    assert measured.cpu and not measured.cuda
    # mid runs within outer's fused forward: its time stays in outer's, and inner's is taken off outer
    whole = tune_timer.measure(run, targets, set(), warmup=0, repeats=1, whole=frozenset({("", "mid")}))
    assert whole.site_s == {("", "outer"): 9.0, ("", "mid"): 7.0, ("", "inner"): 3.0}
    assert not any(m._forward_hooks or m._forward_pre_hooks for ms in targets.values() for m in ms), "hooks removed"


def test_a_site_timed_at_several_slots_sums_them(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(tune_timer, "time", clock)
    norm, act = _Costly(clock, 2.0), _Costly(clock, 1.0)
    parent = _Costly(clock, 10.0, norm, act)
    targets = {("", ""): [norm, act]}  # a child-swap site: its slots, not the parent's own 10 s
    measured = tune_timer.measure(lambda: parent(torch.ones(1)), targets, set(), warmup=0, repeats=2, whole=frozenset())
    assert measured.site_s == {("", ""): 3.0} and measured.calls == {("", ""): 1}


def test_sites_that_share_a_target_each_time_its_calls_in_full(monkeypatch):
    # Two sites hooked on one module (a slot of a child-swap site that is another site's module too): the second
    # site's call used to be dropped when the first site's post hook closed the stack above it, and its call was
    # taken off the first site as if nested in it.
    clock = _Clock()
    monkeypatch.setattr(tune_timer, "time", clock)
    shared = _Costly(clock, 2.0)
    parent = _Costly(clock, 10.0, shared)
    targets = {("", "a"): [shared], ("", "b"): [shared], ("", "parent"): [parent]}
    measured = tune_timer.measure(lambda: parent(torch.ones(1)), targets, set(), warmup=0, repeats=2, whole=frozenset())
    assert measured.site_s == {("", "a"): 2.0, ("", "b"): 2.0, ("", "parent"): 10.0}
    assert measured.calls == dict.fromkeys(targets, 1)


def test_cuda_timer_uses_events_on_the_device_the_work_is_on(monkeypatch):
    clock = _Clock()
    outer, targets = _toy(clock)
    device = torch.device("cuda", 1)
    streams = []

    class Event:
        def __init__(self, enable_timing=False, external=False):
            assert enable_timing and not external, "eager events are plain timing events"
            self.at = None

        def record(self, stream):
            streams.append(stream)
            self.at = clock.now

        def elapsed_time(self, end):
            return (end.at - self.at) * 1e3  # milliseconds, as CUDA events report

    synchronized = []
    monkeypatch.setattr(tune_timer, "work_device", lambda module, args, kwargs: device)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d: ("stream of", d))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d: synchronized.append(d))
    devices = {torch.device("cuda", 0)}  # where the parameters are: waited for too
    measured = tune_timer.measure(
        lambda: outer(torch.ones(1)), targets, devices, warmup=1, repeats=2, whole=frozenset()
    )
    assert measured.site_s == {("", "outer"): 5.0, ("", "mid"): 4.0, ("", "inner"): 3.0}
    assert measured.cuda and not measured.cpu
    assert set(streams) == {("stream of", device)}
    assert synchronized.count(device) == 4 and synchronized.count(torch.device("cuda", 0)) == 4  # around each call
    assert devices == {torch.device("cuda", 0), device}


def test_whole_calls_of_an_offloaded_model_wait_for_every_gpu(monkeypatch):
    """Parameters on the CPU when tune began (CPU offload: hooks move the model to a GPU per call): the whole-call
    timing waits for the GPUs once CUDA is in use, not just for the host's launches."""
    synchronized, initialized = [], []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d: synchronized.append(d))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: bool(initialized))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    tune_timer.wall_time(lambda: initialized.append(True), set(), warmup=0, repeats=1)  # the call initialises CUDA
    assert sorted(map(str, synchronized)) == ["cuda:0", "cuda:1"]  # after it: both
    synchronized.clear()
    tune_timer.wall_time(lambda: None, set(), warmup=0, repeats=1)
    assert sorted(map(str, synchronized)) == ["cuda:0", "cuda:0", "cuda:1", "cuda:1"]  # before and after
    synchronized.clear()
    tune_timer.wall_time(lambda: None, {torch.device("cuda", 1)}, warmup=0, repeats=1)
    assert synchronized == [torch.device("cuda", 1)] * 2  # the model's own GPU when its parameters are there


def test_work_device_follows_the_inputs():
    from ldmopt.nn.layer_norm_input import NormedInput

    layer = nn.Linear(2, 2)
    assert tune_timer.work_device(layer, (torch.ones(1, 2, device="meta"),), {}) == torch.device("meta")
    assert tune_timer.work_device(layer, (), {"x": torch.ones(1, device="meta")}) == torch.device("meta")
    assert tune_timer.work_device(layer.to("meta"), (), {}) == torch.device("meta")
    assert tune_timer.work_device(nn.Identity(), (3,), {}) == torch.device("cpu")
    # what a fused transformer block hands its feed-forward (observed, not called): a stand-in for a tensor
    normed = NormedInput(nn.LayerNorm(2).to("meta"), torch.ones(1, 2, device="meta"), "block", "norm2")
    assert tune_timer.work_device(nn.Identity(), (normed,), {}) == torch.device("meta")
    # FusedGEGLU keeps its weight in a child (.proj)
    assert tune_timer.work_device(nn.Sequential(nn.Linear(2, 2).to("meta")), ("x",), {}) == torch.device("meta")


def test_a_target_inside_another_of_its_site_counts_once_and_a_raising_call_closes(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(tune_timer, "time", clock)
    inner = _Costly(clock, 3.0)
    outer = _Costly(clock, 5.0, inner)

    class Raising(nn.Module):
        def forward(self, x):
            clock.now += 2.0
            raise RuntimeError("caught by the caller")

    raising, after = Raising(), _Costly(clock, 1.0)

    def run():
        outer(torch.ones(1))
        with contextlib.suppress(RuntimeError):
            raising(torch.ones(1))
        after(torch.ones(1))

    targets = {("", "s"): [outer, inner], ("", "r"): [raising], ("", "a"): [after]}
    measured = tune_timer.measure(run, targets, set(), warmup=0, repeats=1, whole=frozenset())
    assert measured.site_s == {("", "s"): 8.0, ("", "r"): 2.0, ("", "a"): 1.0}


def test_real_timer_end_to_end(monkeypatch):
    """The real measurements on the CPU: with a bar every fused site clears (and the whole call, timed for real,
    counted as faster), tune patches what patch would."""
    unet = _unet()
    run = _run(unet)
    stock_out = output_tensor(run())
    plain = ldmopt.patch(unet)
    ldmopt.unpatch(unet)
    wall_time = tune_module.wall_time

    def tuned_faster(run, devices, *, warmup, repeats, graph=False):
        assert wall_time(run, devices, warmup=warmup, repeats=repeats) > 0
        return 1.0 if ldmopt.is_patched(unet) else 2.0

    monkeypatch.setattr(tune_module, "wall_time", tuned_faster)
    report = ldmopt.tune(unet, run, warmup=1, repeats=1, min_speedup=1e-9)
    tuning = report.tuning
    assert tuning.timer == "time.perf_counter" and not tuning.left_stock
    assert all(s.calls >= 1 and s.stock_ms > 0 and s.kept for s in tuning.sites)
    assert report.counts() == plain.counts() and _patched_keys(unet) == {(s.model, s.name) for s in tuning.sites}
    assert_outputs_close(output_tensor(run()), stock_out)
    ldmopt.unpatch(unet)


def test_cuda_graph_mode_times_the_events_captured_in_the_graph(monkeypatch):
    clock = _Clock()
    outer, targets = _toy(clock)
    device = torch.device("cuda", 0)
    created, replays = [], []

    class Event:
        def __init__(self, enable_timing=False, external=False):
            created.append(external)
            self.at = None

        def record(self, stream):
            self.at = clock.now

        def elapsed_time(self, end):
            return (end.at - self.at) * 1e3

    def fake_capture(run, warmup, on, before_capture=None):
        assert on == device
        for _ in range(max(warmup, 1)):
            run()
        before_capture()
        run()  # captured: the hooks fire once; a replay runs no Python
        return lambda: replays.append(1)

    monkeypatch.setattr(tune_timer, "work_device", lambda module, args, kwargs: device)
    monkeypatch.setattr(tune_timer, "capture", fake_capture)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: "stream")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d: None)
    measured = tune_timer.measure_graphed(
        lambda: outer(torch.ones(1)), targets, {device}, warmup=2, repeats=3, whole=frozenset()
    )
    assert measured.site_s == {("", "outer"): 5.0, ("", "mid"): 4.0, ("", "inner"): 3.0}
    assert measured.calls == dict.fromkeys(targets, 1) and len(replays) == 3
    assert created and all(created), "events recorded while capturing must be graph nodes (external=True)"

    def on_cpu(module, args, kwargs):
        return torch.device("cpu")

    monkeypatch.setattr(tune_timer, "work_device", on_cpu)
    with pytest.raises(ValueError, match="a site ran off cuda:0 while run\\(\\) was captured there"):
        tune_timer.measure_graphed(
            lambda: outer(torch.ones(1)), targets, {device}, warmup=0, repeats=1, whole=frozenset()
        )
    with pytest.raises(ValueError, match="a CUDA graph is captured on one GPU"):
        tune_timer.measure_graphed(lambda: None, targets, set(), warmup=0, repeats=1, whole=frozenset())


def test_capture_warms_up_on_a_side_stream_and_restores_the_stream_on_failure(monkeypatch):
    api = mock_cuda_graph_api(monkeypatch, torch.device("cuda", 1))
    steps = api.steps
    reset = lambda: steps.append("reset")
    replay = tune_timer.capture(lambda: steps.append("run"), 2, api.device, before_capture=reset)
    replay()
    assert steps == [
        "side waits for caller", "on side", "run", "run", "caller waits for side", "reset", "capture", "run",
        "replay", "replay",  # one untimed replay (the first launch uploads the graph), then the caller's
    ]  # fmt: skip
    assert api.pools == [None]
    steps.clear()
    api.fail = True
    with pytest.raises(RuntimeError, match="simulated"):
        tune_timer.capture(lambda: steps.append("run"), 0, api.device)
    assert steps[-1] == "back to caller" and steps.count("run") == 2  # one warm-up call at least


def test_tune_in_cuda_graph_mode(monkeypatch):
    unet = _unet()
    with pytest.raises(ValueError, match=r"cuda_graph=True needs the model on a GPU, one .* are not on CUDA"):
        ldmopt.tune(unet, _run(unet), cuda_graph=True)
    assert not ldmopt.is_patched(unet)
    graphed = []
    _fake_measure(monkeypatch, unet, _fused_faster_for("resnet"))
    fake_wall = tune_module.wall_time

    def wall_time(run, devices, *, warmup, repeats, graph=False):
        graphed.append(graph)
        return fake_wall(run, devices, warmup=warmup, repeats=repeats)

    monkeypatch.setattr(tune_module, "measure_graphed", tune_module.measure)
    monkeypatch.setattr(tune_module, "measure", None)  # graph mode must not time eagerly
    monkeypatch.setattr(tune_module, "wall_time", wall_time)
    monkeypatch.setattr(tune_module, "_cuda_devices", lambda pipe: {torch.device("cuda", 0)})
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: f"Fake GPU {device}")
    report = ldmopt.tune(unet, _run(unet), cuda_graph=True)
    assert graphed == [True, True] and report.tuning.timer.endswith(" in a CUDA graph")
    assert report.tuning.choice()["measured_on"]["device"] == "Fake GPU cuda:0"
    measured_on = importlib.import_module("ldmopt.patch.tune_choice").measured_on
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: torch.cuda.current_device())
    assert measured_on({torch.device("cuda", 0)})["device"] == "cuda:0"  # no GPU to name: torch's name for it
    assert {s.rules for s in report.tuning.kept} == {("resnet",)}
    ldmopt.unpatch(unet)
