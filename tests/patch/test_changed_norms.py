"""Norms that a fused path reads instead of calling, changed into something else: before patch (skipped with a
reason), after patch (the call runs stock, counted) or given diffusers' layerwise casting after patch (unpatch hands
the hooks to the modules it restores).

A quantizer that converts modules by exact class (NVIDIA ModelOpt swaps nn.LayerNorm's class for a QuantLayerNorm
that quantizes the norm's input) keeps the module object, its parameters and its state_dict keys: only the class
tells. ``_ShiftedNorm`` stands in for such a class: a subclass whose forward computes something else.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import ldmopt
from ldmopt import configs
from tests.patch import models
from tests.patch.helpers import assert_outputs_close, assert_same_snapshot, output_tensor, snapshot

_SHIFTED: dict[type, type] = {}


def _shift_class(module: nn.Module) -> None:
    """Swap ``module``'s class for a subclass whose output is the class's plus 0.5 (as a quantizer's swap would)."""
    cls = type(module)
    if cls not in _SHIFTED:
        _SHIFTED[cls] = type(f"Shifted{cls.__name__}", (cls,), {"forward": lambda self, x: cls.forward(self, x) + 0.5})
    module.__class__ = _SHIFTED[cls]


def _run(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return output_tensor(getattr(model, inputs.method)(**inputs.kwargs))


def _layer_norms(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if type(m) is nn.LayerNorm]


@pytest.mark.parametrize("name", ["flux", "sd3", "dit", "pixart-alpha"])
def test_norm_class_changed_after_patch_runs_stock(name):
    """Every adaLN block reads its LayerNorms in row kernels. A norm whose class changed after patch is called (the
    block's or the fused norm's stock path), with the reason counted, so the output is the stock model's."""
    torch.manual_seed(0)
    base = configs.build_model(name, device="cpu", dtype=torch.float32, tiny=True)
    inputs = configs.example_inputs(base)
    stock, patched = copy.deepcopy(base), copy.deepcopy(base)
    report = ldmopt.patch(patched)
    names = _layer_norms(stock)
    assert names
    for model in (stock, patched):
        for norm_name in names:
            _shift_class(model.get_submodule(norm_name))
    with ldmopt.use_backend("torch"):
        actual = _run(patched, inputs)
    expected = _run(stock, inputs)
    assert_outputs_close(actual, expected, name=f"{name} with shifted LayerNorms")
    reasons = "\n".join(report.fallbacks())
    assert "after patch" in reasons or "not torch's LayerNorm" in reasons, reasons


def test_norm_class_changed_before_patch_is_left_stock():
    """Flux with its adaLN norms already converted (a ModelOpt-quantized model): the fused norms are not installed
    there, the report says why, and the output is the stock model's."""
    torch.manual_seed(0)
    base = configs.build_model("flux", device="cpu", dtype=torch.float32, tiny=True)
    inputs = configs.example_inputs(base)
    for norm_name in _layer_norms(base):
        _shift_class(base.get_submodule(norm_name))
    patched = copy.deepcopy(base)
    report = ldmopt.patch(patched)
    skipped = "\n".join(r for s in report.skipped for r in s.reasons)
    assert "ShiftedLayerNorm" in skipped and "not torch's LayerNorm" in skipped, skipped
    assert "adaln_zero" not in report.counts() and "joint_block" not in report.counts(), report.counts()
    with ldmopt.use_backend("torch"):
        assert_outputs_close(_run(patched, inputs), _run(base, inputs), name="flux, converted norms")


def test_quantizer_packages_are_recognised_by_module():
    """Layers of quantization packages that keep a float weight (ModelOpt's QuantLinear keeps nn.Linear's) are told
    apart by their class's module."""
    from ldmopt.patch.guards import quantized_reason

    quant_linear = type("QuantLinear", (nn.Linear,), {"__module__": "modelopt.torch.opt.dynamic"})
    reason = quantized_reason("proj", quant_linear(4, 4))
    assert reason is not None and "modelopt.torch.opt.dynamic.QuantLinear" in reason, reason
    assert quantized_reason("proj", nn.Linear(4, 4)) is None


def _flux_bf16():
    torch.manual_seed(0)
    model = models.flux().eval().to(torch.bfloat16)
    return model, models.inputs("flux", model)


def _enable_fp8_storage(model: nn.Module) -> None:
    model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)


def test_layerwise_casting_enabled_while_patched_survives_unpatch():
    """``enable_layerwise_casting`` after patching Flux hooks ldmopt's fused proj_mlp (a Linear subclass). The patched
    model computes what the stock cast model does; unpatch puts the stock proj_mlp back with the same hooks, so the
    model is the stock model with layerwise casting (same modules, same output)."""
    stock, kwargs = _flux_bf16()
    patched = copy.deepcopy(stock)
    before = snapshot(patched)
    ldmopt.patch(patched)
    _enable_fp8_storage(stock)
    _enable_fp8_storage(patched)
    expected = output_tensor(stock(**kwargs))
    with ldmopt.use_backend("torch"):
        actual = output_tensor(patched(**kwargs))
    # bf16 compute: the fused epilogues round once where stock rounds after each op
    assert_outputs_close(actual.float(), expected.float(), atol=2e-2, rtol=2e-2, name="flux, fp8 storage")
    assert ldmopt.unpatch(patched) > 0
    assert not ldmopt.is_patched(patched)
    hooked = {n for n, m in patched.named_modules() if hasattr(m, "_diffusers_hook")}
    assert hooked == {n for n, m in stock.named_modules() if hasattr(m, "_diffusers_hook")}
    assert "single_transformer_blocks.0.proj_mlp" in hooked
    assert [(n, id(m)) for n, m in patched.named_modules()] == [(n, i) for n, i, _, _ in before["tree"]]
    assert [type(m) for m in patched.modules()] == [t for _, _, t, _ in before["tree"]]
    assert patched.state_dict().keys() == stock.state_dict().keys()
    assert torch.equal(output_tensor(patched(**kwargs)), expected)


def test_other_hooks_on_a_swapped_child_still_refuse_unpatch():
    """A hook diffusers cannot re-attach (here a forward hook beside the casting) on a fused child: unpatch refuses,
    naming the block and the child's attribute."""
    stock, _ = _flux_bf16()
    patched = copy.deepcopy(stock)
    ldmopt.patch(patched)
    _enable_fp8_storage(patched)
    patched.single_transformer_blocks[0].proj_mlp.register_forward_hook(lambda *a: None)
    with pytest.raises(ldmopt.patch.PatchError, match=r"single_transformer_blocks\.0: .*\(\.proj_mlp\) got hooks"):
        ldmopt.unpatch(patched)


def test_another_diffusers_hook_on_a_swapped_child_refuses_unpatch_unchanged():
    """A diffusers ModelHook that is not layerwise casting (which unpatch knows how to carry over) on a fused child:
    unpatch refuses before changing anything, the model still patched and whole."""
    from diffusers.hooks import HookRegistry, ModelHook

    model = models.flux().eval()
    ldmopt.patch(model)
    HookRegistry.check_if_exists_or_initialize(model.single_transformer_blocks[0].proj_mlp).register_hook(
        ModelHook(), "custom"
    )
    before = snapshot(model)
    with pytest.raises(ldmopt.patch.PatchError, match=r"single_transformer_blocks\.0: .*\(\.proj_mlp\) got hooks"):
        ldmopt.unpatch(model)
    assert ldmopt.is_patched(model)
    assert_same_snapshot(before, snapshot(model))


def test_unpatch_without_casting_is_exact():
    """The carried hooks are only diffusers' layerwise casting: a patched, uncast model unpatches to itself."""
    stock, _ = _flux_bf16()
    before = snapshot(stock)
    ldmopt.patch(stock)
    ldmopt.unpatch(stock)
    assert_same_snapshot(before, snapshot(stock))


def test_rms_norm_subclass_before_patch_is_left_stock():
    """HunyuanVideo's q/k RMSNorms converted before patch (a subclass of diffusers' RMSNorm): not fused."""
    from diffusers.models.normalization import RMSNorm

    from tests.patch.test_hunyuan_attention import _hunyuan, _inputs

    base = _hunyuan().eval()
    names = [n for n, m in base.named_modules() if type(m) is RMSNorm and n.rsplit(".", 1)[-1].startswith("norm_")]
    assert names
    for name in names:
        _shift_class(base.get_submodule(name))
    torch.manual_seed(1)
    inputs = _inputs()
    patched = copy.deepcopy(base)
    report = ldmopt.patch(patched)
    assert "hunyuan_video_qk_norm_rope" not in report.counts(), str(report)
    with torch.no_grad(), ldmopt.use_backend("torch"):
        assert_outputs_close(patched(**inputs)[0], base(**inputs)[0], name="HunyuanVideo, converted q/k norms")
