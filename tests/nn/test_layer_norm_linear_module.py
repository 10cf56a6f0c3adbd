"""ldmopt.nn.FusedLayerNormLinear against nn.LayerNorm -> nn.Linear (-> activation / GEGLU): forward and every
gradient in fp64 and the module dtype (Triton interpreter), parameter sharing, state_dict keys, compile."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ldmopt
from ldmopt.nn import FusedLayerNormLinear
from ldmopt.ops import layer_norm_stats
from tests.tolerances import assert_close, assert_within_torch_error


def _stock(layer: FusedLayerNormLinear, x: torch.Tensor) -> torch.Tensor:
    z = layer.proj(layer.norm(x))
    if layer.activation == "geglu":
        h, g = z.chunk(2, dim=-1)
        return h * F.gelu(g)
    acts = {None: lambda t: t, "gelu": F.gelu, "silu": F.silu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}
    return acts[layer.activation](z)


def _drawn(layer: FusedLayerNormLinear) -> FusedLayerNormLinear:
    with torch.no_grad():  # the norm's affine away from 1 / 0, so a dropped weight or bias shows
        if layer.norm.weight is not None:
            layer.norm.weight.copy_(1 + 0.4 * torch.randn_like(layer.norm.weight))
            layer.norm.bias.copy_(0.3 * torch.randn_like(layer.norm.bias))
    return layer


@pytest.mark.parametrize("activation", [None, "gelu_tanh", "geglu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_layer_norm_then_linear_forward_and_backward(activation, dtype):
    layer = _drawn(FusedLayerNormLinear(40, 24, activation=activation)).to(dtype)
    exact_layer = FusedLayerNormLinear(40, 24, activation=activation).double()
    exact_layer.load_state_dict(layer.state_dict())
    x = (torch.randn(2, 9, 40) + 0.5).to(dtype)
    dy = torch.randn(2, 9, 24, dtype=dtype)
    xs = [x.clone().requires_grad_() for _ in range(3)]
    with ldmopt.use_backend("triton"):
        out = layer(xs[0])
        out.backward(dy)
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad()
    lowp = _stock(layer, xs[1])
    lowp.backward(dy)
    expect = _stock(exact_layer, xs[2].double())
    expect.backward(dy.double())
    assert out.dtype == dtype and out.shape == (2, 9, 24)
    assert_within_torch_error(out, expect, lowp, f"forward {activation} {dtype}")
    assert_within_torch_error(xs[0].grad, xs[2].grad, xs[1].grad, f"dx {activation} {dtype}")
    for name, p in layer.named_parameters():
        want = exact_layer.get_parameter(name).grad
        assert_within_torch_error(grads[name], want, p.grad, f"d{name} {activation} {dtype}")


def test_state_dict_keys_and_shared_modules():
    layer = FusedLayerNormLinear(16, 8, activation="geglu", elementwise_affine=False, bias=False)
    assert list(layer.state_dict()) == ["proj.weight"] and layer.proj.out_features == 16
    norm, q, k = nn.LayerNorm(16), nn.Linear(16, 8), nn.Linear(16, 8, bias=False)
    fq, fk = FusedLayerNormLinear.from_modules(norm, q), FusedLayerNormLinear.from_modules(norm, k)
    assert fq.norm is norm and fq.proj is q and fk.norm is norm
    x = torch.randn(3, 5, 16)
    with ldmopt.use_backend("triton"):
        stats = layer_norm_stats(x, norm.eps)  # one statistics pass for both projections
        out_q, out_k = fq(x, stats=stats), fk(x, stats=stats)
    assert_close(out_q, q(norm(x)).double(), torch.float32, "q")
    assert_close(out_k, k(norm(x)).double(), torch.float32, "k")


@pytest.mark.parametrize(
    "norm,proj,activation,error,match",
    [
        (nn.LayerNorm((4, 8)), nn.Linear(8, 8), None, TypeError, "over one axis"),
        (nn.LayerNorm(8), nn.Linear(6, 8), None, TypeError, "in_features=8"),
        (nn.LayerNorm(8), nn.Linear(8, 7), "geglu", ValueError, "even proj.out_features"),
        (nn.LayerNorm(8), nn.Linear(8, 8), "relu", ValueError, "activation='relu' is not supported"),
    ],
)
def test_from_modules_refuses_what_it_cannot_fuse(norm, proj, activation, error, match):
    with pytest.raises(error, match=match):
        FusedLayerNormLinear.from_modules(norm, proj, activation)


def test_compiles_fullgraph_with_gradients():
    torch._dynamo.reset()
    layer = _drawn(FusedLayerNormLinear(24, 16, activation="silu"))
    x = torch.randn(2, 7, 24, requires_grad=True)
    out = torch.compile(layer, backend="aot_eager", fullgraph=True)(x)
    (dx,) = torch.autograd.grad(out.sum(), x)
    expect = _stock(layer, x)
    (want,) = torch.autograd.grad(expect.sum(), x)
    assert_close(out, expect.detach().double(), torch.float32, "compiled forward")
    assert_close(dx, want.double(), torch.float32, "compiled dx")


@pytest.mark.parametrize("activation", [None, "geglu"])
def test_lora_hooks_and_empty_inputs_run_the_submodules(activation):
    # The fused GEMM reads proj.weight: a LoRA added to proj afterwards (PEFT wraps it), a hook, or an empty batch
    # must run the submodules themselves, or the LoRA update is dropped and the hook skipped.
    from peft import LoraConfig, inject_adapter_in_model

    from ldmopt.nn import child_check

    layer = _drawn(FusedLayerNormLinear(16, 8, activation=activation)).double()
    holder = nn.Module()
    holder.ff = layer
    inject_adapter_in_model(LoraConfig(r=4, target_modules=["proj"], init_lora_weights=False), holder)
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    before = sum(n for k, n in child_check.fallback_reasons.items() if k.startswith("FusedLayerNormLinear"))
    y = layer(x)
    assert_close(y, _stock(layer, x), torch.float64, "with a LoRA on proj")
    lora_a = layer.proj.lora_A["default"].weight
    (grad,) = torch.autograd.grad(y.square().sum(), lora_a)
    assert grad.abs().max() > 0, "the LoRA weight got no gradient"
    after = sum(n for k, n in child_check.fallback_reasons.items() if k.startswith("FusedLayerNormLinear"))
    assert after == before + 1, "the stock call was not counted"

    plain = _drawn(FusedLayerNormLinear(16, 8, activation=activation)).double()
    seen = []
    plain.norm.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    assert_close(plain(x), _stock(plain, x), torch.float64, "with a hook on norm")
    assert seen, "the norm's hook did not run"
    assert plain(x[:0]).shape == (0, 5, 8)
