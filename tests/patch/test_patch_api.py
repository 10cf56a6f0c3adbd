"""ldmopt.patch / unpatch behaviour on tiny models: report, reversibility, parameter sharing, guards, compile."""

import copy
import functools

import pytest
import torch
from torch import nn

import ldmopt
from ldmopt.patch import PatchError, PatchReport, is_patched, rule_table
from ldmopt.patch.rule import FusedAway
from tests.patch import models
from tests.patch.helpers import assert_outputs_close, assert_same_snapshot, output_tensor, snapshot


def _run(model, kwargs):
    with torch.no_grad():
        return output_tensor(model(**kwargs))


def _run_reference(model, kwargs):
    """A forward on the reference backend: for tests of patch's bookkeeping, not of the kernels (a whole patched
    UNet in the Triton interpreter costs a minute; tests/patch/test_families.py runs one per family)."""
    with ldmopt.use_backend("torch"):
        return _run(model, kwargs)


def _n_group_norms(model):
    return sum(type(m) is nn.GroupNorm for m in model.modules())


def test_vae_report_outputs_and_unpatch_bit_for_bit():
    vae = models.vae().eval()
    x = models.inputs("vae", vae)
    ref = _run(vae, x)
    before = snapshot(vae)
    n_gn = _n_group_norms(vae)

    with ldmopt.use_backend("torch"):
        report = ldmopt.patch(vae, families={"group_norm"})
        out = _run(vae, x)
    assert isinstance(report, PatchReport)
    # Encoder and Decoder heads: GroupNorm+SiLU; every other GroupNorm (resnets, mid-block attention) plain.
    assert report.counts() == {"group_norm": n_gn - 2, "group_norm_silu": 2}
    assert not report.skipped
    assert report.backends()["group_norm"] == {"torch": n_gn}
    assert_outputs_close(out, ref, name="vae")
    assert "activation='silu'" in repr(vae.encoder.conv_norm_out) and "ldmopt" in repr(vae.encoder.conv_act)
    assert isinstance(vae.decoder.conv_act, FusedAway)
    text = str(report)
    assert "group_norm_silu" in text and "torch x" in text
    assert is_patched(vae)

    assert ldmopt.unpatch(vae) == n_gn
    assert not is_patched(vae)
    assert_same_snapshot(before, snapshot(vae))
    assert torch.equal(_run(vae, x), ref)


def test_a_class_swap_of_a_patched_norm_gives_its_silu_back():
    """The "GroupNorm32" upcast, ``m.__class__ = GroupNorm32`` for every nn.GroupNorm, done after patching: the
    conv_norm_out that took over conv_act's SiLU now runs the user's class, so conv_act must apply the SiLU again."""

    class GroupNorm32(nn.GroupNorm):
        def forward(self, x):
            return super().forward(x.float()).type(x.dtype)

    vae = models.vae().eval()
    x = models.inputs("vae", vae)
    with ldmopt.use_backend("torch"):
        ldmopt.patch(vae, families={"group_norm"})
        for model in (vae, models.vae().eval()):
            model.load_state_dict(vae.state_dict())
            for m in model.modules():
                if isinstance(m, nn.GroupNorm):
                    m.__class__ = GroupNorm32
            if model is vae:
                out = _run(vae, x)
            else:
                ref = _run(model, x)
    assert_outputs_close(out, ref, name="vae, norms upcast after patching")


@pytest.mark.parametrize("channels_last_weights", [None, False])
def test_parameters_shared_and_state_dict_keys_kept(channels_last_weights):
    unet = models.sd15_unet().eval()
    params = {n: (id(p), p.data_ptr()) for n, p in unet.named_parameters()}
    keys = list(unet.state_dict())
    ldmopt.patch(unet, channels_last_weights=channels_last_weights)
    after = {n: (id(p), p.data_ptr()) for n, p in unet.named_parameters()}
    # The same Parameter objects; only conv weights re-laid out in channels-last (by default) have new storage.
    relaid = {n for n, p in unet.named_parameters() if p.dim() == 4 and not p.is_contiguous()}
    assert bool(relaid) == (channels_last_weights is None)
    assert {n: v[0] for n, v in after.items()} == {n: v[0] for n, v in params.items()}
    assert {n: v for n, v in after.items() if n not in relaid} == {n: v for n, v in params.items() if n not in relaid}
    assert list(unet.state_dict()) == keys


def test_patch_twice_is_a_noop():
    unet = models.sd15_unet().eval()
    first = ldmopt.patch(unet)
    tree = [(n, id(m), type(m)) for n, m in unet.named_modules()]
    second = ldmopt.patch(unet)
    assert second.total == 0 and second.already_patched == first.total
    assert [(n, id(m), type(m)) for n, m in unet.named_modules()] == tree
    assert ldmopt.unpatch(unet) == first.total
    assert ldmopt.unpatch(unet) == 0


def test_patch_in_steps_equals_patch_at_once():
    whole = models.flux().eval()
    at_once = ldmopt.patch(whole).counts()
    stepwise = models.flux().eval()
    # adaln first (class-swaps the single blocks), then the rest (the MLP rule keyed by the same class still applies).
    first = ldmopt.patch(stepwise, families={"adaln"})
    second = ldmopt.patch(stepwise)
    assert second.already_patched == first.total
    merged = {k: first.counts().get(k, 0) + second.counts().get(k, 0) for k in at_once}
    assert merged == at_once
    # A submodule patched on its own, then its model: nothing is patched twice; unpatch undoes both.
    unet = models.sd15_unet().eval()
    before = snapshot(unet)
    inner = ldmopt.patch(unet.down_blocks[0])
    outer = ldmopt.patch(unet)
    assert outer.already_patched == inner.total
    assert inner.total + outer.total == ldmopt.patch(models.sd15_unet().eval()).total
    assert ldmopt.unpatch(unet) == inner.total + outer.total
    assert_same_snapshot(before, snapshot(unet))


def test_a_narrower_family_patched_first_is_named_in_the_skip_reason():
    # group_norm first claims the resnets' norms, so the resnet rule of a later patch cannot read them: the report
    # says so and what to do (not "a LoRA/PEFT or quantized layer?"), and the model still matches stock.
    unet = models.sd15_unet().eval()
    kwargs = models.inputs("sd15", unet)
    expected = _run_reference(unet, kwargs)
    ldmopt.patch(unet, families=["group_norm"])
    second = ldmopt.patch(unet)
    resnets = [s for s in second.skipped if s.rule == "resnet"]
    assert resnets and all("from an earlier ldmopt.patch call" in r for s in resnets for r in s.reasons), resnets
    assert not any("LoRA/PEFT" in r for s in second.skipped for r in s.reasons)
    assert_outputs_close(_run_reference(unet, kwargs), expected)


def test_submodule_of_a_patched_model_is_not_patched_twice():
    """A model patched whole, then one of its blocks on its own: the block is already fused (patching it again would
    wrap the fused class in another, whose stock path then recursed); unpatching the block alone is refused with
    the model to unpatch, and the model's unpatch restores everything."""
    unet = models.sd15_unet().eval()
    inputs = models.inputs("sd15", unet)
    ref = _run_reference(unet, inputs)
    before = snapshot(unet)
    whole = ldmopt.patch(unet)
    block = unet.down_blocks[0]
    again = ldmopt.patch(block)
    assert again.total == 0 and again.already_patched > 0, str(again)
    assert all("fused[fused[" not in type(m).__name__ for m in unet.modules())
    with pytest.raises(PatchError, match=r"were patched by ldmopt\.patch of an enclosing UNet2DConditionModel"):
        ldmopt.unpatch(block)
    assert_outputs_close(_run_reference(unet, inputs), ref, name="after the second patch")
    assert ldmopt.unpatch(unet) == whole.total
    assert_same_snapshot(before, snapshot(unet))
    assert ldmopt.unpatch(block) == 0 and ldmopt.patch(block).total > 0  # free again once the model is unpatched


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_a_block_of_a_copied_patched_model_is_not_patched_twice(how, tmp_path):
    """A copy of a patched model (an EMA copy, a checkpoint of the module) holds its records at the copy's root, where
    the registry of claims does not know them: its blocks still count as patched, a patch of one of them fuses
    nothing again, unpatching the block alone returns its fused classes to their own, and the copy's unpatch then
    restores everything."""
    unet = models.sd15_unet().eval()
    before = snapshot(unet)
    whole = ldmopt.patch(unet)
    if how == "deepcopy":
        other = copy.deepcopy(unet)
    else:
        torch.save(unet, tmp_path / "unet.pt")
        other = torch.load(tmp_path / "unet.pt", weights_only=False)
    block = other.down_blocks[0]
    assert is_patched(block) and is_patched(unet.down_blocks[0])
    again = ldmopt.patch(block)
    assert again.total == 0 and again.already_patched > 0, str(again)
    assert all("fused[fused[" not in type(m).__name__ for m in other.modules())
    assert ldmopt.unpatch(block) > 0 and "fused[" not in type(block.resnets[0]).__qualname__
    assert ldmopt.unpatch(other) == whole.total
    assert [(n, type(m)) for n, m in other.named_modules()] == [(t[0], t[2]) for t in before["tree"]]
    assert all(torch.equal(v, before["state"][k]) for k, v in other.state_dict().items())
    assert not is_patched(block) and ldmopt.is_patched is is_patched


def test_unpatch_with_a_peft_copy_of_a_patched_block():
    """PEFT's modules_to_save deep-copies the block it wraps, fused class included, with no undo record: unpatch
    restores the model's records and returns the copy to its own class."""
    from peft import LoraConfig, inject_adapter_in_model

    unet = models.sd15_unet().eval()
    whole = ldmopt.patch(unet)
    config = LoraConfig(r=2, target_modules=["to_q"], modules_to_save=["mid_block.resnets.0"])
    inject_adapter_in_model(config, unet)
    assert ldmopt.unpatch(unet) > whole.total
    assert not is_patched(unet)
    assert not any("_ldmopt_base" in type(m).__dict__ for m in unet.modules())


def _ldmopt_modules(model):
    return [name for name, m in model.named_modules() if type(m).__module__.startswith("ldmopt.")]


def test_unpatch_with_a_peft_copy_of_a_block_with_child_swapped_modules():
    """modules_to_save of a transformer block copies the FusedGEGLU and ldmopt GroupNorm swapped in as its children
    (no class swap): unpatch used to leave them running in the copy, and is_patched said False."""
    from peft import LoraConfig, inject_adapter_in_model

    unet = models.sd15_unet().eval()
    stock = copy.deepcopy(unet)
    inputs = models.inputs("sd15", unet)
    ldmopt.patch(unet)
    config = LoraConfig(r=2, target_modules=["to_q"], modules_to_save=["mid_block.attentions.0"])
    inject_adapter_in_model(config, unet)
    inject_adapter_in_model(config, stock)
    copied = unet.mid_block.attentions[0].modules_to_save["default"]
    assert _ldmopt_modules(copied) and is_patched(copied)
    ldmopt.unpatch(unet)
    assert not is_patched(unet) and _ldmopt_modules(unet) == []
    assert [(n, type(m)) for n, m in unet.named_modules()] == [(n, type(m)) for n, m in stock.named_modules()]
    assert_outputs_close(_run(unet, inputs), _run(stock, inputs), name="unpatched")


def test_unpatch_of_a_copied_block_restores_swapped_children_and_processors():
    """copy.deepcopy of one block of a patched model carries no records: unpatching the copy restores its class
    swaps, its child swaps and ldmopt's attention processors, and leaves the original model patched."""
    for build, path in ((models.sd15_unet, "mid_block"), (models.svd, "down_blocks.0")):
        model = build().eval()
        block = model.get_submodule(path)
        stock_block = copy.deepcopy(block)
        stock_processors = {n: type(m.processor) for n, m in stock_block.named_modules() if hasattr(m, "processor")}
        whole = ldmopt.patch(model)
        copied = copy.deepcopy(block)
        assert is_patched(copied) and ldmopt.unpatch(copied) > 0
        assert not is_patched(copied) and _ldmopt_modules(copied) == []
        assert [(n, type(m)) for n, m in copied.named_modules()] == [
            (n, type(m)) for n, m in stock_block.named_modules()
        ]
        assert {n: type(m.processor) for n, m in copied.named_modules() if hasattr(m, "processor")} == stock_processors
        assert list(copied.state_dict()) == list(stock_block.state_dict())
        assert is_patched(model) and ldmopt.unpatch(model) == whole.total


def test_unpatch_restores_train_and_eval_modes():
    """Swapped-out children live outside the tree while patched: model.train()/eval() then reaches only ldmopt's
    modules, whose mode the originals take back; the swapped-in modules start in the mode of those they replace."""
    unet = models.sd15_unet().eval()
    ldmopt.patch(unet)
    assert not any(m.training for m in unet.modules())
    unet.train()
    ldmopt.unpatch(unet)
    assert all(m.training for m in unet.modules())
    ldmopt.patch(unet)
    unet.eval()
    ldmopt.unpatch(unet)
    assert not any(m.training for m in unet.modules())


class _Pipeline:
    def __init__(self, **components):
        self.components = components


def test_models_shared_between_components_are_patched_once():
    """A block of the UNet listed as a component of its own (before the UNet) and the UNet under two names: every
    module is patched once, the report counts each once, and unpatching the pipeline restores everything."""
    unet = models.sd15_unet().eval()
    inputs = models.inputs("sd15", unet)
    ref = _run_reference(unet, inputs)
    before = snapshot(unet)
    alone = ldmopt.patch(models.sd15_unet().eval()).counts()
    pipe = _Pipeline(block=nn.Sequential(unet.down_blocks[0]), unet=unet, alias=unet)
    report = ldmopt.patch(pipe)
    assert report.counts() == alone and set(report.models) == {"block", "unet"}
    assert all("fused[fused[" not in type(m).__name__ for m in unet.modules())
    assert_outputs_close(_run_reference(unet, inputs), ref, name="shared")
    assert ldmopt.unpatch(pipe) == sum(alone.values())
    assert_same_snapshot(before, snapshot(unet))
    assert torch.equal(_run_reference(unet, inputs), ref)


def test_unpatch_of_a_pipeline_reaches_a_component_replaced_since_the_patch():
    """``pipe.unet = other`` after ``patch(pipe)``: unpatch(pipe) still undoes the first UNet (no longer among the
    components, but patched through this pipeline) as well as whatever is there now; a second unpatch finds nothing."""
    first, vae = models.sd15_unet().eval(), models.vae().eval()
    before = snapshot(first)
    pipe = _Pipeline(unet=first, vae=vae)
    report = ldmopt.patch(pipe)
    second = models.sd15_unet().eval()
    pipe.components["unet"] = second
    assert not is_patched(pipe.components["unet"])
    assert ldmopt.patch(pipe).total > 0  # the new one patched too
    assert is_patched(first)
    assert ldmopt.unpatch(pipe) == report.total + ldmopt.patch(models.sd15_unet().eval()).total
    assert not is_patched(first) and not is_patched(second) and not is_patched(vae)
    assert_same_snapshot(before, snapshot(first))
    assert ldmopt.unpatch(pipe) == 0
    # Patched on its own afterwards, the first UNet is not the pipeline's to undo any more.
    ldmopt.patch(first)
    assert ldmopt.unpatch(pipe) == 0 and is_patched(first)
    ldmopt.unpatch(first)


def test_a_replace_that_raises_undoes_the_whole_call(monkeypatch):
    """patch is all or nothing across a pipeline's models: the VAE patched first is restored when a rule raises
    while patching the UNet, and both can be patched afterwards."""
    vae, unet = models.vae().eval(), models.sd15_unet().eval()
    before = {"vae": snapshot(vae), "unet": snapshot(unet)}
    pipe = _Pipeline(vae=vae, unet=unet)
    geglu = next(r for r in rule_table()[type(unet.down_blocks[0].attentions[0].transformer_blocks[0].ff.net[0])])
    calls = []

    def failing_replace(site):
        calls.append(site.name)
        raise RuntimeError("replace failed")

    monkeypatch.setattr(geglu, "replace", failing_replace)
    with pytest.raises(RuntimeError, match="replace failed"):
        ldmopt.patch(pipe)
    assert calls and not is_patched(pipe)
    assert_same_snapshot(before["vae"], snapshot(vae))
    assert_same_snapshot(before["unet"], snapshot(unet))
    monkeypatch.undo()
    report = ldmopt.patch(pipe)
    assert report.already_patched == 0 and report.total > 0
    assert ldmopt.unpatch(pipe) == report.total


def test_a_failed_rollback_still_raises_the_original_error(monkeypatch):
    """A restore that raises while a failed patch is rolled back is reported in a warning; the other modules are
    still restored and the replace's own error is the one raised."""
    vae, unet = models.vae().eval(), models.sd15_unet().eval()
    table = rule_table()
    geglu = next(iter(table[type(unet.down_blocks[0].attentions[0].transformer_blocks[0].ff.net[0])]))
    group_norm = next(r for r in table[nn.GroupNorm] if r.name == "group_norm")
    monkeypatch.setattr(geglu, "replace", lambda site: (_ for _ in ()).throw(RuntimeError("replace failed")))
    real_restore, restored = group_norm.restore, []

    def restore_failing_once(site, data):
        if not restored:
            restored.append(site.name)
            raise OSError("restore failed")
        real_restore(site, data)

    monkeypatch.setattr(group_norm, "restore", restore_failing_once)
    warned = pytest.warns(RuntimeWarning, match=r"(?s)could not undo every change.*\[group_norm\]: OSError: restore")
    with warned, pytest.raises(RuntimeError, match="replace failed"):
        ldmopt.patch(_Pipeline(vae=vae, unet=unet))
    assert not is_patched(unet)
    stock_group_norms = [n for n, m in vae.named_modules() if type(m) is nn.GroupNorm]
    assert len(stock_group_norms) == _n_group_norms(models.vae()) - 1 and restored[0] not in stock_group_norms
    # The one left fused still says so, and a later unpatch puts its GroupNorm back (it holds the module it replaced).
    assert is_patched(vae) and ldmopt.unpatch(vae) == 1 and not is_patched(vae)
    assert len([m for m in vae.modules() if type(m) is nn.GroupNorm]) == _n_group_norms(models.vae())


def test_repr_deepcopy_and_torch_save(tmp_path):
    unet = models.sd15_unet().eval()
    x = models.inputs("sd15", unet)
    ref = _run(unet, x)
    before = snapshot(unet)
    report = ldmopt.patch(unet)
    text = repr(unet)
    assert "ldmopt='ResnetBlock2D: GN+SiLU fused" in text and "FusedGEGLU" in text and "ldmopt.GroupNorm" in text
    copied = copy.deepcopy(unet)
    torch.save(unet, tmp_path / "unet.pt")
    loaded = torch.load(tmp_path / "unet.pt", weights_only=False)
    for other in (copied, loaded):
        with ldmopt.use_backend("torch"):
            assert_outputs_close(_run(other, x), ref, name="copy")
        assert ldmopt.unpatch(other) == report.total  # the undo records travel with the model
        assert [(n, type(m)) for n, m in other.named_modules()] == [(t[0], t[2]) for t in before["tree"]]
        assert all(torch.equal(v, before["state"][k]) for k, v in other.state_dict().items())
        assert torch.equal(_run(other, x), ref)


def test_load_state_dict_and_save_pretrained_on_patched(tmp_path):
    vae = models.vae().eval()
    ldmopt.patch(vae)
    new_state = {k: torch.randn_like(v) for k, v in vae.state_dict().items()}
    vae.load_state_dict(new_state)
    vae.save_pretrained(tmp_path)
    type(vae).from_pretrained(tmp_path)  # loads into a stock model
    reloaded = type(vae).from_pretrained(tmp_path).state_dict()
    assert list(reloaded) == list(new_state)
    assert all(torch.equal(reloaded[k], v) for k, v in new_state.items())
    ldmopt.unpatch(vae)  # the stock modules share the parameters, so they hold the loaded values
    assert all(torch.equal(vae.state_dict()[k], v) for k, v in new_state.items())


def test_families_and_filter_fn():
    vae = models.vae().eval()
    with pytest.raises(ValueError, match="unknown families"):
        ldmopt.patch(vae, families={"nope"})
    with pytest.raises(TypeError, match="channels_last_weights='yes' is not supported; expected None, True or False"):
        ldmopt.patch(vae, channels_last_weights="yes")
    assert ldmopt.patch(vae, families=set()).total == 0
    report = ldmopt.patch(vae, filter_fn=lambda m, name: not name.startswith("decoder"))
    assert all(r.name.startswith("encoder") or r.name.startswith("quant") for r in report.replaced)
    assert report.skipped and all(s.by_user and s.name.startswith("decoder") for s in report.skipped)
    assert type(vae.decoder.conv_norm_out) is nn.GroupNorm


def test_filter_fn_speaks_for_the_children_a_rule_bypasses():
    """Excluding a child that a rule on its parent would bypass (Flux's q norm, a block's feed-forward) leaves that
    rule off the parent too, reported as the user's choice; the same rule still patches the other blocks."""
    model = models.flux().eval()
    excluded = {"transformer_blocks.0.attn.norm_q", "transformer_blocks.0.ff"}
    asked = []

    def keep(module, name):
        asked.append(name)
        return name not in excluded

    report = ldmopt.patch(model, filter_fn=keep)
    assert excluded <= set(asked)
    skipped = {(s.name, s.rule): s for s in report.skipped}
    assert set(skipped) == {("transformer_blocks.0", "joint_block"), ("transformer_blocks.0.attn", "flux_qk_norm_rope")}
    assert all(s.by_user and "excluded by filter_fn" in s.reasons[0] for s in skipped.values())
    assert report.counts()["flux_qk_norm_rope"] == ldmopt.patch(models.flux().eval()).counts()["flux_qk_norm_rope"] - 1
    assert not hasattr(type(model.transformer_blocks[0].attn), "_ldmopt_base")  # still the stock class
    assert ldmopt.unpatch(model) == report.total


def test_hooks_are_left_stock_and_strict_raises():
    vae = models.vae().eval()
    hooked = vae.encoder.down_blocks[0].resnets[0].norm1
    hooked.register_forward_hook(lambda m, i, o: None)
    before = snapshot(vae)
    with pytest.raises(PatchError, match="forward hooks"):
        ldmopt.patch(vae, strict=True)
    assert_same_snapshot(before, snapshot(vae))  # strict refuses before changing anything

    report = ldmopt.patch(vae)
    # The resnet rule would bypass the hooked GroupNorm, and the GroupNorm rule would replace it: both stay stock.
    skipped = {(s.name, s.rule): s.reasons for s in report.skipped if "time_embedding_norm" not in s.reasons[0]}
    assert set(skipped) == {
        ("encoder.down_blocks.0.resnets.0", "resnet"),
        ("encoder.down_blocks.0.resnets.0.norm1", "group_norm"),
    }
    assert all("norm1 has forward hooks" in r[0] for r in skipped.values())
    assert vae.encoder.down_blocks[0].resnets[0].norm1 is hooked
    # The SiLU of conv_act has a hook: the head stays stock, its GroupNorm still gets the plain rule.
    vae2 = models.vae().eval()
    vae2.decoder.conv_act.register_forward_pre_hook(lambda m, a: None)
    report = ldmopt.patch(vae2)
    assert report.counts()["group_norm_silu"] == 1 and type(vae2.decoder.conv_act) is nn.SiLU
    assert any(s.rule == "group_norm_silu" and "decoder.conv_act" in s.reasons[0] for s in report.skipped)


def test_a_backward_hook_is_left_stock_and_still_fires():
    vae = models.vae().eval()
    calls = []
    vae.decoder.conv_norm_out.register_full_backward_hook(lambda module, grad_in, grad_out: calls.append(1))
    report = ldmopt.patch(vae, families=["group_norm"])
    reasons = [r for s in report.skipped if s.where == "decoder.conv_norm_out" for r in s.reasons]
    assert any("has backward hooks" in r for r in reasons), reasons
    assert type(vae.decoder.conv_norm_out) is nn.GroupNorm
    x = torch.randn(1, 4, 8, 8, requires_grad=True)
    vae.decode(x).sample.sum().backward()
    assert calls == [1]


def test_strict_does_not_count_what_filter_fn_excluded():
    vae = models.vae().eval()
    report = ldmopt.patch(vae, filter_fn=lambda module, name: "mid_block" not in name, strict=True)
    assert report.skipped and all(s.by_user and "mid_block" in s.name for s in report.skipped)
    assert report.replaced


def test_instance_forward_and_quantized_weights_are_left_stock():
    vae = models.vae().eval()
    gn = vae.encoder.mid_block.resnets[0].norm2
    # what accelerate's add_hook_to_module does: a new forward calling the old one (the bare `gn.forward = gn.forward`
    # that hook removal leaves behind is inert and gets patched)
    gn.forward = functools.partial(lambda old, *args, **kwargs: old(*args, **kwargs), gn.forward)
    q = vae.decoder.mid_block.resnets[0].norm1
    q.weight = nn.Parameter(torch.zeros(q.num_channels, dtype=torch.int8), requires_grad=False)
    report = ldmopt.patch(vae, families={"group_norm"})
    reasons = {s.name: s.reasons for s in report.skipped}
    assert "wrapped on the instance by functools.partial" in reasons["encoder.mid_block.resnets.0.norm2"][0]
    assert "torch.int8" in reasons["decoder.mid_block.resnets.0.norm1"][0]


def test_the_skip_reason_names_who_replaced_the_forward():
    from ldmopt.nn.temporal_layout import install_temporal_blocks, uninstall_temporal_blocks

    model = models.svd().eval()
    install = install_temporal_blocks(model)
    assert install.blocks
    report = ldmopt.patch(model)
    reasons = [r for s in report.skipped for r in s.reasons if "wrapped on the instance" in r]
    assert reasons and all("ldmopt.nn.temporal_layout.TemporalBlockBFNC" in r for r in reasons), reasons
    ldmopt.unpatch(model)
    uninstall_temporal_blocks(install)


def test_patch_after_compile_is_refused():
    unet = models.sd15_unet().eval()
    with pytest.raises(PatchError, match="patch first, then compile"):
        ldmopt.patch(torch.compile(unet))
    unet.down_blocks[0].compile()
    with pytest.raises(PatchError, match=r"down_blocks\.0 is already compiled"):
        ldmopt.patch(unet)


def test_rule_table_keyed_by_class():
    from diffusers.models.autoencoders.vae import Decoder, Encoder

    table = rule_table()
    assert [r.name for r in table[nn.GroupNorm]] == ["group_norm"]
    assert table[Encoder][0].name == table[Decoder][0].name == "group_norm_silu"
    for rules in table.values():
        for rule in rules:
            assert rule.family in ldmopt.patch.FAMILIES


def test_a_patched_model_dropped_without_unpatch_is_freed():
    # The registry of touched modules must not keep the model (and its weights) alive once the user drops it.
    import gc
    import weakref

    unet = models.sd15_unet().eval()
    report = ldmopt.patch(unet)
    assert report.total > 0
    alive = weakref.ref(unet)
    del unet, report
    gc.collect()
    assert alive() is None


def test_patched_unet_runs_on_meta_tensors():
    # Shape inference on the meta device (as the cost model does): the fused resnet's autocast query raised there.
    unet = models.sd15_unet().eval()
    inputs = {k: v.to("meta") if torch.is_tensor(v) else v for k, v in models.inputs("sd15", unet).items()}
    ldmopt.patch(unet)
    out = _run(unet.to("meta"), inputs)
    assert out.device.type == "meta" and out.shape == inputs["sample"].shape


@pytest.mark.parametrize("interruption", [OSError, KeyboardInterrupt])
def test_an_unpatch_interrupted_midway_can_be_finished(monkeypatch, interruption):
    """A restore that raises partway through unpatch (an error, Ctrl-C) leaves the modules not yet restored
    recorded: the model still says it is patched, and a second unpatch restores it exactly."""
    unet = models.sd15_unet().eval()
    x = models.inputs("sd15", unet)
    ref, before = _run(unet, x), snapshot(unet)
    resnet = next(r for r in rule_table()[type(unet.down_blocks[0].resnets[0])] if r.name == "resnet")
    total = ldmopt.patch(unet).total
    real_restore, restored = resnet.restore, []

    def restore_interrupted_once(site, data):
        restored.append(site.name)
        if len(restored) == 2:
            raise interruption("restore interrupted")
        real_restore(site, data)

    monkeypatch.setattr(resnet, "restore", restore_interrupted_once)
    with pytest.raises(interruption, match="restore interrupted"):
        ldmopt.unpatch(unet)
    assert is_patched(unet)
    monkeypatch.undo()
    assert ldmopt.unpatch(unet) < total  # what the first call restored is not undone twice
    assert not is_patched(unet)
    assert_same_snapshot(before, snapshot(unet))
    assert torch.equal(_run(unet, x), ref)


@pytest.mark.parametrize(
    "register",
    [
        "register_module_forward_hook",
        "register_module_forward_pre_hook",
        "register_module_full_backward_hook",
        "register_module_full_backward_pre_hook",
    ],
)
def test_a_global_module_hook_of_any_kind_keeps_every_module_stock(register):
    """torch's global module hooks run around every module call, which a fused forward would skip: with one of any
    of the four kinds registered, patch changes nothing and names the registry."""
    from torch.nn.modules import module as module_mod

    vae = models.vae().eval()
    handle = getattr(module_mod, register)(lambda *args: None)
    try:
        report = ldmopt.patch(vae)
    finally:
        handle.remove()
    assert report.total == 0 and report.skipped and not is_patched(vae)
    assert all("global module hooks are registered" in " ".join(s.reasons) for s in report.skipped)
    registry = "_global_" + register.removeprefix("register_module_").removeprefix("full_") + "s"
    assert all(registry in " ".join(s.reasons) for s in report.skipped)


def test_the_report_lists_each_op_call_that_fell_back_once():
    """A call that ran an op's reference backend counts every preferred backend's refusal; the printed report
    shows those calls once, with both reasons, instead of once per backend (which read as twice the calls)."""
    x = torch.randn(2, 8, 3, 3, dtype=torch.float64)  # fp64: the kernels refuse it, the reference runs
    report = ldmopt.patch(torch.nn.Sequential(torch.nn.GroupNorm(2, 8)))
    ldmopt.ops.group_norm(x, 2)
    ldmopt.ops.group_norm(x, 2)
    lines = [line for line in str(report).splitlines() if "group_norm ran the reference backend" in line]
    assert len(lines) == 1 and lines[0].split()[0] == "x2", str(report)
    assert "triton refused" in lines[0]
    assert sum(n for k, n in report.fallbacks().items() if k.startswith("group_norm ran")) >= 2  # the dict: per backend


def test_the_report_keeps_calls_with_different_refusals_apart():
    """Two kinds of calls that fell back as often as each other, for different reasons: one line each, each with its
    own call count and only its own reasons (not one line joining every reason of that count)."""
    report = ldmopt.patch(torch.nn.Sequential(torch.nn.GroupNorm(2, 8)))
    for dtype in (torch.float64, torch.bfloat16):  # the kernel refuses fp64; the interpreter's tl.dot, bf16
        x, w = torch.randn(5, 8, dtype=dtype), torch.randn(3, 8, dtype=dtype)
        for _ in range(3):
            ldmopt.ops.linear(x, w, None)
    lines = [line for line in str(report).splitlines() if " linear ran the reference backend" in line]
    assert len(lines) == 2, str(report)
    assert all(line.split()[0] == "x3" for line in lines), lines
    (fp64_line,) = [line for line in lines if "float64" in line]
    (bf16_line,) = [line for line in lines if "bf16" in line]
    assert "bf16" not in fp64_line and "float64" not in bf16_line, lines
