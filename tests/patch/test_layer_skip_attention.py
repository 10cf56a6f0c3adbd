"""diffusers' attention layer skip (LayerSkipConfig: what the SkipLayerGuidance and PAG guiders apply each step) on
the temporal attention of patched video models. ``skip_attention_scores`` replaces SDPA's result through a torch
function mode, which ldmopt's temporal kernel would not pass through: the processors and the token-order blocks run
the stock attention while such a mode is active. ``skip_attention`` looks the processor up by class in diffusers'
registry, where ldmopt's processors are registered like the stock one."""

import copy

import pytest
import torch
from diffusers.hooks import LayerSkipConfig, PyramidAttentionBroadcastConfig, apply_layer_skip

import ldmopt
from ldmopt.nn.child_check import function_mode_reason
from ldmopt.profiler.recorder import AttentionRegions

from . import models

MOTION_BLOCKS = "down_blocks.0.motion_modules.0.transformer_blocks"


def _scores_skip() -> LayerSkipConfig:
    return LayerSkipConfig(
        indices=[0], fqn=MOTION_BLOCKS, skip_attention=False, skip_attention_scores=True, skip_ff=False
    )


@pytest.mark.parametrize("order", ["before", "after"])
def test_attention_score_skip_reaches_patched_temporal_attention(order):
    torch.manual_seed(0)
    base = models.animatediff().eval()
    call = models.inputs("animatediff", base)
    stock = copy.deepcopy(base)
    apply_layer_skip(stock, _scores_skip())
    patched = copy.deepcopy(base)
    if order == "before":
        apply_layer_skip(patched, _scores_skip())
    report = ldmopt.patch(patched)
    if order == "after":
        apply_layer_skip(patched, _scores_skip())
    with torch.no_grad(), ldmopt.use_backend("torch"):  # the choice of path is under test, not the kernels
        plain, expected, actual = base(**call).sample, stock(**call).sample, patched(**call).sample
    assert (expected - plain).abs().max() > 1e-2  # the skip changes the stock output
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)
    # Hooked at patch time, the block keeps ldmopt's processor, which sees the mode; hooked later, the token-order
    # block sees the hooks and runs diffusers' forward.
    why = "AttentionScoreSkipFunctionMode" if order == "before" else "transformer_blocks.0.attn1 has hooks"
    assert any(why in k for k in report.fallbacks()), report.fallbacks()


def test_attention_layer_skip_accepts_ldmopt_processors():
    # A hook on the Latte temporal blocks at patch time keeps them stock (temporal_layout) with ldmopt's processor.
    torch.manual_seed(0)
    base = models.latte().eval()
    call = models.inputs("latte", base)
    stock, patched = copy.deepcopy(base), copy.deepcopy(base)

    def broadcast():
        return PyramidAttentionBroadcastConfig(
            temporal_attention_block_skip_range=2, temporal_attention_timestep_skip_range=(0, 1000),
            current_timestep_callback=lambda: 500,
        )  # fmt: skip

    for model in (stock, patched):
        model.enable_cache(broadcast())
    ldmopt.patch(patched)
    assert type(patched.temporal_transformer_blocks[0].attn1.processor).__name__ == "TemporalAttnProcessor"
    skip = LayerSkipConfig(indices=[0], fqn="temporal_transformer_blocks", skip_attention=True, skip_ff=False)
    apply_layer_skip(stock, skip)
    apply_layer_skip(patched, copy.copy(skip))
    with torch.no_grad(), ldmopt.use_backend("torch"):
        torch.testing.assert_close(patched(**call).sample, stock(**call).sample, rtol=1e-4, atol=1e-4)


def test_only_foreign_function_modes_count():
    class Intercepting(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    assert function_mode_reason() is None
    with torch.device("cpu"), AttentionRegions(recorder=None):  # torch's and the profiler's modes only watch
        assert function_mode_reason() is None
    with Intercepting():
        assert "Intercepting" in function_mode_reason()


def test_a_function_mode_sees_the_stock_queries_of_svd_single_key_attention():
    # The fused SVD block skips norm2 before attn2 (one key: the queries' values cannot matter), but under a mode the
    # processor runs the stock attention, whose SDPA call the mode sees: on the stock queries, to_q(norm2(h)).
    class SingleKeyQueries(torch.overrides.TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.queries = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.nn.functional.scaled_dot_product_attention:
                query, key = kwargs.get("query", args[0]), kwargs.get("key", args[1] if len(args) > 1 else None)
                if key.shape[-2] == 1:
                    self.queries.append(query.detach().clone())
            return func(*args, **kwargs)

    torch.manual_seed(0)
    stock = models.svd().eval()
    call = models.inputs("svd", stock)
    patched = copy.deepcopy(stock)
    ldmopt.patch(patched)
    with torch.no_grad(), ldmopt.use_backend("torch"):
        with SingleKeyQueries() as seen_stock:
            stock(**call)
        with SingleKeyQueries() as seen_patched:
            patched(**call)
    assert seen_stock.queries and len(seen_patched.queries) == len(seen_stock.queries)
    for got, want in zip(seen_patched.queries, seen_stock.queries):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
