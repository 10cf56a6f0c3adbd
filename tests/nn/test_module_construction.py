"""The importable fused modules as drop-in replacements: built like the modules they replace (constructor arguments,
or from_module), same state_dict, and the stock result for an empty batch (the ops refuse empty inputs)."""

import pytest
import torch
import torch.nn.functional as F
from diffusers.models.activations import GEGLU, GELU
from diffusers.models.normalization import AdaLayerNormContinuous, AdaLayerNormZero, AdaLayerNormZeroSingle

import ldmopt
from ldmopt.nn import (
    FusedAdaLayerNormContinuous,
    FusedAdaLayerNormZero,
    FusedAdaLayerNormZeroSingle,
    FusedGEGLU,
    FusedGELU,
    FusedLinear,
    GroupNorm,
)
from ldmopt.nn.child_check import fallback_reasons
from tests.tolerances import assert_close


def _randomize(module: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 and "weight" in str(p.shape) else 0.0))
    return module


@pytest.mark.parametrize(
    "fused_cls, stock_cls, args, kwargs",
    [
        (FusedAdaLayerNormZero, AdaLayerNormZero, (12,), {}),
        (FusedAdaLayerNormZero, AdaLayerNormZero, (12, 7), {}),
        (FusedAdaLayerNormZeroSingle, AdaLayerNormZeroSingle, (12,), {}),
        (FusedAdaLayerNormContinuous, AdaLayerNormContinuous, (12, 10), {"elementwise_affine": False, "eps": 1e-6}),
    ],
)
def test_adaln_norms_take_diffusers_constructor_arguments(fused_cls, stock_cls, args, kwargs):
    torch.manual_seed(0)
    stock = _randomize(stock_cls(*args, **kwargs)).eval()  # eval: no random class-label dropout
    fused = fused_cls(*args, **kwargs).eval()
    assert list(fused.state_dict()) == list(stock.state_dict())
    fused.load_state_dict(stock.state_dict())
    x = torch.randn(2, 5, 12)
    if fused_cls is FusedAdaLayerNormContinuous:
        call = (x, torch.randn(2, 10))
    elif len(args) == 2:  # with class-label embeddings: (x, timestep, class_labels)
        call = (x, torch.tensor([3, 500]), torch.tensor([1, 6]))
    elif fused_cls is FusedAdaLayerNormZero:
        call = (x, None, None, None, torch.randn(2, 12))  # emb as given
    else:
        call = (x, torch.randn(2, 12))
    with ldmopt.use_backend("torch"), torch.no_grad():
        got, expected = fused(*call), stock(*call)
    as_tuple = lambda out: out if isinstance(out, tuple) else (out,)
    for g, e in zip(as_tuple(got), as_tuple(expected)):
        assert_close(g, e.double(), torch.float32, fused_cls.__name__)


def test_group_norm_takes_torch_keywords_and_checks_from_module_activation():
    plain = torch.nn.GroupNorm(3, 9, bias=False)
    ours = GroupNorm(3, 9, bias=False)
    assert list(ours.state_dict()) == list(plain.state_dict()) and ours.bias is None
    with pytest.raises(ValueError, match="activation='gelu' is not supported"):
        GroupNorm.from_module(plain, activation="gelu")
    # the wrong channel count is named as the module's setting (it said "weight must have shape (9,)")
    with pytest.raises(ValueError, match=r"GroupNorm\(num_groups=3, num_channels=9\) got an input of shape"):
        ours(torch.randn(2, 6, 3, 3))


@pytest.mark.parametrize(
    "make, stock_forward, shape",
    [
        (lambda: GroupNorm(3, 9, activation="silu"), lambda m, x: F.silu(F.group_norm(x, 3, m.weight, m.bias)),
         (0, 9, 5, 3)),
        (lambda: FusedLinear(7, 5, activation="gelu"), lambda m, x: F.gelu(F.linear(x, m.weight, m.bias)), (0, 7)),
        (lambda: FusedLinear(7, 5), lambda m, x: F.linear(x, m.weight, m.bias), (2, 0, 7)),
        (lambda: FusedGEGLU.from_module(GEGLU(7, 5)), lambda m, x: m.proj(x)[..., :5], (2, 0, 7)),
        (lambda: FusedGELU.from_module(GELU(7, 5)), lambda m, x: m.proj(x), (0, 7)),
    ],
)  # fmt: skip
def test_an_empty_batch_gives_the_stock_empty_result(make, stock_forward, shape):
    module = make()
    fallback_reasons.clear()
    x = torch.randn(shape, requires_grad=True)
    out = module(x)
    assert out.shape == stock_forward(module, x).shape
    out.sum().backward()
    assert x.grad.shape == x.shape and not fallback_reasons  # not a fall-back: nothing to compute


def test_from_module_refuses_modules_that_compute_something_else():
    # Same `proj` child, other computation: SwiGLU gates with SiLU, GELU/ApproximateGELU/LinearActivation are not
    # gated. Converting them would silently compute GEGLU (or GELU).
    from diffusers.models.activations import ApproximateGELU, LinearActivation, SwiGLU

    for module in (SwiGLU(6, 4), GELU(6, 4), ApproximateGELU(6, 4), LinearActivation(6, 4)):
        with pytest.raises(
            TypeError, match=f"FusedGEGLU.from_module: .*{type(module).__name__} is not diffusers' GEGLU"
        ):
            FusedGEGLU.from_module(module)
    for module in (GEGLU(6, 4), SwiGLU(6, 4), ApproximateGELU(6, 4)):
        expected = f"FusedGELU.from_module: .*{type(module).__name__} is not diffusers' GELU"
        with pytest.raises(TypeError, match=expected):
            FusedGELU.from_module(module)

    class ReGEGLU(GEGLU):  # a subclass that changes the gate's activation
        def gelu(self, gate):
            return F.relu(gate)

    with pytest.raises(TypeError, match=r"ReGEGLU overrides GEGLU\.gelu"):
        FusedGEGLU.from_module(ReGEGLU(6, 4))

    class Plain(GEGLU):  # a subclass that keeps the computation converts
        pass

    x = torch.randn(3, 6)
    stock = _randomize(Plain(6, 4))
    assert_close(FusedGEGLU.from_module(stock)(x), stock(x), torch.float32)
    again = FusedGEGLU.from_module(FusedGEGLU.from_module(stock))
    assert again.proj is stock.proj


def test_adaln_norm_width_mismatch_names_normalized_shape():
    # it said "scale must have shape (2, 8)": the modulation's shape, not the setting that disagrees with x
    module = FusedAdaLayerNormZeroSingle(12)
    with pytest.raises(ValueError, match=r"norm has normalized_shape=\[12\] but x has shape \(2, 5, 8\)"):
        module(torch.randn(2, 5, 8), torch.randn(2, 12))
