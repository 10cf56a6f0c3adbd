"""ldmopt._C's passes around cuBLAS's GEMM and cuDNN's conv (layer_norm_apply_cuda, linear_epilogue_cuda,
conv_epilogue_cuda) as built: argument checks through their Meta implementations, and the Python cuda backends'
refusals against them, so that what the C++ ops would reject goes to the Triton pass instead of raising on a GPU.
Runs on CPU; skips without the build."""

import importlib
import re

import pytest
import torch

from tests.csrc.test_extension import LOAD_REASON, LOADED, cpp_runs, meta

pytestmark = pytest.mark.skipif(not LOADED, reason=f"ldmopt._C is not available: {LOAD_REASON}")

ln_apply = getattr(torch.ops.ldmopt, "layer_norm_apply_cuda", None)
epilogue = getattr(torch.ops.ldmopt, "linear_epilogue_cuda", None)
conv_epi = getattr(torch.ops.ldmopt, "conv_epilogue_cuda", None)
from_sums = getattr(torch.ops.ldmopt, "group_norm_stats_from_sums_cuda", None)


def cl(*shape, dtype=torch.float16):
    """A channels-last [N, C, H, W] meta tensor (what cuDNN writes)."""
    return meta(*shape, dtype=dtype, channels_last=True)


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
    ("conv-rank", lambda: conv_epi(meta(2, 8, 9), None, None, None, None, 1.0, True, 0, False, 1e-5), RuntimeError,
     "ldmopt.conv_epilogue_cuda: z must be a 4-D [N, C, OH, OW] conv output, got shape [2, 8, 9]"),
    ("conv-layout", lambda: conv_epi(meta(2, 8, 3, 3), None, None, None, None, 1.0, True, 2, False, 1e-5), RuntimeError,
     "z must be channels-last (unit channel stride), got strides [72, 9, 3, 1]"),
    ("conv-pixel-rows", lambda: conv_epi(cl(2, 8, 4, 6)[..., :3], None, None, None, None, 1.0, True, 2, False, 1e-5),
     RuntimeError, "z must have its pixels at one stride (stride over H = W x stride over W), got strides "
     "[192, 1, 48, 8]"),
    ("conv-shortcut", lambda: conv_epi(cl(2, 8, 3, 3), cl(2, 8, 3, 4), None, None, None, 1.0, True, 0, False, 1e-5),
     RuntimeError, "shortcut must have z's shape [2, 8, 3, 3], got [2, 8, 3, 4]"),
    ("conv-residual-dtype", lambda: conv_epi(cl(2, 8, 3, 3), None, cl(2, 8, 3, 3, dtype=torch.float32), None,
                                             None, 1.0, True, 0, False, 1e-5), TypeError,
     "residual has dtype Float; supported: z's dtype Half"),
    ("conv-temb", lambda: conv_epi(cl(2, 8, 3, 3), None, None, meta(2, 8, 4), None, 1.0, True, 0, False, 1e-5),
     RuntimeError, "temb must have shape [N, C] = [2, 8] (one vector per image) or [N, C, OH] = [2, 8, 3] (one per "
     "output row), got [2, 8, 4]"),
    ("conv-gate-dtype", lambda: conv_epi(cl(2, 8, 3, 3), None, None, None, meta(2, 3), 1.0, True, 0, False, 1e-5),
     TypeError, "gate has dtype Half; supported: float32"),
    ("conv-gate-shape", lambda: conv_epi(cl(2, 8, 3, 3), None, None, None, meta(2, 2, dtype=torch.float32), 1.0,
                                         True, 0, False, 1e-5), RuntimeError,
     "gate must have shape [N, 1] or [N, OH] = [2, 3], got [2, 2]"),
    ("conv-groups", lambda: conv_epi(cl(2, 8, 3, 3), None, None, None, None, 1.0, True, 3, False, 1e-5), RuntimeError,
     "groups=3 must be 0 (none) or divide C=8"),
    ("conv-read-only", lambda: conv_epi(cl(2, 8, 3, 3), None, None, None, None, 0.5, False, 2, False, 1e-5),
     RuntimeError, "write=False only reads z (no shortcut, residual, temb or gate, inv_scale 1)"),
    ("conv-wide", lambda: conv_epi(cl(1, 8200, 1, 1), None, None, None, None, 1.0, True, 8, False, 1e-5), RuntimeError,
     "statistics of C=8200 channels are not supported; supported: C <= 8192"),
    ("conv-eps", lambda: conv_epi(cl(2, 8, 3, 3), None, None, None, None, 1.0, True, 2, False, -1.0), RuntimeError,
     "eps must be a finite number >= 0, got -1"),
    ("sums-shape", lambda: from_sums(meta(2, 8, 3, dtype=torch.float64), None, 4, 1e-5, 9, 1), RuntimeError,
     "ldmopt.group_norm_stats_from_sums_cuda: sums must be [N, C, 2] (per channel: the sum and the sum of squares)"),
    ("sums-dtype", lambda: from_sums(meta(2, 8, 2, dtype=torch.float32), None, 4, 1e-5, 9, 1), TypeError,
     "sums has dtype Float; supported: Double"),
    ("sums-groups", lambda: from_sums(meta(2, 8, 2, dtype=torch.float64), meta(2, 4, 2, dtype=torch.float64), 5,
                                      1e-5, 9, 1), RuntimeError, "num_groups=5 must be a positive divisor of the 12"),
    ("sums-frames", lambda: from_sums(meta(4, 8, 2, dtype=torch.float64), None, 4, 1e-5, 9, 3), RuntimeError,
     "frames=3 must be a positive divisor of the 4 images of sums"),
    ("sums-strided", lambda: from_sums(meta(2, 16, 2, dtype=torch.float64)[:, ::2], None, 4, 1e-5, 9, 1),
     RuntimeError, "sums must be contiguous"),
]  # fmt: skip


@pytest.mark.parametrize("call,exc,message", [b[1:] for b in BAD_INPUTS], ids=[b[0] for b in BAD_INPUTS])
def test_bad_inputs_are_refused_with_the_reason(call, exc, message):
    with pytest.raises(exc, match=re.escape(message)):
        call()


def test_conv_epilogue_outputs_have_the_statistics_shapes():
    mean, rstd, sums = conv_epi(
        cl(2, 8, 3, 3), cl(2, 8, 3, 3), cl(2, 8, 3, 3), meta(2, 8), None, 0.7, True, 4, True, 1e-6
    )
    assert mean.shape == rstd.shape == (2, 4) and mean.dtype == torch.float32
    assert sums.shape == (2, 8, 2) and sums.dtype == torch.float64
    mean, _, sums = conv_epi(cl(2, 8, 1, 1), None, None, None, None, 1.0, False, 0, False, 1e-6)  # nothing to do
    assert mean.shape == (2, 0) and sums.shape == (2, 0, 2)


def test_in_place_and_statistics_only_calls_are_accepted():
    epilogue(z, z, meta(3, 40), meta(2, 3, 40), zs, "gelu_tanh", False, True, True, 1e-5)  # in place
    epilogue(z, z, None, None, zs, "", False, False, False, 1e-5)  # only the statistics
    epilogue(meta(6, 80), y, None, None, None, "gelu", True, False, True, 1e-6)  # GEGLU
    ln_apply(x, stats, meta(40, dtype=torch.float32), meta(40), meta(3, 64)[:, :40], 2)


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
    assert (not refused) == cpp_runs(lambda: ln_apply(rows, st, weight, None, positions, 1)), (case, refused)
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
    runs = cpp_runs(lambda: epilogue(zz, out, c["gate"], c["residual"], out_stats, c["activation"], c["glu"], False,
                                      True, 1e-5))  # fmt: skip
    # the C++ op checks y's dtype against z's; the backend refuses another output dtype before allocating y
    assert (not refused) == runs, (case, refused)


CONV_CASES = {
    "conv1": dict(temb=meta(2, 8)),
    "conv2": dict(shortcut=cl(2, 8, 3, 3), residual=cl(2, 8, 3, 3)),
    "channel slice of a wider residual": dict(residual=cl(2, 12, 3, 3)[:, 2:10]),
    "NCHW residual": dict(residual=meta(2, 8, 3, 3)),
    "NCHW z": dict(z=meta(2, 8, 3, 3)),
    "every other column": dict(z=cl(2, 8, 3, 6)[..., ::2]),  # pixels still at one stride
    "a window of columns": dict(z=cl(2, 8, 4, 6)[..., :3]),
    "one row": dict(z=cl(2, 8, 1, 5)),
    "one column": dict(z=cl(2, 8, 5, 1)),
    "per-frame temb, channels strided": dict(temb=meta(2, 8, 3)),
    "per-frame temb, frames strided apart": dict(temb=meta(2, 3, 8).transpose(1, 2)),
    "per-frame temb of another frame count": dict(temb=meta(2, 8, 4)),
    "gate": dict(gate=meta(2, 1, dtype=torch.float32)),
    "per-frame gate": dict(gate=meta(2, 3, dtype=torch.float32), temb=meta(2, 3, 8).transpose(1, 2)),
    "fp16 gate": dict(gate=meta(2, 3)),
    "gate of another frame count": dict(gate=meta(2, 2, dtype=torch.float32)),
    "fp32 temb of fp16 z": dict(temb=meta(2, 8, dtype=torch.float32)),
    "resampled residual": dict(residual=cl(2, 8, 6, 6), residual_resample="up"),
    "residual of another size": dict(residual=cl(2, 8, 6, 6)),
    "temb of another batch": dict(temb=meta(1, 8)),
    "fp64": dict(z=cl(2, 8, 3, 3, dtype=torch.float64)),
}


@pytest.mark.parametrize("case", list(CONV_CASES))
def test_conv_epilogue_refusal_matches_what_the_cpp_op_refuses(case, monkeypatch):
    module = importlib.import_module("ldmopt.ops.conv_epilogue")
    monkeypatch.setattr(module, "cuda_extension_refusals", lambda *args: [])  # as where the extension is built
    c = dict(z=cl(2, 8, 3, 3), temb=None, gate=None, shortcut=None, residual=None, residual_resample="none",
             out_groups=4, out_layer_norm=False)  # fmt: skip
    c.update(CONV_CASES[case])
    refused = module.cuda_refusals(c["z"], c["temb"], c["gate"], c["shortcut"], c["residual"], c["residual_resample"],
                                   1.0, c["out_groups"], 1e-5, c["out_layer_norm"], False)  # fmt: skip
    runs = cpp_runs(lambda: conv_epi(c["z"], c["shortcut"], c["residual"], c["temb"], c["gate"], 1.0, True,
                                      c["out_groups"], False, 1e-5))  # fmt: skip
    # what the C++ op has no argument for (a resample, LayerNorm statistics) is refused before it is called
    only_python = c["residual_resample"] != "none" or c["out_layer_norm"]
    assert bool(refused) == (not runs or only_python), (case, refused)


def test_pixel_statistics_go_through_the_linear_epilogue_kernel(monkeypatch):
    """A proj_in handing only its pixels' LayerNorm statistics: the rows of a contiguous channels-last z through
    linear_epilogue_cuda's statistics-only call; anything more to add, or another layout, goes to the Triton pass."""
    module = importlib.import_module("ldmopt.ops.conv_epilogue")
    monkeypatch.setattr(module, "cuda_extension_refusals", lambda *args: [])
    z = cl(2, 8, 3, 3)

    def refused(z, **kw):
        c = {"temb": None, "gate": None, "shortcut": None, "residual": None, "output_scale": 1.0, **kw}
        return module.cuda_refusals(z, c["temb"], c["gate"], c["shortcut"], c["residual"], "none", c["output_scale"],
                                    0, 1e-5, True, False)  # fmt: skip

    assert not refused(z)
    rows = z.permute(0, 2, 3, 1).reshape(-1, 8)
    assert rows._base is not None or rows.data_ptr() == z.data_ptr()  # a view, no copy
    st = meta(2, 18, dtype=torch.float32)
    epilogue(rows, rows, None, None, st, "", False, False, False, 1e-5)  # what the backend calls: accepted
    assert refused(z, residual=cl(2, 8, 3, 3)) and refused(z, output_scale=2.0)
    assert refused(cl(2, 8, 4, 6)[..., :3]) and refused(meta(2, 8, 3, 3))


def test_statistics_from_sums_refusal_matches_what_the_cpp_op_refuses(monkeypatch):
    module = importlib.import_module("ldmopt.ops.group_norm_sums")
    monkeypatch.setattr(module, "cuda_extension_refusals", lambda *args: [])
    f64 = torch.float64
    cases = [
        (meta(4, 8, 2, dtype=f64), None),
        (meta(4, 8, 2, dtype=f64), meta(4, 16, 2, dtype=f64)),
        (meta(4, 16, 2, dtype=f64)[:, ::2], None),
        (meta(4, 8, 2, dtype=f64), meta(4, 32, 2, dtype=f64)[:, ::2]),
    ]
    for sums, tail in cases:
        refused = module.cuda_refusals(sums, 4, 1e-5, 9, tail, 2)
        assert (not refused) == cpp_runs(lambda s=sums, t=tail: from_sums(s, t, 4, 1e-5, 9, 2)), refused
