"""examples/train_ldm.py's resume of the optimizer: the moments take the resumed parameters' layout, and the run steps
the way this machine does (fused AdamW on GPUs), whatever the checkpoint's run did."""

from __future__ import annotations

import argparse
import copy
import importlib

import pytest
import torch

from .test_train_script import BASE, ROOT, _train_module


@pytest.fixture
def train_utils(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    return importlib.import_module("_train_utils")


def _trained_state(memory_format: torch.memory_format) -> tuple[torch.Tensor, dict]:
    """A conv weight in ``memory_format`` after two AdamW steps, and the optimizer's state_dict."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(6, 5, 3, 3).contiguous(memory_format=memory_format))
    optimizer = torch.optim.AdamW([weight], lr=1e-2, fused=True)
    for _ in range(2):
        weight.grad = torch.randn(6, 5, 3, 3).contiguous(memory_format=memory_format)
        optimizer.step()
    # A copy, as torch.save/torch.load make one: load_state_dict keeps tensors that need no cast, so optimizers
    # loading the same state_dict would share (and step) one set of moments.
    return weight.detach().clone(), copy.deepcopy(optimizer.state_dict())


@pytest.mark.parametrize("saved", [torch.channels_last, torch.contiguous_format])
def test_resumed_moments_take_the_parameters_layout(train_utils, saved):
    # Saved with --channels-last, resumed without (or the reverse): fused AdamW walks the parameter, its gradient and
    # its moments as flat memory, so moments in the other layout would update other elements, silently.
    resumed_format = torch.contiguous_format if saved == torch.channels_last else torch.channels_last
    values, state = _trained_state(saved)
    weight = torch.nn.Parameter(values.contiguous(memory_format=resumed_format))
    optimizer = torch.optim.AdamW([weight], lr=1e-2, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    checkpoint = {"optimizer": copy.deepcopy(state), "lr_scheduler": scheduler.state_dict(), "args": {}}
    args = argparse.Namespace(lr=1e-2, weight_decay=0.01, mixed_precision="no")
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    train_utils.restore_optimization(checkpoint, args, None, True, optimizer, scheduler, scaler, None, "ckpt")
    for moment in ("exp_avg", "exp_avg_sq"):
        assert optimizer.state[weight][moment].stride() == weight.stride(), moment

    reference = torch.nn.Parameter(values.clone())  # unfused, contiguous: the update element by element
    by_element = torch.optim.AdamW([reference], lr=1e-2, foreach=False)
    by_element.load_state_dict(copy.deepcopy(state))
    by_element.param_groups[0].update(fused=None, foreach=False)
    grad = torch.randn(6, 5, 3, 3)
    weight.grad, reference.grad = grad.contiguous(memory_format=resumed_format), grad.clone()
    optimizer.step()
    by_element.step()
    torch.testing.assert_close(weight.detach(), reference.detach(), rtol=1e-6, atol=1e-7)


def test_the_resumed_run_steps_as_this_machine_does(train_utils):
    # A GPU run's checkpoint says fused=True; resumed where this run chose otherwise, the saved flag must not win.
    _, state = _trained_state(torch.contiguous_format)
    assert state["param_groups"][0]["fused"] is True
    weight = torch.nn.Parameter(torch.randn(6, 5, 3, 3))
    optimizer = torch.optim.AdamW([weight], lr=1e-2, fused=None)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    checkpoint = {"optimizer": state, "lr_scheduler": scheduler.state_dict(), "args": {}}
    args = argparse.Namespace(lr=1e-2, weight_decay=0.01, mixed_precision="no")
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    train_utils.restore_optimization(checkpoint, args, None, True, optimizer, scheduler, scaler, None, "ckpt")
    assert optimizer.param_groups[0]["fused"] is None


def test_a_step_the_grad_scaler_skips_leaves_the_schedule(tmp_path, monkeypatch):
    # A scale so large that every fp16 backward overflows: the GradScaler skips each optimizer step and backs off.
    real = torch.amp.GradScaler
    monkeypatch.setattr(torch.amp, "GradScaler", lambda *a, **k: real(*a, init_scale=2.0**126, **k))
    argv = [*BASE, "--mixed-precision", "fp16", "--max-steps", "2", "--lr-scheduler", "linear", "--warmup-steps", "1",
            "--output-dir", str(tmp_path)]  # fmt: skip
    assert _train_module().main(argv)["step"] == 2
    state = torch.load(tmp_path / "checkpoints" / "step-00000002.pt", weights_only=False)
    assert state["scaler"]["scale"] == 2.0**124  # two skipped steps
    assert state["lr_scheduler"]["last_epoch"] == 0  # the warm-up has not begun: no weight changed yet
