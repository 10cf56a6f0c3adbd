"""Profiling a patched model measures the fused path: the profiler's scope hooks on every module are observers, not
the user hooks that send a patched block to the stock path (bench_e2e.py and the demo profile patched models)."""

import torch

import ldmopt
from ldmopt import configs
from ldmopt.nn.child_check import fallback_reasons, hooked


def test_profile_of_a_patched_unet_runs_the_fused_path():
    model = configs.build_model("sd15", tiny=True, device="cpu", dtype=torch.float32)
    inputs = configs.example_inputs(model, batch=1)
    report = ldmopt.patch(model)
    assert report.counts().get("resnet", 0) > 0
    fallback_reasons.clear()
    with ldmopt.use_backend("torch"):
        prof = ldmopt.profile(lambda: configs.run_model(model, inputs), steps=1, warmup=0, modules=model)
    assert prof.shares()
    assert not report.fallbacks() and not fallback_reasons, report.fallbacks()
    assert report.backends().get("gn_conv2d"), report.backends()


def test_profile_of_a_patched_latte_runs_the_fused_path():
    # Its temporal blocks check their feed-forward's output Linear per call: the profiler's scope hooks on it (but
    # not a user's hook) must leave the token-order forward on.
    from ldmopt.nn import temporal_layout

    model = configs.build_model("latte", tiny=True, device="cpu", dtype=torch.float32)
    inputs = configs.example_inputs(model, batch=1)
    report = ldmopt.patch(model)
    assert report.counts().get("latte_temporal") == 1
    temporal_layout.fallback_reasons.clear()
    fallback_reasons.clear()
    with ldmopt.use_backend("torch"):
        ldmopt.profile(lambda: configs.run_model(model, inputs), steps=1, warmup=0, modules=model)
        assert not temporal_layout.fallback_reasons and not report.fallbacks(), temporal_layout.fallback_reasons
        handle = model.temporal_transformer_blocks[0].ff.net[2].register_forward_hook(lambda *a: None)
        configs.run_model(model, inputs)
        handle.remove()
    assert any("ff.net.2 has hooks" in why for why in report.fallbacks()), report.fallbacks()


def test_observer_hooks_do_not_count_but_user_hooks_do():
    from ldmopt.profiler.scopes import ModuleScopes

    layer = torch.nn.Linear(4, 4)
    with ModuleScopes(layer):
        assert layer._forward_hooks and not hooked(layer)
        handle = layer.register_forward_hook(lambda *a: None)
        assert hooked(layer)
        handle.remove()
    handle = layer.register_full_backward_hook(lambda *a: None)
    assert hooked(layer)
    handle.remove()
    assert not hooked(layer)


def test_fused_attention_keeps_its_kind():
    # residual_block runs the attention's work without calling the module: its observer hooks still open the
    # module's scope, so the profile splits spatial and cross-attention as for the stock model.
    model = configs.build_model("sd15", tiny=True, device="cpu", dtype=torch.float32)
    inputs = configs.example_inputs(model, batch=1)
    report = ldmopt.patch(model)
    assert report.counts().get("residual_block", 0) > 0
    with ldmopt.use_backend("torch"):
        prof = ldmopt.profile(lambda: configs.run_model(model, inputs), steps=1, warmup=0, modules=model)
    shares = prof.shares()
    assert shares["attention.spatial"] > 0 and shares["attention.cross"] > 0, shares
    assert not shares.get("attention.unattributed"), shares
    assert report.backends()["linear"], report.backends()


def test_the_temporal_attention_kernel_counts_as_temporal_attention():
    """A patched video model's temporal attention runs ldmopt's op: the profile keeps it in the temporal attention
    share (the studies' figure), not in the fused-kernels row; its other fused ops stay there."""
    from ldmopt.patch.rule import FAMILIES
    from ldmopt.profiler import categories as C

    model = configs.build_model("animatediff", tiny=True, device="cpu", dtype=torch.float32)
    inputs = configs.example_inputs(model, batch=1)
    report = ldmopt.patch(model, families=set(FAMILIES) - {"temporal_layout"})
    assert report.counts().get("temporal_attention", 0) > 0
    with ldmopt.use_backend("torch"):
        prof = ldmopt.profile(lambda: configs.run_model(model, inputs), steps=1, warmup=0, modules=model)
    assert report.backends().get("temporal_attention"), report.backends()
    assert prof.attention_split()["temporal"] > 0.2, prof.attention_split()
    assert prof.shares()[C.LDMOPT] > 0
    assert not any("temporal_attention" in name for name, _, _ in prof.top(C.LDMOPT, 50))
    assert C.classify_op("ldmopt::temporal_attention_backward") == C.ATTN_TEMPORAL
    kernels = frozenset({"_temporal_attention_fwd_kernel", "_geglu_fwd_kernel"})
    assert C.classify_kernel("_temporal_attention_fwd_kernel", kernels) == C.ATTN_TEMPORAL
    assert C.classify_kernel("_geglu_fwd_kernel", kernels) == C.LDMOPT
