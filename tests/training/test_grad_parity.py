"""Gradient parity: one training step of a tiny random model, patched by ``ldmopt.patch(model, training=True)``
versus the stock model, gradient of every parameter compared.

Errors are measured against the same stock model run in float64, as Frobenius norms. Rules (the repository's
"2x PyTorch's own error", applied to gradients):
- whole gradient (all parameters as one vector): patched error <= 2 x the stock model's error in the same precision;
- each parameter tensor: patched error <= 16 x stock error + FLOOR x |grad| (FLOOR: 1e-5 fp32, 1e-3 under bf16
  autocast). Per tensor the factor is 16, not 2: it bounds the worst of ~400-800 ratios of two rounding-noise draws.
  Tiny AnimateDiff's mid-block attention to_q/to_k gradients come from cancelling terms (norms ~1e-6) and carry
  1e-5 relative fp32 error in the stock model too; over 50 draws the worst ratio there reached ~7 (e.g. 6.1e-11 vs
  1.0e-11), so a factor of 4 failed about one run in seven. A wrong backward (a missing term, the affine parameters
  left out of the SiLU derivative) errs by O(1) relative to the gradient, 1e4-1e5x the fp32 rounding error, and
  fails by far under either factor.

Covered: the zoo's tiny SD1.5, SDXL, DiT and AnimateDiff on the reference backend (channels-last, as on a GPU);
bf16 autocast; gradient checkpointing; torch.compile (aot_eager); a small UNet and the tiny DiT with every op forced
onto Triton under the interpreter. Models no ldmopt rule matches are skipped with that reason; modules that fall back
to the stock forward at run time turn the test into an XFAIL naming the reason (after the parity check), so the
tests grow with the patcher.
"""

from __future__ import annotations

import copy

import pytest
import torch

import ldmopt
from ldmopt import configs

FACTOR_TOTAL, FACTOR_TENSOR = 2.0, 16.0
FLOOR = {torch.float32: 1e-5, torch.bfloat16: 1e-3}


def _cast(value, dtype):
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(dtype)
    if isinstance(value, dict):
        return {k: _cast(v, dtype) for k, v in value.items()}
    return value


def _grads(model, kwargs, target, autocast_dtype=None, call=None):
    """(loss, {name: grad}) of one MSE step; ``call`` runs the forward instead of ``model`` (a compiled wrapper)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1234)  # stochastic layers (DiT's label drop in train mode) draw the same numbers every run
    ctx = torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype else torch.autocast("cpu", enabled=False)
    with ctx:
        out = (model if call is None else call)(**kwargs)[0]
    loss = torch.nn.functional.mse_loss(out.to(target.dtype), target)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _tiny(name: str):
    """The zoo's tiny model in train mode and channels-last, as a GPU training run holds it (the fused ResnetBlock2D
    path serves channels-last activations; NCHW runs diffusers' forward, which the fallback check would catch)."""
    model = configs.build_model(name, tiny=True, device="cpu", dtype=torch.float32).train()
    return model.to(memory_format=torch.channels_last)


def _inputs(name: str, model):
    inputs = configs.example_inputs(model)
    kwargs = {**inputs.kwargs, "return_dict": False}
    if kwargs.get("sample") is not None and kwargs["sample"].dim() == 4:
        kwargs["sample"] = kwargs["sample"].contiguous(memory_format=torch.channels_last)
    kwargs["timestep"] = torch.randint(0, 1000, kwargs["timestep"].shape)  # distinct noise levels per sample
    return kwargs


def assert_grad_parity(stock, run_patched, kwargs, autocast_dtype=None):
    """``run_patched(target) -> (loss, grads)`` against the stock model, both measured against it in float64."""
    ref = copy.deepcopy(stock).double()
    with torch.no_grad():
        target = torch.randn_like(ref(**_cast(kwargs, torch.float64))[0])
    ref_loss, ref_grads = _grads(ref, _cast(kwargs, torch.float64), target)
    stock_loss, stock_grads = _grads(stock, kwargs, target.float(), autocast_dtype)
    loss, grads = run_patched(target.float())
    floor = FLOOR[autocast_dtype or torch.float32]
    assert abs(loss - ref_loss) <= FACTOR_TOTAL * abs(stock_loss - ref_loss) + floor * ref_loss, (loss, stock_loss)
    assert grads.keys() == ref_grads.keys()
    worst, ours_sq, theirs_sq = [], 0.0, 0.0
    for name, g64 in ref_grads.items():
        assert (grads[name] is None) == (g64 is None), f"{name}: gradient presence differs from the stock model"
        if g64 is None:
            continue
        ours = (grads[name].double() - g64).norm().item()
        theirs = (stock_grads[name].double() - g64).norm().item()
        ours_sq, theirs_sq = ours_sq + ours**2, theirs_sq + theirs**2
        bound = FACTOR_TENSOR * theirs + floor * g64.norm().item() + 1e-30
        worst.append((ours / bound, name, ours, theirs))
    ratio, name, ours, theirs = max(worst)
    assert ratio <= 1.0, f"{name}: grad error {ours:.3e} vs stock {theirs:.3e} (worst of {len(worst)} tensors)"
    assert ours_sq**0.5 <= FACTOR_TOTAL * theirs_sq**0.5 + 1e-30, (ours_sq**0.5, theirs_sq**0.5)


def _check(name, model, kwargs, backend, autocast_dtype=None, checkpointing=False, compile_backend=None):
    """Patch a copy of ``model`` (training=True) and compare its gradients with the stock model's."""
    patched = copy.deepcopy(model)
    report = ldmopt.patch(patched, training=True)
    if report.total == 0:
        pytest.skip(f"ldmopt.patch has no rule for any module of the tiny {name} model yet")
    if checkpointing:
        patched.enable_gradient_checkpointing()
    runner = torch.compile(patched, backend=compile_backend) if compile_backend else patched

    def run_patched(target):
        with ldmopt.use_backend(backend):
            return _grads(patched, kwargs, target, autocast_dtype, call=runner)

    assert_grad_parity(model, run_patched, kwargs, autocast_dtype)
    if report.fallbacks():
        # Parity holds (checked above) but part of the model ran the stock forward: a gap of the fused path, shown
        # as XFAIL until the patcher serves these inputs, when the test passes by itself.
        pytest.xfail(f"gradients match, but patched modules fell back to the stock forward: {report.fallbacks()}")
    return report


@pytest.mark.parametrize("name", ["sd15", "sdxl", "dit", "animatediff"])
def test_grad_parity_reference_backend(name):
    model = _tiny(name)
    report = _check(name, model, _inputs(name, model), "torch")
    ran = report.backends()
    assert ran and all(set(b) == {"torch"} for b in ran.values()), ran


def test_grad_parity_bf16_autocast():
    model = _tiny("sd15")
    _check("sd15", model, _inputs("sd15", model), "torch", autocast_dtype=torch.bfloat16)


def test_grad_parity_gradient_checkpointing():
    model = _tiny("sd15")
    _check("sd15", model, _inputs("sd15", model), "torch", checkpointing=True)


# A model small enough for the Triton interpreter: every op runs as a Triton kernel on the CPU.
INTERPRETER_UNET = dict(
    sample_size=8, in_channels=4, out_channels=4, block_out_channels=(8, 16), layers_per_block=1, norm_num_groups=4,
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=8, attention_head_dim=4,
)  # fmt: skip


def _small_unet():
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(**INTERPRETER_UNET).train()


def _small_inputs():
    sample = torch.randn(1, 4, 8, 8).contiguous(memory_format=torch.channels_last)
    return dict(sample=sample, timestep=torch.tensor([321]),
                encoder_hidden_states=torch.randn(1, 3, 8), return_dict=False)  # fmt: skip


def test_grad_parity_torch_compile():
    _check("small-unet", _small_unet(), _small_inputs(), "torch", compile_backend="aot_eager")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["small-unet", "dit"])
def test_grad_parity_triton_interpreter(name):
    from ldmopt import _env

    if not _env.interpreter_enabled():
        pytest.skip("TRITON_INTERPRET=1 is not set (tests/conftest.py sets it)")
    if name == "dit":
        model = _tiny("dit")
        kwargs = _inputs("dit", model)
    else:
        # Channels-last, as training on a GPU runs it: the fused conv's Triton loader reads NHWC channel vectors.
        model, kwargs = _small_unet().to(memory_format=torch.channels_last), _small_inputs()
    report = _check(name, model, kwargs, "triton")
    ran = report.backends()
    assert ran and all(set(b) == {"triton"} for b in ran.values()), ran
