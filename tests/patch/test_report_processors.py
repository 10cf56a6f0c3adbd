"""A transformer block whose attention runs a processor the fused path does not mirror (a user's own class, not a
subclass of a stock one) is named at patch time among the modules with parts that run stock on every call
(``PatchReport.partly_stock``), with the reason the per-call count gives; ldmopt's own processors are not."""

import pytest
import torch
from diffusers.models.attention_processor import AttnProcessor2_0

import ldmopt
from ldmopt.patch import PatchError
from tests.patch import models
from tests.patch.helpers import assert_outputs_close, output_tensor

MIRRORED = "(mirrored: AttnProcessor2_0, FusedAttnProcessor2_0)"


class UserProcessor:
    """A processor of the user's own: it computes what AttnProcessor2_0 does, and subclasses nothing."""

    def __init__(self):
        self.inner = AttnProcessor2_0()

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None, **kwargs):
        return self.inner(attn, hidden_states, encoder_hidden_states, attention_mask, temb)


def _run(model, kwargs):
    with torch.no_grad(), ldmopt.use_backend("torch"):
        return output_tensor(model(**kwargs))


def _with_user_processors(model, where: str):
    """``model`` with UserProcessor on the attentions whose name contains ``where``; returns those blocks' names."""
    model.set_attn_processor({k: UserProcessor() if where in k else v for k, v in model.attn_processors.items()})
    return {n for n, m in model.named_modules() if type(m).__name__ == "BasicTransformerBlock" and where in n}


@pytest.mark.parametrize("family,rule", [("sd15", "residual_block"), ("pixart", "adaln_block")])
def test_a_user_processor_is_named_at_patch_time_and_counted_per_call(family, rule):
    model = {"sd15": models.sd15_unet, "pixart": models.pixart}[family]().eval()
    where = "down_blocks.0" if family == "sd15" else "transformer_blocks.0"
    blocks = _with_user_processors(model, where)
    assert blocks
    x = models.inputs(family, model)
    ref = _run(model, x)
    report = ldmopt.patch(model)
    partly = {r.name: r for r in report.partly_stock}
    assert set(partly) == blocks, (sorted(partly), blocks)  # each such block, and no other
    for r in partly.values():
        assert r.rule == rule
        assert f"attn1 runs UserProcessor {MIRRORED}" in r.stock_parts
    assert "with parts that run stock on every call" in str(report)
    assert_outputs_close(_run(model, x), ref)
    # The per-call count gives the same reason, once per such block and call.
    counted = {reason: n for reason, n in report.fallbacks().items() if "UserProcessor" in reason}
    assert counted and all(f"runs UserProcessor {MIRRORED}" in reason for reason in counted), report.fallbacks()
    ldmopt.unpatch(model)


def test_strict_refuses_a_block_whose_attention_runs_a_user_processor():
    unet = models.sd15_unet().eval()
    blocks = _with_user_processors(unet, "down_blocks.0")
    assert blocks
    with pytest.raises(PatchError, match=rf"{len(blocks)} fused modules would run parts stock") as raised:
        ldmopt.patch(unet, strict=True)
    assert f"attn2 runs UserProcessor {MIRRORED}" in str(raised.value)
    assert not ldmopt.is_patched(unet)


def test_ldmopt_processors_installed_first_are_not_stock_parts():
    # SVD's spatial attn2 with ldmopt's single-key shortcut: a fused path of its own, not a fall-back of the block's.
    model = models.svd().eval()
    assert any("attn2" in name for name in ldmopt.nn.install_processors(model).installed)
    report = ldmopt.patch(model)
    assert report.replaced and not report.partly_stock, [(r.where, r.stock_parts) for r in report.partly_stock]
