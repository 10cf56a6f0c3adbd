"""torch.cuda's stream and graph calls mocked for a CPU test of a capture procedure (ldmopt.graphs.capture_graph and
what calls it): every step is logged by name in order (streams waiting, the side stream entered, calls run, the
capture, replays, the stream put back), the pool each capture was given recorded."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch


@dataclass
class CudaGraphApi:
    device: torch.device
    steps: list[str] = field(default_factory=list)
    pools: list[object] = field(default_factory=list)  # what each torch.cuda.graph was given
    fail: bool = False  # the next capture raises when it ends, as a capture that hit a forbidden call does


def mock_cuda_graph_api(monkeypatch, device: torch.device) -> CudaGraphApi:
    api = CudaGraphApi(device)
    steps = api.steps

    class Stream:
        def __init__(self, on=None, name="side"):
            assert on == device, "every stream on the model's GPU"
            self.name = name

        def wait_stream(self, other):
            steps.append(f"{self.name} waits for {other.name}")

    caller = Stream(device, "caller")

    class Graph:
        def replay(self):
            steps.append("replay")

    @contextlib.contextmanager
    def on_device(d):
        assert d == device
        yield

    @contextlib.contextmanager
    def on_stream(stream):
        steps.append(f"on {stream.name}")
        yield

    @contextlib.contextmanager
    def capturing(graph, pool, stream, capture_error_mode):
        assert capture_error_mode == "thread_local" and isinstance(stream, Stream)
        api.pools.append(pool)
        steps.append("capture")
        yield
        if api.fail:
            raise RuntimeError("capture failed (simulated)")

    monkeypatch.setattr(torch.cuda, "device", on_device)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d: caller)
    monkeypatch.setattr(torch.cuda, "stream", on_stream)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", capturing)
    monkeypatch.setattr(torch.cuda, "set_stream", lambda s: steps.append(f"back to {s.name}"))
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool-1")
    return api
