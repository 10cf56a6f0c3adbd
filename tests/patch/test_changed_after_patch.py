"""Children changed after ``ldmopt.patch``: LoRA adapters loaded into a patched model, hooks added later.

The fused paths read some children's weights instead of calling them; a LoRA layer wrapped around such a child after
patching (``pipe.load_lora_weights`` on a patched pipeline) must still count, and ``unpatch`` must keep it.
"""

import copy
import functools

import pytest
import torch
from torch import nn

import ldmopt
from tests.patch import models
from tests.patch.helpers import assert_outputs_close, output_tensor

peft = pytest.importorskip("peft")

#: Every projection a fused path reads (plus attention and norm projections, called as before) that exists in the
#: family: GEGLU/GELU proj, FF out (gated residual), proj_in (GroupNorm fused into it), Flux proj_mlp/proj_out,
#: adaLN linear, resnet convs.
TARGETS = {
    "sd15": ["to_q", "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2", "conv1", "conv2", "conv_shortcut"],
    "sdxl": ["proj_in", "ff.net.0.proj", "ff.net.2", "conv1", "time_emb_proj"],
    "dit": ["to_q", "ff.net.0.proj", "ff.net.2", "linear", "proj_out_2"],
    "pixart": ["ff.net.0.proj", "ff.net.2", "proj_out"],
    "sd3": ["to_q", "ff.net.0.proj", "ff.net.2", "ff_context.net.2", "linear"],
    "flux": ["ff.net.0.proj", "ff.net.2", "ff_context.net.2", "linear", "proj_mlp", "proj_out"],
    "svd": ["proj_in", "ff.net.0.proj", "ff.net.2", "conv1"],
    "latte": ["ff.net.0.proj", "ff.net.2", "proj_out"],
}


def _run(model, kwargs):
    with torch.no_grad():
        return output_tensor(model(**kwargs))


def _add_lora(model, targets):
    config = peft.LoraConfig(r=4, target_modules=targets)
    if hasattr(model, "add_adapter"):
        model.add_adapter(config)
    else:  # models without diffusers' PeftAdapterMixin
        peft.inject_adapter_in_model(config, model)


def _stock_and_patched(family):
    stock = models.BUILDERS[family]().eval()
    patched = models.BUILDERS[family]().eval()
    patched.load_state_dict(stock.state_dict())
    return stock, patched


@pytest.mark.parametrize("family", sorted(TARGETS))
def test_lora_loaded_after_patch_counts_and_survives_unpatch(family):
    stock, patched = _stock_and_patched(family)
    x = models.inputs(family, stock)
    report = ldmopt.patch(patched)
    assert report.total > 0
    for model in (stock, patched):
        _add_lora(model, TARGETS[family])
    for name, p in stock.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p, std=0.1)  # peft starts B at zero, a no-op update
    keys = list(stock.state_dict())
    assert list(patched.state_dict()) == keys
    patched.load_state_dict(stock.state_dict())
    ref = _run(stock, x)
    with ldmopt.use_backend("torch"):
        assert_outputs_close(_run(patched, x), ref, name=f"{family} + LoRA after patch")
    assert any("ran the stock path" in reason for reason in report.fallbacks()), report.fallbacks()
    ldmopt.unpatch(patched)
    assert list(patched.state_dict()) == keys
    assert torch.equal(_run(patched, x), ref), "unpatch dropped or altered a LoRA layer loaded while patched"
    # the layers peft wrapped (now its base layers) are not claimed by the gone patch any more
    assert not ldmopt.is_patched(patched)
    again = ldmopt.patch(patched)  # (with the LoRA layers in place, some models have nothing left to fuse)
    assert again.already_patched == 0
    ldmopt.unpatch(patched)
    assert not ldmopt.is_patched(patched)


def test_lora_unloaded_while_patched_resumes_the_fused_path():
    stock, patched = _stock_and_patched("flux")
    x = models.inputs("flux", stock)
    ref = _run(stock, x)
    report = ldmopt.patch(patched)
    patched.add_adapter(peft.LoraConfig(r=4, target_modules=TARGETS["flux"]))
    patched.unload_lora()  # peft puts the base layers back: ldmopt's fused modules
    assert report.fallbacks() == {}
    with ldmopt.use_backend("torch"):
        assert_outputs_close(_run(patched, x), ref, name="flux after LoRA unload")
    assert not [r for r in report.fallbacks() if "ran the stock path" in r], report.fallbacks()
    assert report.backends()["linear"]["torch"] > 0


def test_forward_hook_added_after_patch_is_not_bypassed():
    stock, patched = _stock_and_patched("dit")
    x = models.inputs("dit", stock)
    report = ldmopt.patch(patched)

    def double_input(module, args):
        return (args[0] * 2,)

    for model in (stock, patched):
        for name, m in model.named_modules():
            if name.endswith("ff.net.2") or name.endswith("ff.net.0.proj"):
                m.register_forward_pre_hook(double_input)
    with ldmopt.use_backend("torch"):
        assert_outputs_close(_run(patched, x), _run(stock, x), name="dit with hooks added after patch")
    hooked = [r for r in report.fallbacks() if "has hooks" in r]
    assert hooked, report.fallbacks()


@pytest.mark.parametrize("family", ["dit", "sd3", "flux"])
def test_hook_on_an_adaln_norm_added_after_patch_is_not_bypassed(family):
    """The adaLN modules compute their LayerNorm in the modulation kernel: a hook attached to that `.norm` after
    patching (found at patch time only before) must run, as on the stock model, and be reported."""
    stock, patched = _stock_and_patched(family)
    x = models.inputs(family, stock)
    report = ldmopt.patch(patched)

    def scale_output(module, args, out):
        return out * 1.3

    for model in (stock, patched):
        for name, m in model.named_modules():
            if isinstance(m, nn.LayerNorm) and name.endswith(".norm"):  # AdaLayerNorm*.norm: norm1.norm, norm_out.norm
                m.register_forward_hook(scale_output)
    with ldmopt.use_backend("torch"):
        assert_outputs_close(_run(patched, x), _run(stock, x), name=f"{family} with adaLN norm hooks after patch")
    assert any("norm has hooks" in r for r in report.fallbacks()), report.fallbacks()


@pytest.mark.parametrize("family", ["dit", "sd3", "flux"])
def test_adaln_norm_replaced_or_changed_after_patch_is_followed(family):
    """An adaLN module's `.norm` replaced after patching (an affine LayerNorm the kernel does not reproduce) runs that
    norm, reported; a changed eps on a LayerNorm it does reproduce is read per call."""
    stock, patched = _stock_and_patched(family)
    x = models.inputs(family, stock)
    report = ldmopt.patch(patched)
    for model in (stock, patched):
        torch.manual_seed(5)
        for name, m in list(model.named_modules()):
            if name.endswith(".norm1") and isinstance(getattr(m, "norm", None), nn.LayerNorm):
                affine = nn.LayerNorm(m.norm.normalized_shape, eps=1e-3)
                with torch.no_grad():
                    affine.weight.normal_(1.0, 0.5)
                    affine.bias.normal_(0.0, 0.5)
                m.norm = affine
            elif isinstance(getattr(m, "norm", None), nn.LayerNorm) and name.endswith("norm_out"):
                m.norm.eps = 0.5  # large enough to show if the patch-time eps were used
    with ldmopt.use_backend("torch"):
        assert_outputs_close(_run(patched, x), _run(stock, x), name=f"{family} with adaLN norms replaced after patch")
    assert any("affine parameters" in r for r in report.fallbacks()), report.fallbacks()


@pytest.mark.parametrize("family", ["pixart", "sd3"])
def test_feed_forward_chunking_after_patch_is_reported(family):
    """Blocks set to chunk their feed-forward run diffusers' forward: the report says so instead of nothing."""
    stock, patched = _stock_and_patched(family)
    x = models.inputs(family, stock)
    report = ldmopt.patch(patched)
    for model in (stock, patched):
        for block in model.transformer_blocks:
            block.set_chunk_feed_forward(1, 1)
    with ldmopt.use_backend("torch"):
        assert_outputs_close(_run(patched, x), _run(stock, x), name=f"{family} chunked")
    assert any("feed-forward chunking" in r for r in report.fallbacks()), report.fallbacks()


class _MarkedWeight(torch.Tensor):
    """A tensor subclass standing in for a quantized weight (torchao keeps nn.Linear and swaps the weight)."""


def test_weight_swapped_for_a_tensor_subclass_after_patch_takes_the_stock_path():
    stock, patched = _stock_and_patched("pixart")
    x = models.inputs("pixart", stock)
    report = ldmopt.patch(patched)
    for name, m in patched.named_modules():
        if name.endswith("ff.net.2"):
            m.weight = nn.Parameter(m.weight.detach().clone().as_subclass(_MarkedWeight))
    with ldmopt.use_backend("torch"):
        assert_outputs_close(_run(patched, x), _run(stock, x), name="pixart with subclass weights")
    assert [r for r in report.fallbacks() if "_MarkedWeight" in r], report.fallbacks()


def _assert_same_as_stock(stock, patched, x, name):
    with ldmopt.use_backend("torch"):
        assert_outputs_close(_run(patched, x), _run(stock, x), name=name)


@pytest.mark.parametrize("family,fqn", [("sd3", "transformer_blocks"), ("dit", "transformer_blocks")])
def test_layer_skip_guidance_hooks_after_patch(family, fqn):
    # diffusers' guiders (SkipLayerGuidance) skip a block's feed-forward by hooking `ff`, which the fused block
    # forward does not call: the block must take its stock forward then.
    from diffusers.hooks import LayerSkipConfig, apply_layer_skip

    stock, patched = _stock_and_patched(family)
    x = models.inputs(family, stock)
    report = ldmopt.patch(patched)
    unskipped = _run(stock, x)
    for model in (stock, patched):
        apply_layer_skip(model, LayerSkipConfig(indices=[0], fqn=fqn, skip_attention=False, skip_ff=True))
    assert (_run(stock, x) - unskipped).abs().max() > 1e-3
    _assert_same_as_stock(stock, patched, x, f"{family} with layer skip")
    expected = "ff has hooks (forward, backward or global) or a wrapped forward"
    assert [r for r in report.fallbacks() if expected in r], report.fallbacks()


def test_wrapped_forward_after_patch_is_not_bypassed():
    # accelerate and diffusers hooks replace `module.forward` on the instance instead of registering torch hooks.
    import types

    stock, patched = _stock_and_patched("sd15")
    x = models.inputs("sd15", stock)
    ldmopt.patch(patched)

    def doubled(self, hidden, *args, **kwargs):
        return type(self).forward(self, 2 * hidden, *args, **kwargs)

    for model in (stock, patched):
        for name, m in model.named_modules():
            if name.endswith(("resnets.0.conv1", "attentions.0.proj_in", "ff.net.0.proj")):
                m.forward = types.MethodType(doubled, m)
    _assert_same_as_stock(stock, patched, x, "sd15 with wrapped forwards")


@pytest.mark.parametrize("family,producer", [("flux", "proj_mlp"), ("vae", "conv_norm_out")])
def test_moved_activation_pair_broken_up_after_patch(family, producer):
    # A GELU/SiLU moved into its producer (proj_mlp, conv_norm_out) goes back where it was when the producer is
    # hooked, copied by peft's modules_to_save, or replaced after patching.
    stock, patched = _stock_and_patched(family)
    x = models.inputs(family, stock)
    report = ldmopt.patch(patched)

    def shifted(module, args, output):
        return output + 0.25

    handles = []
    for model in (stock, patched):
        for name, m in model.named_modules():
            if name.endswith(producer):
                handles.append((model, m.register_forward_hook(shifted)))
    _assert_same_as_stock(stock, patched, x, f"{family}: hook on {producer}")
    assert [r for r in report.fallbacks() if "ran on its own" in r], report.fallbacks()
    with pytest.raises(ldmopt.patch.PatchError, match="got hooks or a wrapped forward while patched"):
        ldmopt.unpatch(patched)  # the hook sits on ldmopt's module: unpatch would drop it
    for model, handle in handles:
        if model is patched:
            handle.remove()
    ldmopt.unpatch(patched)

    stock, patched = _stock_and_patched(family)
    ldmopt.patch(patched)
    config = peft.LoraConfig(r=4, target_modules=["to_q"], modules_to_save=[producer])
    for model in (stock, patched):
        peft.inject_adapter_in_model(config, model)
    with torch.no_grad():
        for name, p in stock.named_parameters():
            if "modules_to_save" in name or "lora_B" in name:
                p.add_(torch.randn_like(p) * 0.1)
    patched.load_state_dict(stock.state_dict())
    _assert_same_as_stock(stock, patched, x, f"{family}: modules_to_save={producer}")
    ldmopt.unpatch(patched)
    assert torch.allclose(_run(patched, x), _run(stock, x), rtol=1e-4, atol=1e-5)


def test_norm_replaced_after_patch_keeps_its_silu():
    stock, patched = _stock_and_patched("vae")
    x = models.inputs("vae", stock)
    ldmopt.patch(patched)
    for model in (stock, patched):
        old = model.decoder.conv_norm_out
        model.decoder.conv_norm_out = nn.GroupNorm(old.num_groups, old.num_channels, old.eps)
    patched.decoder.conv_norm_out.load_state_dict(stock.decoder.conv_norm_out.state_dict())
    _assert_same_as_stock(stock, patched, x, "vae with conv_norm_out replaced")


def test_unpatch_refuses_to_drop_what_was_attached_to_ldmopt_modules():

    from torch.nn.utils import parametrize

    from ldmopt.patch import PatchError, is_patched

    model = models.flux().eval()
    x = models.inputs("flux", model)
    ref = _run(model, x)
    ldmopt.patch(model)
    block = model.transformer_blocks[0]
    # what accelerate's add_hook_to_module does: a new forward calling the old one (the fused block's, bound)
    block.forward = functools.partial(lambda old, *args, **kwargs: old(*args, **kwargs), block.forward)
    proj = model.single_transformer_blocks[0].proj_mlp

    class Scale(nn.Module):
        def forward(self, w):
            return 1.5 * w

    parametrize.register_parametrization(proj, "weight", Scale())
    with pytest.raises(PatchError, match=r"transformer_blocks\.0: its forward was wrapped") as err:
        ldmopt.unpatch(model)
    assert "single_transformer_blocks.0: ldmopt's FusedLinear (.proj_mlp) became a Parametrized" in str(err.value)
    assert is_patched(model)  # nothing was half undone
    del block.forward
    parametrize.remove_parametrizations(proj, "weight", leave_parametrized=False)
    assert ldmopt.unpatch(model) > 0
    assert torch.equal(_run(model, x), ref)


def test_global_module_hooks_take_the_stock_path_and_do_not_block_unpatch():
    """A global hook (register_module_forward_hook) sees every module call: fused paths that would skip calls fall
    back while it is registered; it belongs to no module, so unpatch drops nothing of it and goes ahead."""
    from torch.nn.modules.module import register_module_forward_hook

    model = models.vae().eval()
    x = torch.randn(1, 3, 16, 16)
    with torch.no_grad():
        ref = output_tensor(model(x))
    report = ldmopt.patch(model)
    seen = []
    handle = register_module_forward_hook(lambda mod, args, out: seen.append(type(mod).__name__))
    try:
        with torch.no_grad(), ldmopt.use_backend("torch"):
            assert_outputs_close(output_tensor(model(x)), ref, name="vae with a global hook")
        assert "SiLU" in seen and any("hooks" in r for r in report.fallbacks()), report.fallbacks()
        assert ldmopt.unpatch(model) > 0
    finally:
        handle.remove()
    with torch.no_grad():
        assert torch.equal(output_tensor(model(x)), ref)


def _function_module(forward) -> str:
    """Where an instance forward's code lives ('' for none)."""
    return getattr(getattr(forward, "__func__", forward), "__module__", "") or ""


def _stock_fallbacks(report) -> int:
    return sum(n for reason, n in report.fallbacks().items() if "triton refused" not in reason)


@pytest.mark.parametrize("family,fqn", [("sd3", "transformer_blocks"), ("dit", "transformer_blocks")])
def test_layer_skip_removed_again_resumes_the_fused_path(family, fqn):
    # SkipLayerGuidance removes its hooks after every guided step; diffusers leaves the class's forward bound on the
    # instance and an empty registry: no hook, so the fused path must resume (it stayed stock for good).
    from diffusers.hooks import HookRegistry, LayerSkipConfig, apply_layer_skip

    stock, patched = _stock_and_patched(family)
    x = models.inputs(family, stock)
    report = ldmopt.patch(patched)
    apply_layer_skip(patched, LayerSkipConfig(indices=[0], fqn=fqn, skip_attention=False, skip_ff=True))
    _run(patched, x)
    HookRegistry.check_if_exists_or_initialize(patched).remove_hook("layer_skip_hook", recurse=True)
    before = _stock_fallbacks(report)
    _assert_same_as_stock(stock, patched, x, f"{family} after the layer skip was removed")
    assert _stock_fallbacks(report) == before, report.fallbacks()
    assert ldmopt.unpatch(patched) > 0 and not ldmopt.is_patched(patched)


def test_accelerate_hooks_removed_again_leave_nothing_behind():
    # accelerate's remove_hook_from_module (pipe.remove_all_hooks()) leaves `module.forward` = the class's forward
    # bound to the module. That is no hook: the fused path resumes, unpatch succeeds and runs no ldmopt code after,
    # and a model unhooked so is patched like a fresh one.
    from accelerate import cpu_offload
    from accelerate.hooks import remove_hook_from_module

    stock, patched = _stock_and_patched("sd15")
    x = models.inputs("sd15", stock)
    fresh = ldmopt.patch(copy.deepcopy(stock)).total
    report = ldmopt.patch(patched)
    cpu_offload(patched, execution_device="cpu")
    remove_hook_from_module(patched, recurse=True)
    assert any("forward" in vars(m) for m in patched.modules())  # the leftovers this is about
    before = _stock_fallbacks(report)
    _assert_same_as_stock(stock, patched, x, "sd15 after accelerate hooks were removed")
    assert _stock_fallbacks(report) == before, report.fallbacks()
    assert ldmopt.unpatch(patched) == report.total
    leftover = [n for n, m in patched.named_modules() if "ldmopt" in _function_module(vars(m).get("forward"))]
    assert not leftover, leftover[:3]
    _assert_same_as_stock(stock, patched, x, "sd15 unpatched after the hooks were removed")

    unhooked = copy.deepcopy(stock)
    cpu_offload(unhooked, execution_device="cpu")
    remove_hook_from_module(unhooked, recurse=True)
    again = ldmopt.patch(unhooked)
    assert again.total == fresh and not again.skipped, [s.reasons for s in again.skipped[:2]]
    _assert_same_as_stock(stock, unhooked, x, "sd15 patched after the hooks were removed")


def test_fused_qkv_saved_while_patched_unfuses_to_stock_processors_after_unpatch():
    # fuse_qkv_projections saves the processors of the moment for unfuse_qkv_projections: saved while patched, they
    # were ldmopt's and came back into the unpatched model (the fused kernel ran in a model reporting unpatched).
    from ldmopt.nn.temporal_attention import TemporalAttnProcessor

    stock, patched = _stock_and_patched("animatediff")
    x = models.inputs("animatediff", stock)
    ldmopt.patch(patched, families={"temporal_attention"})
    assert any(isinstance(p, TemporalAttnProcessor) for p in patched.attn_processors.values())
    patched.fuse_qkv_projections()
    assert ldmopt.unpatch(patched) > 0
    patched.unfuse_qkv_projections()
    kinds = {type(p).__name__ for p in patched.attn_processors.values()}
    assert kinds == {type(p).__name__ for p in stock.attn_processors.values()}, kinds
    assert not ldmopt.is_patched(patched)
    assert torch.equal(_run(patched, x), _run(stock, x))


def test_group_offload_after_patch_blocks_unpatch_until_its_hooks_are_removed():
    # diffusers' group offloading wraps block forwards: unpatch refuses while they are there (they call ldmopt's
    # forward) and goes ahead once diffusers' registry has removed them (what it leaves behind is inert).
    stock, patched = _stock_and_patched("sd15")
    x = models.inputs("sd15", stock)
    report = ldmopt.patch(patched)
    patched.enable_group_offload(onload_device=torch.device("cpu"), offload_type="block_level", num_blocks_per_group=1)
    _assert_same_as_stock(stock, patched, x, "sd15 with group offloading after patch")
    with pytest.raises(ldmopt.patch.PatchError, match="its forward was wrapped while patched"):
        ldmopt.unpatch(patched)
    for module in patched.modules():
        registry = module.__dict__.get("_diffusers_hook")
        for name in list(getattr(registry, "_hook_order", ())):
            registry.remove_hook(name, recurse=False)
    assert ldmopt.unpatch(patched) == report.total and not ldmopt.is_patched(patched)
    assert torch.equal(_run(patched, x), _run(stock, x))
