"""Shared checks for the patch tests: snapshots that unpatch must reproduce exactly, output comparison."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

#: Patched (reference backend) vs stock outputs, fp32: max|a - b| <= ATOL + RTOL * max|b|. The reference backend
#: computes the same math in fp32 but in a different order (e.g. GroupNorm statistics), so only rounding differs.
ATOL, RTOL = 1e-4, 1e-4
#: Triton interpreter vs stock, fp32 (tl.dot accumulates in a different order).
ATOL_TRITON, RTOL_TRITON = 5e-4, 5e-4


@contextlib.contextmanager
def triton_only_for(*ops: str) -> Iterator[None]:
    """The Triton kernels (interpreted on CPU) for the ops named, the reference backend for every other op: a patch
    test exercises the kernels its subject feeds, not a whole model in the interpreter (which costs minutes)."""
    import ldmopt

    with ldmopt.use_backend("torch"), ldmopt.use_backend("triton", ops=ops):
        yield


class DispatchedOps(TorchDispatchMode):
    """Records each aten op a block of code dispatches: ``(overload packet name, shape of its first output)``."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, tuple | None]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        first = out[0] if isinstance(out, (tuple, list)) and out else out
        self.calls.append((str(func.overloadpacket), tuple(first.shape) if torch.is_tensor(first) else None))
        return out

    def shapes(self, name: str, min_dims: int = 0) -> list[tuple]:
        """Output shapes of the calls of aten op ``name`` (e.g. "aten.cat") with at least ``min_dims`` dims."""
        return [shape for op, shape in self.calls if op == name and shape is not None and len(shape) >= min_dims]


def snapshot(model: nn.Module) -> dict:
    """Everything unpatch must restore: module tree (names, object ids, classes), instance forwards, attention
    processors, state_dict keys and values (cloned), parameter objects and their strides (patch may re-lay out conv
    weights)."""
    tree = [(n, id(m), type(m), m.__dict__.get("forward")) for n, m in model.named_modules()]
    processors = {n: id(m.processor) for n, m in model.named_modules() if hasattr(m, "set_processor")}
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    params = {n: (id(p), p.stride()) for n, p in model.named_parameters()}
    return {"tree": tree, "processors": processors, "state": state, "params": params}


def assert_same_snapshot(before: dict, after: dict) -> None:
    assert after["tree"] == before["tree"], "module tree, types or forwards differ after unpatch"
    assert after["processors"] == before["processors"], "attention processors differ after unpatch"
    assert after["params"] == before["params"], "parameter objects or their strides differ after unpatch"
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
        # Relative to the gradient's largest element, not per element: a weight gradient sums over every token, and
        # summed in another order a small element of it moves by more than 2e-5 of itself (seed 18: 3.5e-5 at an
        # element of 0.54).
        err = (g.double() - e.double()).abs().max().item()
        bound = 2e-5 + 2e-5 * e.double().abs().max().item()
        assert not torch.isnan(g).any() and err <= bound, f"grad {name}: max error {err:.3e} > {bound:.3e}"


def with_nontrivial_norms(model: nn.Module) -> nn.Module:
    """``model`` in eval mode with its query/key norm weights drawn around 1 (a norm of ones hides a wrong weight)
    and its zero-initialised layers (output projections, gates) drawn small, so no difference is hidden."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".norm_" in f".{name}" and name.endswith("weight"):  # also a bare attention's own "norm_q.weight"
                p.copy_(1 + 0.5 * torch.randn_like(p))
            elif not p.any():
                p.normal_(std=0.1)
    return model.eval()
