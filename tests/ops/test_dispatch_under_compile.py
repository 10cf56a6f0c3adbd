"""The forced backend inside torch.compile where dynamo cannot read a ContextVar (torch before 2.14, e.g. the GPU
image's 2.11): the choice in effect while tracing is read once and baked into the graph, with no graph break."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import ldmopt
from ldmopt.ops import _dispatch


def _inputs():
    x = torch.randn(2, 12, 5, 3) * 1.5 + 0.2
    return x, torch.randn(12) * 0.5 + 1, torch.randn(12) * 0.3


def test_the_forced_backend_is_read_at_trace_time_where_dynamo_cannot_read_contextvars(monkeypatch):
    monkeypatch.setattr(_dispatch, "_DYNAMO_CANNOT_READ_CONTEXTVARS", True)
    torch._dynamo.reset()
    x, w, b = _inputs()
    compiled = torch.compile(
        lambda x: ldmopt.ops.group_norm(x, 4, w, b, activation="silu"), fullgraph=True, backend="aot_eager"
    )
    before = _dispatch.backend_counts["group_norm", "torch"]
    with ldmopt.use_backend("torch"):
        out = compiled(x)
    assert _dispatch.backend_counts["group_norm", "torch"] > before  # traced under the forced reference backend
    ref = F.silu(F.group_norm(x.double(), 4, w.double(), b.double()))
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()


def test_outside_compile_the_live_context_decides():
    with ldmopt.use_backend("torch"):
        assert _dispatch._resolve("group_norm") == ("torch", False)
        assert _dispatch._resolve_at_trace_time("group_norm") == ("torch", False)  # same answer, eagerly
    with ldmopt.use_backend("triton"):
        assert _dispatch._resolve("group_norm") == ("triton", False)
