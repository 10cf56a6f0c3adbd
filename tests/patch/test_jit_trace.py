"""torch.jit.trace of patched models (what torch.onnx.export(dynamo=False) runs first): the trace keeps ldmopt's ops,
matches stock at the traced shapes and, like stock's, at others (no sizes baked in as constants), and no fused path
catches an op error while tracing (the tracer crashes the process after one: DiT's transposed residual stream took
ops.linear's view-or-reshape fallback that way)."""

import copy

import torch

import ldmopt
from tests.patch import models
from tests.patch.helpers import output_tensor


def _trace_and_rerun(family: str, inputs, other_inputs):
    torch.manual_seed(0)
    stock = models.__dict__[family]().eval()
    patched = copy.deepcopy(stock)
    ldmopt.patch(patched)
    with torch.no_grad(), ldmopt.use_backend("torch"):
        traced = torch.jit.trace(patched, inputs, check_trace=False, strict=False)
        assert "ldmopt::" in str(traced.inlined_graph)
        for call in (inputs, other_inputs):
            actual = traced(*call)
            actual = actual["sample"] if isinstance(actual, dict) else output_tensor(actual)
            torch.testing.assert_close(actual, output_tensor(stock(*call)), rtol=1e-4, atol=1e-5)


def test_traced_patched_dit_runs_and_matches_stock():
    def call(batch):
        return (torch.randn(batch, 4, 8, 8), torch.tensor([10] * batch), torch.tensor([1] * batch))

    _trace_and_rerun("dit", call(2), call(3))


def test_traced_patched_unet_takes_other_shapes():
    def call(batch, height, width, tokens):
        return (torch.randn(batch, 4, height, width), torch.tensor([10] * batch), torch.randn(batch, tokens, 32))

    _trace_and_rerun("sd15_unet", call(2, 8, 8, 5), call(3, 8, 16, 7))


def test_traced_patched_animatediff_takes_other_sizes():
    # The motion modules' sinusoidal positions, added in the GEMMs' loads every N rows, would bake the traced
    # pixels per frame (a 0-d traced size the op's int argument refused): traced, they are added as stock adds them.
    def call(batch, frames, side):
        sample = torch.randn(batch, 4, frames, side, side)
        return (sample, torch.tensor([10] * batch), torch.randn(batch * frames, 5, 32))

    _trace_and_rerun("animatediff", call(2, 3, 8), call(1, 4, 16))
