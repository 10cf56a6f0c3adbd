"""Shared checks for the patch tests: snapshots that unpatch must reproduce exactly, output comparison."""

from __future__ import annotations

import torch
from torch import nn

#: Patched (reference backend) vs stock outputs, fp32: max|a - b| <= ATOL + RTOL * max|b|. The reference backend
#: computes the same math in fp32 but in a different order (e.g. GroupNorm statistics), so only rounding differs.
ATOL, RTOL = 1e-4, 1e-4
#: Triton interpreter vs stock, fp32 (tl.dot accumulates in a different order).
ATOL_TRITON, RTOL_TRITON = 5e-4, 5e-4


def snapshot(model: nn.Module) -> dict:
    """Everything unpatch must restore: module tree (names, object ids, classes), instance forwards, attention
    processors, state_dict keys and values (cloned)."""
    tree = [(n, id(m), type(m), m.__dict__.get("forward")) for n, m in model.named_modules()]
    processors = {n: id(m.processor) for n, m in model.named_modules() if hasattr(m, "set_processor")}
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    params = {n: id(p) for n, p in model.named_parameters()}
    return {"tree": tree, "processors": processors, "state": state, "params": params}


def assert_same_snapshot(before: dict, after: dict) -> None:
    assert after["tree"] == before["tree"], "module tree, types or forwards differ after unpatch"
    assert after["processors"] == before["processors"], "attention processors differ after unpatch"
    assert after["params"] == before["params"], "parameter objects differ after unpatch"
    assert list(after["state"]) == list(before["state"]), "state_dict keys differ"
    for k, v in before["state"].items():
        assert torch.equal(after["state"][k], v), f"state_dict[{k!r}] changed"


def output_tensor(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, tuple):
        return out[0]
    return out.sample


def assert_outputs_close(actual: torch.Tensor, expected: torch.Tensor, atol=ATOL, rtol=RTOL, name="") -> None:
    assert actual.shape == expected.shape
    assert not torch.isnan(actual).any(), f"{name}: NaN in patched output"
    err = (actual.double() - expected.double()).abs().max().item()
    bound = atol + rtol * expected.double().abs().max().item()
    assert err <= bound, f"{name}: patched vs stock max error {err:.3e} > {bound:.3e}"


def assert_fused_grads_match_stock(
    module: nn.Module, call, inputs: list[torch.Tensor], rms_norm_calls: int, op: str = "rms_norm"
) -> None:
    """``call(module, *inputs)`` and the gradients of its inputs and all of ``module``'s parameters, stock and then
    patched for training on the Triton backend (fp32 tolerances), the fused path asserted: no fall-backs, and
    ldmopt's ``op`` kernel run ``rms_norm_calls`` times."""
    import ldmopt
    from tests.tolerances import assert_close

    def outputs():
        out = call(module, *inputs)
        return out if isinstance(out, tuple) else (out,)

    leaves = [*(t.requires_grad_() for t in inputs), *module.parameters()]
    names = [*(f"input {i}" for i in range(len(inputs))), *dict(module.named_parameters())]
    out = outputs()
    weights = [torch.randn_like(o) for o in out]
    expect = torch.autograd.grad(sum((o * w).sum() for o, w in zip(out, weights)), leaves)
    report = ldmopt.patch(module, training=True)
    with ldmopt.use_backend("triton"):
        fused = outputs()
    got = torch.autograd.grad(sum((o * w).sum() for o, w in zip(fused, weights)), leaves)
    assert not report.fallbacks() and report.backends()[op]["triton"] == rms_norm_calls, report.backends()
    for f, o in zip(fused, out):
        assert_close(f, o.detach().double(), torch.float32, "forward")
    for name, g, e in zip(names, got, expect):
        assert_close(g, e.double(), torch.float32, f"grad {name}")


def with_nontrivial_norms(model: nn.Module) -> nn.Module:
    """``model`` in eval mode with its query/key norm weights drawn around 1 (a norm of ones hides a wrong weight)
    and its zero-initialised layers (output projections, gates) drawn small, so no difference is hidden."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".norm_" in name and name.endswith("weight"):
                p.copy_(1 + 0.5 * torch.randn_like(p))
            elif not p.any():
                p.normal_(std=0.1)
    return model.eval()
