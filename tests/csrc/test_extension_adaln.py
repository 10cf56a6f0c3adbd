"""ldmopt._C's adaLN modulation forward (adaln_modulate_cuda) as built: argument checks through its Meta
implementation, the outputs it allocates, and the Python cuda backend's refusals against it, so that what the C++ op
would reject goes to the Triton kernel instead of raising on a GPU. Runs on CPU; skips without the build."""

import importlib
import re

import pytest
import torch

from tests.csrc.test_extension import LOAD_REASON, LOADED, cpp_runs, meta

pytestmark = pytest.mark.skipif(not LOADED, reason=f"ldmopt._C is not available: {LOAD_REASON}")

adaln = getattr(torch.ops.ldmopt, "adaln_modulate_cuda", None)
x = meta(6, 40)
per = meta(2, 40, dtype=torch.float32)

BAD_INPUTS = [
    ("rank", lambda: adaln(meta(2, 3, 40), per, per, None, None, 1e-6, False, False), RuntimeError,
     "ldmopt.adaln_modulate_cuda: x must be a 2-D [M, C] tensor of rows, got shape [2, 3, 40]"),
    ("dtype", lambda: adaln(meta(6, 40, dtype=torch.float64), per, per, None, None, 1e-6, False, False), TypeError,
     "ldmopt.adaln_modulate_cuda: x has dtype Double; supported: Float, Half, BFloat16"),
    ("columns", lambda: adaln(meta(6, 0), per[:, :0], per[:, :0], None, None, 1e-6, False, False), RuntimeError,
     "x has no columns (shape [6, 0])"),
    ("x-stride", lambda: adaln(meta(40, 6).t(), per, per, None, None, 1e-6, False, False), RuntimeError,
     "x must have unit column stride, got strides [1, 6] for shape [6, 40]"),
    ("scale-samples", lambda: adaln(x, meta(4, 40), meta(4, 40), None, None, 1e-6, False, False), RuntimeError,
     "scale must have shape [B, C] with B dividing M = 6 (as scale) and C = 40, got [4, 40]"),
    ("shift-shape", lambda: adaln(x, per, meta(3, 40), None, None, 1e-6, False, False), RuntimeError,
     "shift must have shape [B, C] with B dividing M = 6 (as scale) and C = 40, got [3, 40]"),
    ("scale-dtype", lambda: adaln(x, per.double(), per, None, None, 1e-6, False, False), TypeError,
     "scale has dtype Double; supported: Float, Half, BFloat16"),
    ("shift-stride", lambda: adaln(x, per, meta(40, 2).t(), None, None, 1e-6, False, False), RuntimeError,
     "shift must have unit column stride"),
    ("gate-without-residual", lambda: adaln(x, per, per, None, per, 1e-6, False, False), RuntimeError,
     "a gate needs a residual (the gated sum is residual + gate * x)"),
    ("residual-shape", lambda: adaln(x, per, per, meta(6, 41), None, 1e-6, False, False), RuntimeError,
     "residual must have x's shape [6, 40], got [6, 41]"),
    ("residual-dtype", lambda: adaln(x, per, per, meta(6, 40, dtype=torch.float32), per, 1e-6, True, False),
     TypeError, "residual has dtype Float but x has Half; they must match"),
    ("store-sum", lambda: adaln(x, per, per, None, None, 1e-6, True, False), RuntimeError,
     "store_sum needs a residual"),
    ("eps", lambda: adaln(x, per, per, None, None, float("nan"), False, False), RuntimeError,
     "eps must be a finite number >= 0, got nan"),
    ("device", lambda: adaln(x, torch.zeros(2, 40), per, None, None, 1e-6, False, False), RuntimeError,
     "scale is on cpu but x is on meta"),
]  # fmt: skip


@pytest.mark.parametrize("call,exc,message", [b[1:] for b in BAD_INPUTS], ids=[b[0] for b in BAD_INPUTS])
def test_bad_inputs_are_refused_with_the_reason(call, exc, message):
    with pytest.raises(exc, match=re.escape(message)):
        call()


def test_outputs_have_the_backends_shapes():
    """What the triton and torch backends return: y [M, C] in x's dtype, s [M, C] only when stored, fp32 statistics
    only when saved (empty otherwise)."""
    y, s, mean, rstd = adaln(x, per, per, meta(6, 40), per, 1e-6, True, True)
    assert y.shape == s.shape == (6, 40) and y.dtype == s.dtype == torch.float16 and y.is_contiguous()
    assert mean.shape == rstd.shape == (6,) and mean.dtype == torch.float32
    y, s, mean, rstd = adaln(x, per, per, None, None, 1e-6, False, False)
    assert y.shape == (6, 40) and s.numel() == mean.numel() == rstd.numel() == 0


CASES = {
    "plain": dict(),
    "residual, stored": dict(residual=meta(6, 40), store_sum=True),
    "gated": dict(residual=meta(6, 40), gate=per),
    "chunks of a modulation": dict(scale=meta(2, 240)[:, 40:80], shift=meta(2, 240)[:, 200:]),
    "one row per sample": dict(scale=meta(6, 40), shift=meta(6, 40)),
    "broadcast sample rows": dict(scale=meta(1, 40).expand(2, 40), shift=meta(1, 40).expand(2, 40)),
    "rows of wider rows": dict(x=meta(6, 64)[:, :40]),
    "column-strided x": dict(x=meta(40, 6).t()),
    "column-broadcast scale": dict(scale=meta(2, 1).expand(2, 40)),
    "column-strided residual": dict(residual=meta(40, 6).t()),
    "fp32 gated residual of fp16 rows": dict(residual=meta(6, 40, dtype=torch.float32), gate=per),
    "fp64 scale": dict(scale=meta(2, 40, dtype=torch.float64)),
    "fp64": dict(x=meta(6, 40, dtype=torch.float64)),
    "store_sum without a residual": dict(store_sum=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_adaln_refusal_matches_what_the_cpp_op_refuses(case, monkeypatch):
    module = importlib.import_module("ldmopt.ops.adaln_modulate")
    monkeypatch.setattr(module, "cuda_extension_refusals", lambda *args: [])  # as where the extension is built
    c = dict(x=x, scale=per, shift=per, residual=None, gate=None, store_sum=False)
    c.update(CASES[case])
    args = (c["x"], c["scale"], c["shift"], c["residual"], c["gate"], 1e-6, c["store_sum"], True)
    refused = module._cuda_refuse(*args)
    assert (not refused) == cpp_runs(lambda: adaln(*args)), (case, refused)
