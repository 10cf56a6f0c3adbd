"""torch.export of patched models and of ldmopt's modules: the fused ops stay in the exported graph, strict or not.
Non-strict export (torch's default) traces with FakeTensor parameters, which the fused modules used to take for a
quantized weight: every fused path fell back to the stock modules and the export was silently unfused."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.export import Dim, export

import ldmopt
from ldmopt import nn as lnn
from tests.patch import models
from tests.patch.helpers import assert_outputs_close


def _ldmopt_ops(program) -> list[str]:
    return [str(n.target) for n in program.graph.nodes if n.op == "call_function" and "ldmopt" in str(n.target)]


@pytest.mark.parametrize("strict", [False, True], ids=["non-strict", "strict"])
def test_fused_linear_exports_its_op(strict):
    module = lnn.FusedLinear(12, 7, activation="gelu").eval()
    program = export(module, (torch.randn(2, 5, 12),), dynamic_shapes=({0: Dim("B", min=1, max=64)},), strict=strict)
    assert _ldmopt_ops(program) == ["ldmopt.linear_fwd.default"]
    x = torch.randn(3, 5, 12)
    assert_outputs_close(program.module()(x), module(x), name="exported")


class _UNetCall(torch.nn.Module):
    def __init__(self, unet):
        super().__init__()
        self.unet = unet

    def forward(self, sample, timestep, context):
        return self.unet(sample, timestep, encoder_hidden_states=context).sample


def test_patched_unet_exports_the_same_fused_graph_strict_or_not():
    stock = models.sd15_unet().eval()
    unet = copy.deepcopy(stock)
    ldmopt.patch(unet)

    def inputs(batch, height, width, tokens):
        return torch.randn(batch, 4, height, width), torch.full((batch,), 10), torch.randn(batch, tokens, 32)

    batch, tokens = Dim("B", min=2, max=16), Dim("S", min=2, max=77)
    h, w = Dim("H", min=1, max=16), Dim("W", min=1, max=16)
    dynamic = ({0: batch, 2: 4 * h, 3: 4 * w}, {0: batch}, {0: batch, 1: tokens})
    found = {}
    for strict in (False, True):
        program = export(_UNetCall(unet), inputs(2, 8, 12, 5), dynamic_shapes=dynamic, strict=strict)
        found[strict] = sorted(_ldmopt_ops(program))
        args = inputs(3, 8, 16, 7)
        # the exported graph's ldmopt ops on the reference backend: what is under test is the graph, not the kernels
        with torch.no_grad(), ldmopt.use_backend("torch"):
            assert_outputs_close(program.module()(*args), _UNetCall(stock)(*args), name=f"strict={strict}")
    assert found[False] and found[False] == found[True]


def test_patched_animatediff_exports_non_strict_with_dynamic_sizes():
    # The motion modules add their positions every h * w rows in the GEMMs' loads: under non-strict export that
    # count is a SymInt, which layer_norm_linear refused (strict export traces it as an int-like value)
    stock = models.animatediff().eval()
    patched = copy.deepcopy(stock)
    ldmopt.patch(patched)

    def inputs(side_h, side_w):
        return torch.randn(2, 4, 3, side_h, side_w), torch.full((2,), 10), torch.randn(6, 5, 32)

    h, w = Dim("H", min=1, max=8), Dim("W", min=1, max=8)
    program = export(_UNetCall(patched), inputs(8, 8), dynamic_shapes=({3: 4 * h, 4: 4 * w}, None, None), strict=False)
    assert _ldmopt_ops(program)
    args = inputs(8, 16)
    with torch.no_grad(), ldmopt.use_backend("torch"):
        assert_outputs_close(program.module()(*args), _UNetCall(stock)(*args), name="non-strict, 8x16 latents")
