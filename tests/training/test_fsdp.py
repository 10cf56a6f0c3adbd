"""FSDP over patched models, in one process (gloo, world size 1: FSDP flattens, shards and gathers parameters as
with more ranks; the collectives are trivial). Patch before wrapping: FullyShardedDataParallel (FSDP1, with and
without use_orig_params) and fully_shard (FSDP2, per block and at the root) train the patched model like the stock
one through the fused path. ``patch`` refuses a model FSDP already shards, and ``unpatch`` one FSDP shards: FSDP
manages the parameters of ldmopt's modules, so the stock modules put back would compute with stale or sharded ones
(the state_dict, whose keys are the stock model's, goes into an unpatched model instead)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

import ldmopt
from ldmopt.patch import PatchError
from tests.patch import models

WRAPS = ["fsdp1", "fsdp1_orig_params", "fully_shard"]


@pytest.fixture(scope="module", autouse=True)
def process_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _wrap(model: torch.nn.Module, how: str) -> torch.nn.Module:
    if how == "fully_shard":
        for module in reversed(list(model.modules())):  # per block first, then the root (the usual recipe)
            if type(module).__name__ in ("ResnetBlock2D", "BasicTransformerBlock"):
                fully_shard(module)
        return fully_shard(model)
    return FullyShardedDataParallel(model, use_orig_params=how == "fsdp1_orig_params", device_id=torch.device("cpu"))


def _step(model: torch.nn.Module, call: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = (model(**call).sample ** 2).mean()
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), {n: g.full_tensor() if hasattr(g, "full_tensor") else g for n, g in grads.items()}


@pytest.mark.parametrize("how", WRAPS)
def test_patched_model_trains_like_stock_under_fsdp(how):
    torch.manual_seed(0)
    base = models.sd15_unet()
    call = models.inputs("sd15", base)
    stock = _wrap(copy.deepcopy(base), how)
    patched = copy.deepcopy(base)
    report = ldmopt.patch(patched, training=True)
    patched = _wrap(patched, how)
    with ldmopt.use_backend("torch"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # the second step after an optimizer update: FSDP's refreshed parameters are read
            expected_loss, expected = _step(stock, call)
            loss, grads = _step(patched, call)
            torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
            assert grads.keys() == expected.keys()
            for name, grad in grads.items():
                torch.testing.assert_close(grad, expected[name], rtol=1e-4, atol=1e-6, msg=name)
            for model in (stock, patched):
                torch.optim.SGD(model.parameters(), lr=0.1).step()
    # fully_shard warns when a block returns a view (in-place updates of it would skip its backward hooks): the
    # fused projections return their rows in the caller's shape as tensors of their own, as F.linear does.
    assert not [w for w in caught if "returned a view" in str(w.message)]
    assert "gn_conv2d" in report.backends(), report.backends()  # the fused path ran
    assert list(patched.state_dict()) == list(stock.state_dict())


@pytest.mark.parametrize("how", WRAPS)
def test_patch_refuses_a_model_fsdp_already_shards(how):
    model = _wrap(models.sd15_unet(), how)
    with pytest.raises(PatchError, match="patch the model before wrapping it"):
        ldmopt.patch(model, training=True)
    assert not ldmopt.is_patched(model)


@pytest.mark.parametrize("how", WRAPS)
def test_unpatch_refuses_under_fsdp(how):
    torch.manual_seed(0)
    model = models.sd15_unet()
    call = models.inputs("sd15", model)
    ldmopt.patch(model, training=True)
    model = _wrap(model, how)
    with torch.no_grad(), ldmopt.use_backend("torch"):
        before = model(**call).sample
    with pytest.raises(PatchError, match="is sharded by FSDP"):
        ldmopt.unpatch(model)
    if how != "fully_shard":
        with pytest.raises(PatchError, match="is sharded by FSDP"):
            ldmopt.unpatch(model.module)  # the module inside: its parameters are FSDP's flattened ones
    assert ldmopt.is_patched(model)
    with torch.no_grad(), ldmopt.use_backend("torch"):
        torch.testing.assert_close(model(**call).sample, before, rtol=0, atol=0)
