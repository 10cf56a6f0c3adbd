"""diffusers' ``set_default_attn_processor`` on models that received ldmopt's attention processors: it accepts only
its own processor classes, so the patched SVD / AnimateDiff / ModelScope UNets used to refuse it (ValueError naming
an innocent AttnProcessor2_0) where the stock models reset to AttnProcessor."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0

import ldmopt
from ldmopt.nn.temporal_attention import SingleKeyAttnProcessor, TemporalAttnProcessor
from ldmopt.patch.rule import FAMILIES
from tests.patch import models
from tests.patch.helpers import assert_outputs_close, output_tensor, snapshot

OURS = (TemporalAttnProcessor, SingleKeyAttnProcessor)


@pytest.fixture(autouse=True)
def _reference_backend():
    # The subject is which processors a model holds: the whole video UNets in the Triton interpreter cost minutes.
    with ldmopt.use_backend("torch"):
        yield


# AnimateDiff and ModelScope get the processors when their temporal blocks stay in diffusers' layout.
CASES = {
    "svd": {},
    "animatediff": {"families": set(FAMILIES) - {"temporal_layout"}},
    "modelscope": {"families": set(FAMILIES) - {"temporal_layout"}},
}


def _nontrivial(model):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))  # zero-initialised output projections too
    return model.eval()


def _run(model, family, seed):
    torch.manual_seed(seed)
    kwargs = models.inputs(family, model)
    with torch.no_grad():
        return output_tensor(model(**kwargs))


@pytest.mark.parametrize("family", list(CASES))
def test_set_default_attn_processor_resets_a_patched_model_as_the_stock_one(family):
    model = _nontrivial(getattr(models, family)())
    stock = copy.deepcopy(model)
    stock.set_default_attn_processor()
    ldmopt.patch(model, **CASES[family])
    assert any(isinstance(p, OURS) for p in model.attn_processors.values())
    model.set_default_attn_processor()
    assert {type(p) for p in model.attn_processors.values()} == {AttnProcessor}
    assert_outputs_close(_run(model, family, 1), _run(stock, family, 1), name=family)
    ldmopt.unpatch(model)
    assert "set_default_attn_processor" not in model.__dict__
    assert {type(p) for p in model.attn_processors.values()} == {AttnProcessor}  # the user's choice stays
    assert not ldmopt.is_patched(model)


def test_refused_as_diffusers_refuses_and_ldmopt_processors_stay():
    model = _nontrivial(models.svd())

    class Custom(AttnProcessor2_0):
        pass

    name = next(n for n, p in model.attn_processors.items() if "temporal" not in n and "attn1" in n)
    model.set_attn_processor({**model.attn_processors, name: Custom()})
    ldmopt.patch(model)
    before = dict(model.attn_processors)
    assert any(isinstance(p, OURS) for p in before.values())
    with pytest.raises(ValueError, match="set_default_attn_processor"):
        model.set_default_attn_processor()
    assert all(model.attn_processors[n] is p for n, p in before.items())


def test_unpatch_restores_the_class_method_and_copies_carry_their_own():
    model = _nontrivial(models.svd())
    before = snapshot(model)
    ldmopt.patch(model)
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        clone.set_default_attn_processor()  # resets the copy, not the original
        assert {type(p) for p in clone.attn_processors.values()} == {AttnProcessor}
        assert any(isinstance(p, OURS) for p in model.attn_processors.values())
    ldmopt.unpatch(model)
    assert "set_default_attn_processor" not in model.__dict__
    assert snapshot(model)["processors"] == before["processors"]
    model.set_default_attn_processor()  # diffusers' own method again
    assert {type(p) for p in model.attn_processors.values()} == {AttnProcessor}


@pytest.mark.parametrize("family", ["svd", "animatediff"])
def test_processors_recreated_by_class_after_patching_go_back_to_stock(family):
    """diffusers' IP-Adapter loading and unloading re-create every processor as ``p.__class__()``: new instances of
    ldmopt's classes on a patched model. Unpatched, the model runs the stock processors again (their default ones),
    is_patched agrees, and diffusers' own set_default_attn_processor works."""
    model = _nontrivial(getattr(models, family)())
    stock = copy.deepcopy(model)
    ldmopt.patch(model, **CASES[family])
    model.set_attn_processor({name: p.__class__() for name, p in model.attn_processors.items()})
    assert any(isinstance(p, OURS) for p in model.attn_processors.values())
    ldmopt.unpatch(model)
    assert not any(isinstance(p, OURS) for p in model.attn_processors.values())
    assert not ldmopt.is_patched(model)
    assert_outputs_close(_run(model, family, 2), _run(stock, family, 2), name=family)
    model.set_default_attn_processor()
    assert {type(p) for p in model.attn_processors.values()} == {AttnProcessor}


def test_patching_a_model_twice_keeps_one_method_and_unpatch_removes_it():
    model = _nontrivial(models.svd())
    ldmopt.patch(model, families={"svd_attn2"})
    method = model.__dict__["set_default_attn_processor"]
    ldmopt.patch(model)
    assert model.__dict__["set_default_attn_processor"] is method
    ldmopt.unpatch(model)
    assert "set_default_attn_processor" not in model.__dict__


def test_processors_installed_outside_patch_are_the_users():
    # ldmopt.nn.install_processors is a public API of its own: patch leaves its processors alone, and so must unpatch
    # and is_patched (they took them for the leftovers of a patched copy).
    from ldmopt.nn import install_processors

    model = _nontrivial(models.svd())
    installed = install_processors(model).installed
    assert installed and not ldmopt.is_patched(model) and ldmopt.unpatch(model) == 0
    report = ldmopt.patch(model, families={"group_norm"})
    assert ldmopt.unpatch(model) == report.total
    assert sum(isinstance(p, OURS) for p in model.attn_processors.values()) == len(installed)


def test_the_method_comes_with_processors_installed_by_earlier_patches_of_blocks():
    model = _nontrivial(models.svd())
    for block in (*model.down_blocks, model.mid_block, *model.up_blocks):
        ldmopt.patch(block)
    ldmopt.patch(model)  # installs no processor itself: its blocks' patches did
    model.set_default_attn_processor()
    assert {type(p) for p in model.attn_processors.values()} == {AttnProcessor}
    ldmopt.unpatch(model)
    assert "set_default_attn_processor" not in model.__dict__
