"""Whole patched models under the placements GPUs run by default. The fused conv's "cudnn"
(ops/gn_conv2d_prologue.py): every resnet, upsampler and downsampler conv is PyTorch's, between ldmopt's normalisation
pass and its epilogue pass, and the statistics hand-overs between blocks (channel sums for the up blocks' two-part
inputs, per-frame sums for video GroupNorms) come from the epilogue pass. The fused linear layers' "cublas"
(ops/linear_cublas.py): PyTorch's GEMM, then the epilogue pass. The model must still match stock."""

import pytest
import torch

import ldmopt
from ldmopt.ops import gn_conv2d_prologue as prologue
from tests.patch import models
from tests.patch.helpers import assert_outputs_close, output_tensor, triton_only_for

pytest.importorskip("diffusers")

pytestmark = pytest.mark.usefixtures("fresh_handover")


def _stock_and_patched(build, seed: int = 0, training: bool = False):
    """Two copies of ``build()`` with the same weights, in eval (or train) mode, the second patched."""
    torch.manual_seed(seed)
    stock, patched = build().train(training), build().train(training)
    patched.load_state_dict(stock.state_dict())
    ldmopt.patch(patched, training=training)
    return stock, patched


@pytest.mark.parametrize(
    ("family", "consumer"),
    [("sd15", "ResnetBlock2D.norm1"), ("svd", "TemporalResnetBlock.norm1")],
    ids=["sd15", "svd"],
)
def test_patched_model_matches_stock_with_statistics_from_the_epilogue_pass(family, consumer, fresh_handover,
                                                                             monkeypatch, triton_launches):  # fmt: skip
    monkeypatch.setenv(prologue.ENV, "cudnn")
    prologue.placement_counts.clear()
    stock, patched = _stock_and_patched(models.sd15_unet if family == "sd15" else models.svd)
    kw = models.inputs(family, stock, batch=1, frames=2)  # small: the interpreter runs every normalisation pass
    with torch.no_grad(), triton_only_for("gn_silu_conv2d"):
        expected = output_tensor(stock(**kw))
        patched(**kw)  # the first call teaches the producers which statistics their consumers want
        fresh_handover.handed_over.clear()
        triton_launches.clear()
        got = output_tensor(patched(**kw))
    assert_outputs_close(got, expected, name=f"{family}, cudnn placement")
    assert prologue.placement_counts["cudnn"] > 0 and set(prologue.placement_counts) == {"cudnn"}
    assert "_gn_conv2d_fwd_kernel" not in triton_launches and "_conv_epilogue_kernel" in triton_launches
    assert fresh_handover.handed_over[consumer] >= 2, dict(fresh_handover.handed_over)


@pytest.mark.parametrize("family", ["sd15", "pixart"])
def test_patched_model_matches_stock_with_cublas_gemms(family, monkeypatch, triton_launches):
    """What a GPU runs by default for the fused linear layers (ops/linear_cublas.py): PyTorch's GEMM, then the
    epilogue pass: GEGLU, the LayerNorm GEMMs (the norm applied by its own pass), the attention output projections'
    residual adds with the next norm's row statistics (SD1.5), the gated residuals of a DiT-style model (PixArt)."""
    from ldmopt.ops import linear_cublas

    monkeypatch.setenv(linear_cublas.ENV, "cublas")
    linear_cublas.placement_counts.clear()
    stock, patched = _stock_and_patched(models.sd15_unet if family == "sd15" else models.pixart)
    kw = models.inputs(family, stock, batch=1)
    with torch.no_grad(), triton_only_for("linear", "linear_stats", "geglu", "layer_norm_linear"):
        expected = output_tensor(stock(**kw))
        patched(**kw)
        triton_launches.clear()
        got = output_tensor(patched(**kw))
    assert_outputs_close(got, expected, name=f"{family}, cublas GEMMs")
    assert linear_cublas.placement_counts["cublas"] > 0 and set(linear_cublas.placement_counts) == {"cublas"}
    assert "_linear_epilogue_kernel" in triton_launches
    assert not {"_linear_fwd_kernel", "_geglu_fwd_kernel"} & set(triton_launches), triton_launches


@pytest.mark.parametrize("family", ["sd15", "pixart"])
def test_training_step_under_cublas_gemms_matches_stock_gradients(family, monkeypatch):
    """A training step of a model patched for training, its fused GEMMs under cublas (forward: PyTorch's GEMM and
    the epilogue pass; backward: the ops' own, from the GEMM's output kept as the pre-activation): the gradient of
    every parameter matches stock's, relative to its largest element."""
    from ldmopt.ops import linear_cublas

    monkeypatch.setenv(linear_cublas.ENV, "cublas")
    linear_cublas.placement_counts.clear()
    stock, patched = _stock_and_patched(models.sd15_unet if family == "sd15" else models.pixart, seed=1, training=True)
    kw = models.inputs(family, stock, batch=1)
    with triton_only_for("linear", "linear_stats", "geglu", "layer_norm_linear"):
        output_tensor(stock(**kw)).square().mean().backward()
        output_tensor(patched(**kw)).square().mean().backward()
    assert linear_cublas.placement_counts["cublas"] > 0 and set(linear_cublas.placement_counts) == {"cublas"}
    for (name, p_stock), p_patched in zip(stock.named_parameters(), patched.parameters()):
        if p_stock.grad is None:
            assert p_patched.grad is None or not p_patched.grad.any(), name
            continue
        err = (p_patched.grad.double() - p_stock.grad.double()).abs().max().item()
        assert err <= 1e-5 + 1e-4 * p_stock.grad.abs().max().item(), f"grad {name}: {err:.3e}"
