"""ldmopt._C's row kernels of the "cublas" placement (layer_norm_apply_cuda, linear_epilogue_cuda) as built: argument
checks through their Meta implementations, and the Python cuda backends' refusals against them, so that what the
C++ ops would reject goes to the Triton pass instead of raising on a GPU. Runs on CPU; skips without the build."""

import importlib
import re

import pytest
import torch

from ldmopt import _env

LOADED, LOAD_REASON = _env.cuda_extension_status()
pytestmark = pytest.mark.skipif(not LOADED, reason=f"ldmopt._C is not available: {LOAD_REASON}")

ln_apply = getattr(torch.ops.ldmopt, "layer_norm_apply_cuda", None)
epilogue = getattr(torch.ops.ldmopt, "linear_epilogue_cuda", None)


def meta(*shape, dtype=torch.float16):
    return torch.empty(shape, dtype=dtype, device="meta")


x = meta(5, 40)
stats = meta(2, 5, dtype=torch.float32)
z = meta(6, 40)
y = meta(6, 40)
zs = meta(2, 6, dtype=torch.float32)


def _halves(t):
    """The two column halves of t: views of one storage that do not overlap."""
    return t[:, : t.shape[1] // 2], t[:, t.shape[1] // 2 :]


BAD_INPUTS = [
    ("apply-rank", lambda: ln_apply(meta(2, 3, 4), stats, None, None, None, 1), RuntimeError,
     "ldmopt.layer_norm_apply_cuda: x must be a 2-D [rows, C] tensor, got shape [2, 3, 4]"),
    ("apply-dtype", lambda: ln_apply(meta(5, 40, dtype=torch.float64), stats, None, None, None, 1), TypeError,
     "x has dtype Double; supported: Float, Half, BFloat16"),
    ("apply-stride", lambda: ln_apply(meta(40, 5).t(), stats, None, None, None, 1), RuntimeError,
     "x must have unit column stride, got strides [1, 5] for shape [5, 40]"),
    ("apply-stats-shape", lambda: ln_apply(x, meta(2, 4, dtype=torch.float32), None, None, None, 1), RuntimeError,
     "stats must have shape [2, M] = [2, 5], got [2, 4]"),
    ("apply-stats-dtype", lambda: ln_apply(x, meta(2, 5), None, None, None, 1), TypeError,
     "stats has dtype Half; supported: Float (the row statistics)"),
    ("apply-weight", lambda: ln_apply(x, stats, meta(39), None, None, 1), RuntimeError,
     "weight must have shape [C] = [40], got [39]"),
    ("apply-bias-device", lambda: ln_apply(x, stats, None, torch.zeros(40), None, 1), RuntimeError,
     "bias is on cpu but x is on meta"),
    ("apply-positions", lambda: ln_apply(x, stats, None, None, meta(7, 32), 1), RuntimeError,
     "positions must have shape [P, C] with P >= 1 and C = 40, got [7, 32]"),
    ("apply-positions-dtype", lambda: ln_apply(x, stats, None, None, meta(7, 40, dtype=torch.float32), 1),
     TypeError, "positions has dtype Float; supported: x's dtype Half"),
    ("apply-position-rows", lambda: ln_apply(x, stats, None, None, meta(7, 40), 0), RuntimeError,
     "position_rows must be >= 1, got 0"),
    ("epi-rank", lambda: epilogue(meta(2, 3, 4), y, None, None, None, "", False, False, True, 1e-5), RuntimeError,
     "ldmopt.linear_epilogue_cuda: z must be a 2-D [M, N] GEMM output, got shape [2, 3, 4]"),
    ("epi-activation", lambda: epilogue(z, y, None, None, None, "relu", False, False, True, 1e-5), RuntimeError,
     "activation='relu' is not supported; supported: '' (none), 'silu', 'gelu', 'gelu_tanh'"),
    ("epi-glu", lambda: epilogue(meta(6, 80), y, None, None, None, "silu", True, False, True, 1e-5), RuntimeError,
     "glu=True takes activation 'gelu' and z of an even width [M, 2N], got activation='silu' and shape [6, 80]"),
    ("epi-y-shape", lambda: epilogue(meta(6, 80), meta(6, 80), None, None, None, "gelu", True, False, True, 1e-5),
     RuntimeError, "y must have shape [M, N] = [6, 40], got [6, 80]"),
    ("epi-y-dtype", lambda: epilogue(z, meta(6, 40, dtype=torch.float32), None, None, None, "", False, False, True,
                                     1e-5), TypeError, "y has dtype Float; supported: z's dtype Half"),
    ("epi-gate", lambda: epilogue(z, y, meta(4, 40), None, None, "", False, False, True, 1e-5), RuntimeError,
     "gate must have shape [B, N] with B dividing M = 6 and N = 40, got [4, 40]"),
    ("epi-gate-stride", lambda: epilogue(z, y, meta(80, 3).t()[:, :40], None, None, "", False, False, True, 1e-5),
     RuntimeError, "gate must have unit column stride"),
    ("epi-residual", lambda: epilogue(z, y, None, meta(4, 2, 40), None, "", False, False, True, 1e-5), RuntimeError,
     "residual must have shape [M, N] = [6, 40] or [B, T, N] with B * T = M, got [4, 2, 40]"),
    ("epi-stats", lambda: epilogue(z, y, None, None, meta(2, 6), "", False, False, True, 1e-5), TypeError,
     "stats has dtype Half; supported: Float"),
    ("epi-stats-only", lambda: epilogue(z, y, None, None, zs, "gelu", False, False, False, 1e-5), RuntimeError,
     "write=False only takes z's row statistics"),
    ("epi-alias", lambda: epilogue(*_halves(meta(6, 80)), None, None, None, "", False, False, True, 1e-5),
     RuntimeError, "y shares z's memory but is not z itself"),
    ("epi-eps", lambda: epilogue(z, y, None, None, zs, "", False, False, True, float("nan")), RuntimeError,
     "eps must be a finite number >= 0, got nan"),
]  # fmt: skip


@pytest.mark.parametrize("call,exc,message", [b[1:] for b in BAD_INPUTS], ids=[b[0] for b in BAD_INPUTS])
def test_bad_inputs_are_refused_with_the_reason(call, exc, message):
    with pytest.raises(exc, match=re.escape(message)):
        call()


def test_in_place_and_statistics_only_calls_are_accepted():
    epilogue(z, z, meta(3, 40), meta(2, 3, 40), zs, "gelu_tanh", False, True, True, 1e-5)  # in place
    epilogue(z, z, None, None, zs, "", False, False, False, 1e-5)  # only the statistics
    epilogue(meta(6, 80), y, None, None, None, "gelu", True, False, True, 1e-6)  # GEGLU
    ln_apply(x, stats, meta(40, dtype=torch.float32), meta(40), meta(3, 64)[:, :40], 2)


def _cpp_runs(call) -> bool:
    try:
        call()
        return True
    except (RuntimeError, TypeError):
        return False


APPLY_CASES = {
    "rows": (meta(5, 40), None, None),
    "slice of wider rows": (meta(5, 64)[:, :40], None, None),
    "column-strided": (meta(40, 5).t(), None, None),
    "fp32 affine of fp16 rows": (meta(5, 40), meta(40, dtype=torch.float32), None),
    "strided weight": (meta(5, 40), meta(80)[::2], None),
    "positions": (meta(5, 40), None, meta(3, 40)),
    "positions of another dtype": (meta(5, 40), None, meta(3, 40, dtype=torch.float32)),
    "column-strided positions": (meta(5, 40), None, meta(40, 3).t()),
    "fp64": (meta(5, 40, dtype=torch.float64), None, None),
}


@pytest.mark.parametrize("case", list(APPLY_CASES))
def test_layer_norm_apply_refusal_matches_what_the_cpp_op_refuses(case, monkeypatch):
    module = importlib.import_module("ldmopt.ops.layer_norm_apply")
    monkeypatch.setattr(module, "cuda_extension_refusals", lambda *args: [])  # as where the extension is built
    rows, weight, positions = APPLY_CASES[case]
    st = meta(2, rows.shape[0], dtype=torch.float32)
    refused = module.cuda_apply_refusals(rows, st, weight, None, positions, 1, rows.dtype)
    assert (not refused) == _cpp_runs(lambda: ln_apply(rows, st, weight, None, positions, 1)), (case, refused)
    assert module.cuda_apply_refusals(rows, st, None, None, None, 1, torch.float32 if rows.dtype != torch.float32
                                      else torch.float16), "another output dtype goes to triton"  # fmt: skip


EPILOGUE_CASES = {
    "plain": dict(),
    "gate and 2-D residual": dict(gate=meta(3, 120)[:, 40:80], residual=meta(6, 40)),
    "3-D residual": dict(residual=meta(2, 3, 40)),
    "fp32 gate of fp16 output": dict(gate=meta(3, 40, dtype=torch.float32)),
    "column-strided residual": dict(residual=meta(40, 6).t()),
    "column-strided z": dict(z=meta(40, 6).t()),
    "geglu": dict(z=meta(6, 80), glu=True, activation="gelu"),
    "silu GLU": dict(z=meta(6, 80), glu=True, activation="silu"),
    "statistics": dict(stats=True),
    "other output dtype": dict(dtype=torch.float32),
    "fp64": dict(z=meta(6, 40, dtype=torch.float64), dtype=torch.float64),
}


@pytest.mark.parametrize("case", list(EPILOGUE_CASES))
def test_linear_epilogue_refusal_matches_what_the_cpp_op_refuses(case, monkeypatch):
    module = importlib.import_module("ldmopt.ops.linear_epilogue")
    monkeypatch.setattr(module, "cuda_extension_refusals", lambda *args: [])  # as where the extension is built
    c = dict(z=meta(6, 40), gate=None, residual=None, activation="gelu_tanh", glu=False, stats=False, dtype=None)
    c.update(EPILOGUE_CASES[case])
    zz = c["z"]
    dtype = c["dtype"] or zz.dtype
    out_stats = meta(2, 6, dtype=torch.float32) if c["stats"] else None
    refused = module.cuda_refusals(zz, c["activation"], c["gate"], c["residual"], dtype, c["glu"], False, False,
                                   out_stats, 1e-5)  # fmt: skip
    out = meta(6, zz.shape[1] // 2 if c["glu"] else zz.shape[1], dtype=dtype)
    runs = _cpp_runs(lambda: epilogue(zz, out, c["gate"], c["residual"], out_stats, c["activation"], c["glu"], False,
                                      True, 1e-5))  # fmt: skip
    # the C++ op checks y's dtype against z's; the backend refuses another output dtype before allocating y
    assert (not refused) == runs, (case, refused)
