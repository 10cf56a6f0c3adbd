"""ldmopt.ops.gn_conv2d: whose fp32 precision the products follow, and the kernel's autotuning of its statistics.

``fp32_precision="conv"`` follows PyTorch's convolution (TF32 by default), ``"matmul"`` its matmul (IEEE by default),
for a Linear read as a 1x1 conv. The interpreter ignores tl.dot's input_precision, so these tests check the decision:
the precision the launcher hands the kernel under each global setting, and that the reference and backward of
"matmul" run nn.Linear's GEMMs (which follow the matmul setting by themselves). Autotuning launches the kernel several
times per config: its statistics workspace and counters must be zeroed before each launch and the launch after.
"""

import pytest
import torch
import torch.nn.functional as F
from ldmopt.kernels import _common
from ldmopt.kernels import gn_conv2d as kernels
from torch.utils._python_dispatch import TorchDispatchMode

import ldmopt
from ldmopt.ops.gn_conv2d import gn_silu_conv2d
from tests.tolerances import assert_close

_B = torch.backends
_NEW_API = hasattr(_B.cudnn, "conv") and hasattr(_B, "fp32_precision")


def _new_api_settings() -> dict:
    objects = {"all": _B, "cuda.matmul": _B.cuda.matmul, "cudnn": _B.cudnn, "cudnn.conv": _B.cudnn.conv,
               "cudnn.rnn": _B.cudnn.rnn}  # fmt: skip
    return {name: (obj, obj.fp32_precision) for name, obj in objects.items()} if _NEW_API else {}


@pytest.fixture(autouse=True)
def _restore_fp32_settings():
    """The tests change PyTorch's global TF32 settings: put them back, legacy flags first (their setters also set the
    new per-op ones), then the per-op settings that still differ."""
    legacy = (torch.get_float32_matmul_precision(), _B.cudnn.allow_tf32)
    new = _new_api_settings()
    yield
    torch.set_float32_matmul_precision(legacy[0])
    _B.cudnn.allow_tf32 = legacy[1]
    for obj, value in new.values():
        if obj.fp32_precision != value:
            obj.fp32_precision = value
    assert (torch.get_float32_matmul_precision(), _B.cudnn.allow_tf32) == legacy
    assert {k: v for k, (_, v) in _new_api_settings().items()} == {k: v for k, (_, v) in new.items()}


def _set(statements: str) -> None:
    exec(statements, {"torch": torch})


# (statements, (conv, matmul) precision PyTorch's fp32 ops then use on a GPU)
SETTINGS = {
    "default": ("", ("tf32", "ieee")),
    "matmul_high": ("torch.set_float32_matmul_precision('high')", ("tf32", "tf32")),
    "matmul_medium": ("torch.set_float32_matmul_precision('medium')", ("tf32", "tf32")),
    "matmul_allow_tf32": ("torch.backends.cuda.matmul.allow_tf32 = True", ("tf32", "tf32")),
    "cudnn_no_tf32": ("torch.backends.cudnn.allow_tf32 = False", ("ieee", "ieee")),
    "cudnn_no_tf32_matmul_high": (
        "torch.backends.cudnn.allow_tf32 = False; torch.set_float32_matmul_precision('high')",
        ("ieee", "tf32"),
    ),
    # The per-op API: the legacy getters (cudnn.allow_tf32, get_float32_matmul_precision) raise after these.
    "new_matmul_tf32": ("torch.backends.cuda.matmul.fp32_precision = 'tf32'", ("tf32", "tf32")),
    "new_conv_ieee": ("torch.backends.cudnn.conv.fp32_precision = 'ieee'", ("ieee", "ieee")),
    "new_all_tf32": ("torch.backends.fp32_precision = 'tf32'", ("tf32", "tf32")),
}
NEEDS_NEW_API = {"new_matmul_tf32", "new_conv_ieee", "new_all_tf32"}


def _setting(name: str) -> tuple[str, str]:
    if name in NEEDS_NEW_API and not _NEW_API:
        pytest.skip("torch without the per-op fp32_precision settings")
    statements, expected = SETTINGS[name]
    _set(statements)
    return expected


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_torch_fp32_precision_follows_each_setting(setting):
    conv, matmul = _setting(setting)
    assert _common.torch_fp32_precision("conv") == conv
    assert _common.torch_fp32_precision("matmul") == matmul
    assert _common.fp32_dot_precision(torch.float32, "matmul") == matmul
    for dtype in (torch.float16, torch.bfloat16):  # tl.dot ignores it there
        assert _common.fp32_dot_precision(dtype, "matmul") == "tf32"


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_linear_and_geglu_kernels_follow_the_matmul_setting(setting):
    """kernels/linear.py (and geglu, which uses it) asked torch.get_float32_matmul_precision(), which raises once the
    per-op API has been used."""
    from ldmopt.kernels._gemm import input_precision

    _, matmul = _setting(setting)
    assert input_precision(torch.float32) == matmul
    assert input_precision(torch.float16) == "tf32"


class _LaunchRecorder:
    """Stands in for the autotuned kernel: records the keyword arguments of each launch (outputs stay unwritten)."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append(kwargs)


def _pointwise_inputs(dtype=torch.float32):
    x = torch.randn(2, 8, 3, 5, dtype=dtype).contiguous(memory_format=torch.channels_last)
    gw, gb = torch.randn(8, dtype=dtype) * 0.5 + 1.0, torch.randn(8, dtype=dtype) * 0.5
    w, b = torch.randn(6, 8, 1, 1, dtype=dtype) * 0.3, torch.randn(6, dtype=dtype) * 0.3
    return x, gw, gb, w, b


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_launcher_passes_the_precision_of_the_followed_op(monkeypatch, setting, dtype):
    expected = dict(zip(("conv", "matmul"), _setting(setting)))
    recorder = _LaunchRecorder()
    monkeypatch.setattr(kernels, "_gn_conv2d_fwd_kernel", recorder)
    x, _, _, w, b = _pointwise_inputs(dtype)
    common = (None, None, None, None, w, b, None, None, None, None, None, None, 0, None, 1, (0, 0), "none", "none",
              "none", 1.0, 0, 0.0)  # fmt: skip
    kernels.gn_conv2d_fwd(x, *common)  # the default: PyTorch's convolution
    for follow in ("conv", "matmul"):
        kernels.gn_conv2d_fwd(x, *common, fp32_precision=follow)
    got = [launch["DOT_PRECISION"] for launch in recorder.launches]
    if dtype == torch.float32:
        assert got == [expected["conv"], expected["conv"], expected["matmul"]]
    else:
        assert got == ["tf32"] * 3


@pytest.mark.parametrize("setting", ["default", "cudnn_no_tf32_matmul_high"])
def test_op_threads_fp32_precision_to_the_kernel(monkeypatch, setting):
    # The Linear-derived proj_in: stock nn.Linear runs IEEE fp32 by default where a conv runs TF32.
    expected = dict(zip(("conv", "matmul"), _setting(setting)))
    recorder = _LaunchRecorder()
    monkeypatch.setattr(kernels, "_gn_conv2d_fwd_kernel", recorder)
    x, gw, gb, w, b = _pointwise_inputs()
    for follow in ("conv", "matmul"):
        with ldmopt.use_backend("triton", ops=["gn_conv2d"]):
            gn_silu_conv2d(x, gw, gb, 4, 1e-5, w, b, 1, 0, activation=None, fp32_precision=follow)
    assert [launch["DOT_PRECISION"] for launch in recorder.launches] == [expected["conv"], expected["matmul"]]


def test_bad_fp32_precision_messages():
    x, gw, gb, w, b = _pointwise_inputs()
    with pytest.raises(ValueError, match=r"fp32_precision='tf32' is not supported; expected one of \['conv', 'matmul"):
        gn_silu_conv2d(x, gw, gb, 4, 1e-5, w, b, 1, 0, fp32_precision="tf32")
    w3 = torch.randn(6, 8, 3, 3)
    with pytest.raises(ValueError, match=r"fp32_precision='matmul' is for a Linear read as a 1x1 conv .* got kernel "):
        gn_silu_conv2d(x, gw, gb, 4, 1e-5, w3, b, 1, 1, fp32_precision="matmul")
    with pytest.raises(ValueError, match=r"'none'\); got kernel \(1, 1\), stride 1, padding \(0, 0\), resample 'up'"):
        gn_silu_conv2d(x, gw, gb, 4, 1e-5, w, b, 1, 0, resample="up", fp32_precision="matmul")
    # The op itself checks too (callable through torch.ops): its reference and backward would run GEMMs.
    mean, rstd = torch.ops.ldmopt.gn_conv2d_stats(x, 4, 1e-5)
    args = (x, mean, rstd, gw, gb, w3, b, None, None, None, None, None, None, 4, "silu", 1, [1, 1], "none", "none",
            "none", 1.0, 0, 0.0, None, None)  # fmt: skip
    with pytest.raises(ValueError, match="fp32_precision='matmul' is for a Linear"):
        torch.ops.ldmopt.gn_conv2d(*args, "matmul")
    with pytest.raises(ValueError, match="fp32_precision='ieee' is not supported"):
        torch.ops.ldmopt.gn_conv2d(*args, "ieee")
    with pytest.raises(ValueError, match="fp32_precision='linear' is not supported"):
        _common.torch_fp32_precision("linear")


@pytest.mark.parametrize("follow", ["conv", "matmul"])
def test_opcheck_with_fp32_precision(follow):
    x, gw, gb, w, b = _pointwise_inputs()
    sx, sw = torch.randn(2, 5, 3, 5).contiguous(memory_format=torch.channels_last), torch.randn(6, 5, 1, 1) * 0.3
    mean, rstd = torch.ops.ldmopt.gn_conv2d_stats(x, 4, 1e-5)
    args = (x.requires_grad_(), mean, rstd, gw, gb, w.requires_grad_(), b, None, None, sx.requires_grad_(), sw, None,
            None, 4, "", 1, [0, 0], "none", "none", "none", 1.0, 3, 1e-5, None, None, follow)  # fmt: skip
    torch.library.opcheck(torch.ops.ldmopt.gn_conv2d, args)


class _AtenOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def _block(dtype):
    """A Linear-derived proj_in with everything a caller may add: temb, a shortcut, a per-row gate, a residual."""
    x, gw, gb, w, b = (t.to(dtype) for t in _pointwise_inputs())
    sx = torch.randn(2, 5, 3, 5, dtype=dtype).contiguous(memory_format=torch.channels_last)
    sw, temb, gate = torch.randn(6, 5, 1, 1, dtype=dtype) * 0.3, torch.randn(2, 6, dtype=dtype), torch.rand(2, 3)
    res = torch.randn(2, 6, 3, 5, dtype=dtype)
    return [x, gw, gb, w, b, sx, sw, temb, gate.to(dtype), res]


def _run_block(follow, x, gw, gb, w, b, sx, sw, temb, gate, res):
    return gn_silu_conv2d(x, gw, gb, 4, 1e-5, w, b, 1, 0, temb=temb, shortcut=(sx, sw, None), gate=gate,
                          residual=res, output_scale=2.0, fp32_precision=follow)  # fmt: skip


def test_matmul_reference_and_backward_run_linear_gemms(monkeypatch):
    """'matmul': the reference and backward run nn.Linear's GEMMs, never a convolution, so their fp32 products follow
    the matmul setting as nn.Linear's do (also under torch.compile, where they are traced as mm); the results equal
    the convolution's (fp64: to rounding)."""
    grads, block = {}, _block(torch.float64)
    for follow in ("conv", "matmul"):
        leaves = [t.clone().requires_grad_() for t in block]
        ops = _AtenOps()
        with ldmopt.use_backend("torch"):
            if follow == "matmul":
                with monkeypatch.context() as m:
                    m.setattr(F, "conv2d", lambda *a, **k: pytest.fail("a convolution ran in the matmul forward"))
                    y = _run_block(follow, *leaves)
            else:
                y = _run_block(follow, *leaves)
            with ops:
                (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)).sum().backward()
        assert ("aten.convolution_backward" in ops.names) == (follow == "conv"), ops.names
        assert ("aten.convolution" in ops.names) == (follow == "conv"), ops.names  # the gate's recomputed conv
        assert ("aten.mm" in ops.names) == (follow == "matmul"), ops.names
        grads[follow] = (y.detach(), [t.grad for t in leaves])
    torch.testing.assert_close(grads["matmul"][0], grads["conv"][0], rtol=1e-12, atol=1e-12)
    for got, want in zip(grads["matmul"][1], grads["conv"][1]):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_matmul_gradcheck_and_compiled_backward():
    leaves = [t.requires_grad_() for t in _block(torch.float64)]
    with ldmopt.use_backend("torch"):
        assert torch.autograd.gradcheck(lambda *a: _run_block("matmul", *a), leaves, fast_mode=True)
    torch._dynamo.reset()
    inputs = [t.detach().float().requires_grad_() for t in leaves]
    compiled = torch.compile(lambda *a: _run_block("matmul", *a), fullgraph=True, backend="aot_eager")
    out = compiled(*inputs)
    out.square().sum().backward()
    got = [t.grad for t in inputs]
    for t in inputs:
        t.grad = None
    ref = _run_block("matmul", *inputs)
    ref.square().sum().backward()
    assert_close(out, ref.double(), torch.float32, "compiled y")
    for name, g, t in zip(["x", "gw", "gb", "w", "b", "sx", "sw", "temb", "gate", "res"], got, inputs):
        assert_close(g, t.grad.double(), torch.float32, f"compiled d{name}")


# --------------------------------------------------------------------------------------- autotuning the statistics


def _poison(tensors) -> None:
    for t in tensors:
        t.fill_(float("nan"))


def _tune_with_two_configs(monkeypatch, launches_per_config=3):
    """Make the kernel's autotuner benchmark two interpreter-sized configs (tiles small enough for several programs
    per image), each launched ``launches_per_config`` times, then launch the faster, as on a GPU. Returns the
    autotuner, the configs and the output means each benchmark launch wrote (the outputs are poisoned before each,
    and after the last, so the statistics the caller gets are the last launch's own)."""
    tuner = kernels._gn_conv2d_fwd_kernel
    configs = [triton_config(16, 16, 16), triton_config(32, 16, 16)]
    timings = iter([[2.0] * 3, [1.0] * 3])
    bench_means = []

    def do_bench(kernel_call, quantiles):
        stats = (tuner.nargs["out_mean_ptr"], tuner.nargs["out_rstd_ptr"])
        for _ in range(launches_per_config):
            _poison(stats)
            kernel_call()
            bench_means.append(stats[0].clone())
        _poison(stats)
        return next(timings)

    monkeypatch.setattr(tuner, "configs", configs)
    monkeypatch.setattr(tuner, "cache", {})
    monkeypatch.setitem(tuner.__dict__, "do_bench", do_bench)
    return tuner, configs, bench_means


def triton_config(bm, bn, bk):
    import triton

    return triton.Config({"BM": bm, "BN": bn, "BK": bk}, num_warps=4, num_stages=1)


def test_autotuning_leaves_the_output_statistics_right(monkeypatch):
    # Without reset_to_zero every launch but the first found the counters past their count and the sums of the
    # launches before: the statistics were never written (NaN) or wrong.
    tuner, configs, bench_means = _tune_with_two_configs(monkeypatch)
    x = torch.randn(2, 8, 5, 7).contiguous(memory_format=torch.channels_last)
    gw, gb = torch.randn(8) * 0.5 + 1.0, torch.randn(8) * 0.5
    w, b = torch.randn(12, 8, 3, 3) * 0.2, torch.randn(12) * 0.3
    with ldmopt.use_backend("triton", ops=["gn_conv2d"]):
        y, (mean, rstd) = gn_silu_conv2d(x, gw, gb, 4, 1e-5, w, b, out_stats=(3, 1e-6))
    assert tuner.cache and tuner.best_config is configs[1]  # it did tune, and launched the faster config
    ref = F.conv2d(F.silu(F.group_norm(x.double(), 4, gw.double(), gb.double(), 1e-5)), w.double(), b.double(), 1, 1)
    assert_close(y, ref, torch.float32, "y")
    var, mean_ref = torch.var_mean(y.double().reshape(2, 3, -1), dim=-1, unbiased=False)
    assert_close(mean, mean_ref, torch.float32, "out mean")
    assert_close(rstd, torch.rsqrt(var + 1e-6), torch.float32, "out rstd")
    assert len(bench_means) == 6
    for i, bench_mean in enumerate(bench_means):
        assert_close(bench_mean, mean_ref, torch.float32, f"out mean of benchmark launch {i}")


def test_autotuning_without_statistics_leaves_the_input_alone(monkeypatch):
    # The statistics buffers the autotuner zeroes must never be the input (once a stand-in for the unused buffers).
    _tune_with_two_configs(monkeypatch)
    x = torch.randn(2, 8, 5, 7).contiguous(memory_format=torch.channels_last)
    x0 = x.clone()
    w, b = torch.randn(12, 8, 3, 3) * 0.2, torch.randn(12) * 0.3
    with ldmopt.use_backend("triton", ops=["gn_conv2d"]):
        y = gn_silu_conv2d(x, None, None, 1, 1e-5, w, b, normalize=False)
    assert torch.equal(x, x0)
    assert_close(y, F.conv2d(x0.double(), w.double(), b.double(), 1, 1), torch.float32, "y")
