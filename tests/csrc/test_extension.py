"""The built ldmopt._C: op registration, argument checks through the Meta implementations, kernel resources.

Runs on CPU: the Meta kernels share the CUDA kernels' argument checks, and cuobjdump reads the compiled kernels
without a GPU. Skips (with the reason) when the extension was not built. The load-failure tests need no build.
"""

import importlib
import re
from types import SimpleNamespace

import pytest
import torch

import ldmopt
from ldmopt import _env
from ldmopt.ops._dispatch import BackendUnavailableError, cuda_extension_refusals, stale_schema
from ldmopt.ops.cuda_schemas import CUDA_SCHEMAS
from ldmopt.ops.group_norm import group_norm
from tests.csrc import resource_report

OPS = tuple(CUDA_SCHEMAS)
LOADED, LOAD_REASON = _env.cuda_extension_status()
needs_extension = pytest.mark.skipif(not LOADED, reason=f"ldmopt._C is not available: {LOAD_REASON}")

gn_fwd = getattr(torch.ops.ldmopt, "group_norm_fwd_cuda", None)
gn_bwd = getattr(torch.ops.ldmopt, "group_norm_bwd_cuda", None)
gn_stats = getattr(torch.ops.ldmopt, "group_norm_stats_cuda", None)
gn_apply = getattr(torch.ops.ldmopt, "group_norm_apply_cuda", None)
ln_stats = getattr(torch.ops.ldmopt, "layer_norm_stats_cuda", None)
ta_fwd = getattr(torch.ops.ldmopt, "temporal_attention_fwd_cuda", None)
ta_fwd_out = getattr(torch.ops.ldmopt, "temporal_attention_fwd_out_cuda", None)


def cpp_runs(call) -> bool:
    """Whether a call of an ldmopt._C op (on meta tensors: its checks alone) runs, rather than refusing the inputs."""
    try:
        call()
        return True
    except (RuntimeError, TypeError):
        return False


def meta(*shape, dtype=torch.float16, channels_last=False):
    t = torch.empty(shape, dtype=dtype, device="meta")
    if channels_last:
        t = t.to(memory_format=torch.channels_last if len(shape) == 4 else torch.channels_last_3d)
    return t


# ------------------------------------------------------------------------------------------------ registration


@needs_extension
@pytest.mark.parametrize("op", OPS)
def test_every_op_has_cuda_and_meta_kernels(op):
    name = f"ldmopt::{op}"
    assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "CUDA"), f"{name} has no CUDA kernel"
    assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "Meta"), f"{name} has no Meta kernel"
    assert not torch._C._dispatch_has_kernel_for_dispatch_key(name, "CPU")


@needs_extension
def test_schemas_match_the_python_callers():
    """ldmopt/ops/ calls each op with the argument order of ops/cuda_schemas.py: the build must have those schemas."""
    built = {op: str(getattr(torch.ops.ldmopt, op).default._schema) for op in OPS}
    assert built == CUDA_SCHEMAS
    assert all(stale_schema(op) is None for op in OPS)


@needs_extension
def test_an_op_built_with_another_schema_is_refused_with_the_reason(monkeypatch):
    """An extension built from older sources (an editable install updated, not rebuilt) may hold an op whose
    arguments the Python callers no longer match: its cuda backend refuses, naming both schemas, so the Triton
    backend runs the call instead of the op raising on a GPU."""
    older = CUDA_SCHEMAS["group_norm_apply_cuda"].replace(", Tensor? x_tail=None", "")
    monkeypatch.setitem(CUDA_SCHEMAS, "group_norm_apply_cuda", older)  # as if ldmopt called the older schema
    stale_schema.cache_clear()
    try:
        reasons = cuda_extension_refusals("group_norm_apply_cuda", torch.empty(2, 8, 3, 3, device="meta"))
    finally:
        monkeypatch.undo()
        stale_schema.cache_clear()
    assert len(reasons) == 1 and "built from older sources" in reasons[0] and "x_tail" in reasons[0], reasons


@needs_extension
def test_build_info_describes_the_build():
    info = _env.build_info()
    assert info["built"] is True
    assert info["arch_list"] and info["build_seconds"] > 0
    assert sorted(info["sources"]) == sorted(resource_report_sources())


def resource_report_sources():
    root = resource_report.Path(__file__).resolve().parents[2]
    return [p.relative_to(root).as_posix() for ext in ("cpp", "cu") for p in (root / "csrc").rglob(f"*.{ext}")]


@needs_extension
def test_cpu_tensors_have_no_kernel():
    # The Python backends refuse CPU tensors before calling; a direct call names the missing backend.
    with pytest.raises(NotImplementedError, match="CPU"):
        gn_fwd(torch.zeros(1, 4, 2, 2), None, None, 2, 1e-5, "")


# ------------------------------------------------------------------------------------------------ Meta: shapes


@needs_extension
@pytest.mark.parametrize(
    "shape,channels_last",
    [((2, 64, 5, 7), False), ((2, 64, 5, 7), True), ((1, 40, 3, 4, 4), True), ((3, 24, 9), False)],
)
def test_group_norm_meta_outputs(shape, channels_last):
    x = meta(*shape, channels_last=channels_last)
    y, mean, rstd = gn_fwd(x, meta(shape[1]), None, 8, 1e-5, "silu")
    assert y.shape == x.shape and y.stride() == x.stride() and y.dtype == x.dtype
    assert mean.shape == rstd.shape == (shape[0], 8) and mean.dtype == rstd.dtype == torch.float32
    dx, dw, db = gn_bwd(torch.empty_like(x), x, None, meta(shape[1]), mean, rstd, 8, "silu")
    assert dx.shape == x.shape and dx.stride() == x.stride()
    assert dw.shape == db.shape == (shape[1],) and dw.dtype == db.dtype == torch.float32


@needs_extension
def test_temporal_attention_meta_outputs():
    # Dense views keep their strides (torch.empty_like); slices of a packed qkv get a contiguous output.
    q = meta(2 * 5, 14, 8 * 40).view(2, 5, 14, 8, 40).transpose(1, 2)
    assert ta_fwd(q, q, q, 0.1).stride() == q.stride()
    qkv = meta(2, 14, 5, 3, 8, 40)
    out = ta_fwd(qkv[:, :, :, 0], qkv[:, :, :, 1], qkv[:, :, :, 2], 0.1)
    assert out.shape == (2, 14, 5, 8, 40) and out.is_contiguous()
    assert ta_fwd_out(q, q, q, 0.1, torch.empty_like(q)) is None


# ------------------------------------------------------------------------------------------------ Meta: bad inputs

x4 = meta(2, 8, 3, 3, dtype=torch.float32)
x4cl = meta(2, 8, 3, 3, dtype=torch.float32, channels_last=True)
stats = meta(2, 4, dtype=torch.float32)
q5 = meta(1, 14, 4, 2, 40)


def tail_cl(*shape):
    return meta(*shape, dtype=torch.float32, channels_last=True)


BAD_INPUTS = [
    # (id, call, exception type, message fragment)
    ("x-rank", lambda: gn_fwd(meta(2, 8), None, None, 4, 1e-5, ""), RuntimeError,
     "ldmopt.group_norm_fwd_cuda: x must have 3 to 5 dims (N, C, *spatial), got shape [2, 8]"),
    ("x-dtype", lambda: gn_fwd(meta(2, 8, 3, 3, dtype=torch.float64), None, None, 4, 1e-5, ""), TypeError,
     "x has dtype Double; supported: Float, Half, BFloat16"),
    ("x-int", lambda: gn_fwd(meta(2, 8, 3, 3, dtype=torch.int32), None, None, 4, 1e-5, ""), TypeError,
     "x has dtype Int; supported"),
    ("groups-divide", lambda: gn_fwd(x4, None, None, 3, 1e-5, ""), RuntimeError,
     "num_groups=3 does not divide C=8 (x shape [2, 8, 3, 3])"),
    ("groups-positive", lambda: gn_fwd(x4, None, None, 0, 1e-5, ""), RuntimeError,
     "num_groups must be positive, got 0"),
    ("weight-shape", lambda: gn_fwd(x4, meta(4), None, 4, 1e-5, ""), RuntimeError,
     "weight must have shape [C] = [8], got [4]"),
    ("bias-device", lambda: gn_fwd(x4, None, torch.zeros(8), 4, 1e-5, ""), RuntimeError,
     "bias is on cpu but x is on meta"),
    ("activation", lambda: gn_fwd(x4, None, None, 4, 1e-5, "gelu"), RuntimeError,
     "activation='gelu' is not supported; supported: '' (none) or 'silu'"),
    ("layout", lambda: gn_fwd(meta(2, 8, 3, 6)[..., ::2], None, None, 4, 1e-5, ""), RuntimeError,
     "x must be contiguous or channels-last, got shape [2, 8, 3, 3] with strides [144, 18, 6, 2]"),
    ("eps", lambda: gn_fwd(x4, None, None, 4, -1.0, ""), RuntimeError,
     "eps must be a finite number >= 0, got -1"),
    ("empty", lambda: gn_fwd(meta(0, 8, 3, 3), None, None, 4, 1e-5, ""), RuntimeError, "x is empty"),
    ("dy-shape", lambda: gn_bwd(meta(2, 8, 3, 4, dtype=torch.float32), x4, None, None, stats, stats, 4, ""),
     RuntimeError, "ldmopt.group_norm_bwd_cuda: dy must have x's shape [2, 8, 3, 3], got [2, 8, 3, 4]"),
    ("dy-dtype", lambda: gn_bwd(meta(2, 8, 3, 3), x4, None, None, stats, stats, 4, ""), TypeError,
     "dy has dtype Half but x has Float; they must match"),
    ("mean-shape", lambda: gn_bwd(x4, x4, None, None, meta(2, 2, dtype=torch.float32), stats, 4, ""),
     RuntimeError, "mean must have shape [N, G] = [2, 4], got [2, 2]"),
    ("rstd-dtype", lambda: gn_bwd(x4, x4, None, None, stats, meta(2, 4), 4, ""), TypeError,
     "rstd has dtype Half; supported: Float"),
    ("stats-groups", lambda: gn_stats(x4, 3, 1e-5), RuntimeError,
     "ldmopt.group_norm_stats_cuda: num_groups=3 does not divide C=8 (x shape [2, 8, 3, 3])"),
    ("stats-eps", lambda: gn_stats(x4, 4, float("nan")), RuntimeError,
     "ldmopt.group_norm_stats_cuda: eps must be a finite number >= 0, got nan"),
    ("stats-layout", lambda: gn_stats(meta(2, 8, 3, 6)[..., ::2], 4, 1e-5), RuntimeError,
     "ldmopt.group_norm_stats_cuda: x must be contiguous or channels-last"),
    ("apply-mean-shape", lambda: gn_apply(x4, meta(2, 2, dtype=torch.float32), stats, None, None, 4, "silu"),
     RuntimeError, "ldmopt.group_norm_apply_cuda: mean must have shape [N, G] = [2, 4], got [2, 2]"),
    ("apply-rstd-dtype", lambda: gn_apply(x4, stats, meta(2, 4), None, None, 4, ""), TypeError,
     "ldmopt.group_norm_apply_cuda: rstd has dtype Half; supported: Float"),
    ("apply-weight", lambda: gn_apply(x4, stats, stats, meta(7), None, 4, ""), RuntimeError,
     "ldmopt.group_norm_apply_cuda: weight must have shape [C] = [8], got [7]"),
    ("apply-activation", lambda: gn_apply(x4, stats, stats, None, None, 4, "gelu"), RuntimeError,
     "ldmopt.group_norm_apply_cuda: activation='gelu' is not supported"),
    ("parts-layout", lambda: gn_apply(x4cl, stats, stats, None, None, 4, "", x4), RuntimeError,
     "ldmopt.group_norm_apply_cuda: with x_tail, x and x_tail must be channels-last, got strides"),
    ("parts-dtype", lambda: gn_apply(x4cl, stats, stats, None, None, 4, "", meta(2, 8, 3, 3, channels_last=True)),
     TypeError, "ldmopt.group_norm_apply_cuda: x_tail has dtype Half but x has Float; they must match"),
    ("parts-size", lambda: gn_apply(x4cl, stats, stats, None, None, 4, "", tail_cl(2, 4, 3, 4)), RuntimeError,
     "ldmopt.group_norm_apply_cuda: x_tail [2, 4, 3, 4] must match x [2, 8, 3, 3] in batch and spatial size"),
    ("parts-groups", lambda: gn_apply(x4cl, stats, stats, None, None, 4, "", tail_cl(2, 6, 3, 3)), RuntimeError,
     "ldmopt.group_norm_apply_cuda: num_groups=4 does not divide C=14"),
    ("parts-weight", lambda: gn_apply(x4cl, stats, stats, meta(8), None, 4, "", tail_cl(2, 4, 3, 3)), RuntimeError,
     "ldmopt.group_norm_apply_cuda: weight must have shape [C] = [12], got [8]"),
    ("parts-rank", lambda: gn_apply(meta(2, 8, 9, dtype=torch.float32), stats, stats, None, None, 4, "",
                                    meta(2, 4, 9, dtype=torch.float32)), RuntimeError,
     "ldmopt.group_norm_apply_cuda: with x_tail, x and x_tail must be 4-D (N, C, H, W)"),
    ("ln-rank", lambda: ln_stats(meta(2, 3, 4), 1e-5), RuntimeError,
     "ldmopt.layer_norm_stats_cuda: x must be a 2-D [rows, C] tensor, got shape [2, 3, 4]"),
    ("ln-dtype", lambda: ln_stats(meta(2, 4, dtype=torch.float64), 1e-5), TypeError,
     "ldmopt.layer_norm_stats_cuda: x has dtype Double; supported: Float, Half, BFloat16"),
    ("ln-columns", lambda: ln_stats(meta(2, 0), 1e-5), RuntimeError, "x has no columns (shape [2, 0])"),
    ("ln-stride", lambda: ln_stats(meta(4, 2).t(), 1e-5), RuntimeError,
     "x must have unit column stride, got strides [1, 2] for shape [2, 4]"),
    ("ln-eps", lambda: ln_stats(meta(2, 4), float("inf")), RuntimeError, "eps must be a finite number >= 0, got inf"),
    ("q-rank", lambda: ta_fwd(meta(4, 14, 40), meta(4, 14, 40), meta(4, 14, 40), 0.1), RuntimeError,
     "ldmopt.temporal_attention_fwd_cuda: q must be a 5-D (B, F, N, H, head_dim) view, got shape [4, 14, 40]"),
    ("k-shape", lambda: ta_fwd(q5, meta(1, 14, 4, 2, 32), q5, 0.1), RuntimeError,
     "k must have q's shape [1, 14, 4, 2, 40], got [1, 14, 4, 2, 32]"),
    ("qkv-dtype", lambda: ta_fwd(q5, q5, meta(1, 14, 4, 2, 40, dtype=torch.bfloat16), 0.1), TypeError,
     "q, k, v must share one dtype, got Half, Half, BFloat16"),
    ("q-dtype", lambda: ta_fwd(*[meta(1, 14, 4, 2, 40, dtype=torch.float64)] * 3, 0.1), TypeError,
     "q has dtype Double; supported: Float, Half, BFloat16"),
    ("frames", lambda: ta_fwd(*[meta(1, 65, 4, 2, 40)] * 3, 0.1), RuntimeError,
     "F=65 frames (q shape [1, 65, 4, 2, 40]) is not supported; supported: 1 <= F <= 64"),
    ("head-dim", lambda: ta_fwd(*[meta(1, 14, 4, 1, 257)] * 3, 0.1), RuntimeError,
     "head_dim=257 (q shape [1, 14, 4, 1, 257]) is not supported; supported: 1 <= head_dim <= 256"),
    ("scale", lambda: ta_fwd(q5, q5, q5, float("inf")), RuntimeError, "scale must be finite, got inf"),
    ("out-shape", lambda: ta_fwd_out(q5, q5, q5, 0.1, meta(1, 14, 4, 2, 32)), RuntimeError,
     "out must have q's shape [1, 14, 4, 2, 40], got [1, 14, 4, 2, 32]"),
    ("out-dtype", lambda: ta_fwd_out(q5, q5, q5, 0.1, meta(1, 14, 4, 2, 40, dtype=torch.float32)), TypeError,
     "out has dtype Float but q has Half; they must match"),
    ("out-frames", lambda: ta_fwd_out(*[meta(1, 65, 4, 2, 40)] * 3, 0.1, meta(1, 65, 4, 2, 40)), RuntimeError,
     "ldmopt.temporal_attention_fwd_out_cuda: F=65 frames"),
]  # fmt: skip


@needs_extension
@pytest.mark.parametrize("call,exc,message", [b[1:] for b in BAD_INPUTS], ids=[b[0] for b in BAD_INPUTS])
def test_bad_inputs_are_refused_with_the_reason(call, exc, message):
    with pytest.raises(exc, match=re.escape(message)):
        call()


# ------------------------------------------------------------------------------------------------ kernel resources


@needs_extension
@pytest.mark.skipif(resource_report.find_cuobjdump() is None, reason="cuobjdump not found")
def test_kernels_do_not_spill_on_sm80_and_sm90(capsys):
    usage = resource_report.resource_usage(resource_report.extension_path(), resource_report.find_cuobjdump())
    with capsys.disabled():
        print("\n" + resource_report.format_report(usage))
    by_arch = {arch: {u.name for u in usage if u.arch == arch} for arch in ("sm_80", "sm_90")}
    assert by_arch["sm_80"] and by_arch["sm_80"] == by_arch["sm_90"], "each kernel must be built for sm_80 and sm_90"
    assert any("temporal_attention::forward_kernel" in n for n in by_arch["sm_90"])
    assert any("group_norm::partial_cl_kernel" in n for n in by_arch["sm_90"])
    spills = [u for u in usage if u.local or u.stack]
    assert not spills, f"kernels with local memory (spills) or stack: {spills}"


# ------------------------------------------------------------------------------------------------ load failures


@pytest.fixture
def fresh_extension_status():
    _env.cuda_extension_status.cache_clear()
    yield
    _env.cuda_extension_status.cache_clear()


def _import_raising(monkeypatch, exc):
    real = importlib.import_module

    def fake(name, *args, **kwargs):
        if name == "ldmopt._C":
            raise exc
        return real(name, *args, **kwargs)

    monkeypatch.setattr(_env.importlib, "import_module", fake)


def test_broken_library_is_a_warning_naming_the_cause(monkeypatch, fresh_extension_status):
    # What a torch upgrade without a rebuild looks like.
    monkeypatch.setattr(_env, "build_info", lambda: {"built": True})
    _import_raising(monkeypatch, ImportError("ldmopt/_C.so: undefined symbol: _ZN3c104impl3cow11cow_deleterEPv"))
    with pytest.warns(RuntimeWarning, match="undefined symbol"):
        ok, why = _env.cuda_extension_status()
    assert not ok and "rebuild" in why
    assert cuda_extension_refusals("group_norm_fwd_cuda", torch.zeros(1)) == [why]
    x = torch.randn(1, 4, 3, 3)
    with pytest.raises(BackendUnavailableError, match="undefined symbol"), ldmopt.use_backend("cuda"):
        group_norm(x, 2)
    with ldmopt.use_backend("torch"):
        assert group_norm(x, 2).shape == x.shape


def test_missing_library_gives_the_build_reason_without_warning(monkeypatch, fresh_extension_status, recwarn):
    monkeypatch.setattr(_env, "build_info", lambda: {"built": False, "reason": "no CUDA toolkit"})
    real_find_spec = _env.importlib.util.find_spec
    monkeypatch.setattr(
        _env.importlib.util, "find_spec", lambda n, *a: None if n == "ldmopt._C" else real_find_spec(n, *a)
    )
    _import_raising(monkeypatch, ModuleNotFoundError("No module named 'ldmopt._C'"))
    ok, why = _env.cuda_extension_status()
    assert not ok and why
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


def test_library_left_from_an_earlier_build_is_not_loaded(monkeypatch, fresh_extension_status, tmp_path):
    # An editable install built ldmopt/_C*.so in the tree; a later install skipped the build (or it failed): the old
    # library would run kernels of other sources.
    monkeypatch.setattr(_env, "build_info", lambda: {"built": False, "reason": "skipped: LDMOPT_SKIP_CUDA_BUILD=1"})
    stale = tmp_path / "_C.cpython-311-x86_64-linux-gnu.so"
    real_find_spec = _env.importlib.util.find_spec
    monkeypatch.setattr(
        _env.importlib.util, "find_spec",
        lambda name, *a: SimpleNamespace(origin=str(stale)) if name == "ldmopt._C" else real_find_spec(name, *a),
    )  # fmt: skip
    _import_raising(monkeypatch, AssertionError("the stale library must not be imported"))
    with pytest.warns(RuntimeWarning, match="left from an earlier build"):
        ok, why = _env.cuda_extension_status()
    assert not ok and str(stale) in why and "LDMOPT_SKIP_CUDA_BUILD" in why


BACKWARD_INPUTS = {
    "contiguous": (meta(2, 8, 3, 3), stats),
    "channels-last": (meta(2, 8, 3, 3).to(memory_format=torch.channels_last), stats),
    "channels-last 3-D": (meta(2, 9, 8).transpose(1, 2), stats),
    "channels-last 5-D": (meta(2, 8, 2, 3, 3).to(memory_format=torch.channels_last_3d), stats),
    "channel-strided": (meta(2, 16, 3, 3)[:, ::2], stats),
    "spatially strided": (meta(2, 8, 3, 6)[..., ::2], stats),
    "fp64 statistics": (meta(2, 8, 3, 3), stats.double()),
}


@needs_extension
@pytest.mark.parametrize("case", list(BACKWARD_INPUTS))
def test_python_refusal_matches_what_the_cpp_op_refuses(case, monkeypatch):
    """The cuda backend's refusal names exactly the backward inputs its C++ op would reject, so that those (from
    gn_conv2d's backward: any layout, user statistics) go to another backend instead of raising on a GPU."""
    module = importlib.import_module("ldmopt.ops.group_norm")  # the module; ldmopt.ops.group_norm is the function
    monkeypatch.setattr(module, "cuda_extension_refusals", lambda *args: [])  # as on a machine with the extension
    x, st = BACKWARD_INPUTS[case]
    dy = torch.empty_like(x)
    try:
        gn_bwd(dy, x, None, None, st, st, 4, "")
        cpp_refuses = False
    except (RuntimeError, TypeError):
        cpp_refuses = True
    refused = module._cuda_refuse("group_norm_bwd_cuda", dy, x, stats=(st, st))
    assert bool(refused) == cpp_refuses, (case, refused)


# ------------------------------------------------------------------------------------------------ which GPUs


@pytest.mark.parametrize(
    "capability,arch_list,runs",
    [
        ((8, 0), "8.0;9.0+PTX", True),
        ((8, 6), "8.0;9.0+PTX", True),  # the sm_80 cubin runs on every 8.x
        ((9, 0), "8.0;9.0+PTX", True),
        ((10, 0), "8.0;9.0+PTX", True),  # B200: the driver compiles the compute_90 PTX
        ((12, 0), "8.0;9.0+PTX", True),
        ((10, 0), "8.0;9.0", False),  # no PTX: no kernel image for sm_100
        ((8, 0), "9.0", False),
        ((7, 5), "7.5;8.0;9.0+PTX", False),  # T4: below the kernels' sm_80 minimum whatever was built
        ((7, 0), None, False),
        ((9, 0), None, True),  # build unknown: only the minimum is checked
        ((9, 0), "9.0a", True),  # the arch-specific sm_90a cubin (a GPU image's default list) runs on 9.0 alone
        ((10, 0), "9.0a+PTX", False),  # ... and so does its compute_90a PTX
        ((10, 3), "10.0f", True),  # a family cubin runs on its later minors
        ((12, 0), "10.0f", False),
        ((9, 0), "Hopper", True),  # named or "native" entries cannot be read: only the minimum is checked
        ((8, 0), "native", True),
        ((7, 5), "native", False),
    ],
)
def test_the_cuda_backend_refuses_gpus_the_build_cannot_run_on(capability, arch_list, runs):
    why_not = _env.runs_cuda_extension_on(capability, arch_list)
    assert (why_not is None) == runs, why_not
    if why_not:
        assert f"{capability[0]}.{capability[1]}" in why_not


def test_direct_calls_the_kernels_would_reject_are_refused_first(monkeypatch):
    # What the C++ checks reject must be refused in Python, so that another backend runs instead of an error.
    gn_module = importlib.import_module("ldmopt.ops.group_norm")
    ta_module = importlib.import_module("ldmopt.ops.temporal_attention")

    monkeypatch.setattr(ta_module, "cuda_extension_refusals", lambda *args: [])
    monkeypatch.setattr(gn_module, "cuda_extension_refusals", lambda *args: [])
    for shape in ((1, 0, 2, 2, 8), (1, 4, 2, 2, 0)):
        q = torch.empty(shape)
        reasons = ta_module._cuda_refusals("temporal_attention_fwd_cuda", q, q, q, 0.5)
        assert any("F >= 1 frames and head_dim >= 1" in r for r in reasons), reasons
    for shape in ((2, 4), (2, 4, 1, 1, 1, 3), (0, 4, 2, 2)):
        reasons = gn_module._cuda_refuse("group_norm_fwd_cuda", torch.empty(shape))
        assert any("non-empty 3-, 4- and 5-D x" in r for r in reasons), reasons


STATS_APPLY_INPUTS = {
    "contiguous": meta(2, 8, 3, 3),
    "channels-last": meta(2, 8, 3, 3).to(memory_format=torch.channels_last),
    "channels-last 1x1": meta(2, 8, 1, 1).to(memory_format=torch.channels_last),
    "channels-last, one row sliced": meta(1, 8, 3, 4).to(memory_format=torch.channels_last)[:, :, 1:2, :],
    "channels-last 3-D": meta(2, 9, 8).transpose(1, 2),
    "channels-last 5-D": meta(2, 8, 2, 3, 3).to(memory_format=torch.channels_last_3d),
    "channel-strided": meta(2, 16, 3, 3)[:, ::2],
    "spatially strided": meta(2, 8, 3, 6)[..., ::2],
    "channels-last, spatially strided": meta(2, 8, 3, 6).to(memory_format=torch.channels_last)[..., ::2],
    "fp64": meta(2, 8, 3, 3, dtype=torch.float64),
}


@needs_extension
@pytest.mark.parametrize("case", list(STATS_APPLY_INPUTS))
def test_statistics_and_apply_refusals_cover_what_the_cpp_ops_reject(case, monkeypatch):
    """What the cuda backends of gn_conv2d_stats and group_norm_apply accept, their C++ ops run (a refusal sends the
    input to triton instead of raising on a GPU); the statistics refuse nothing the kernels could read, and the apply
    takes only the channels-last inputs whose output layout (x's) is the op's; both take two channels-last parts."""
    stats_module = importlib.import_module("ldmopt.ops.gn_conv2d_stats")
    apply_module = importlib.import_module("ldmopt.ops.group_norm_apply")
    monkeypatch.setattr(stats_module, "cuda_extension_refusals", lambda *args: [])  # as where the extension is built
    x = STATS_APPLY_INPUTS[case]
    groups = x.shape[1] // 2 if x.shape[1] % 2 == 0 else 3
    refused = stats_module._stats_cuda_refuse(x)
    assert (not refused) == cpp_runs(lambda: gn_stats(x, groups, 1e-5)), (case, refused)
    st = meta(x.shape[0], groups, dtype=torch.float32)
    refused = apply_module._apply_cuda_refuse(x, st, st, None, None, groups, "silu")
    if not refused:
        assert cpp_runs(lambda: gn_apply(x, st, st, None, None, groups, "silu")), case
        assert x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last)
    if not refused:  # y in canonical channels-last strides (as the op's fake), whatever x's strides on size-1 dims
        y = gn_apply(x, st, st, None, None, groups, "silu")
        assert y.stride() == torch.empty_like(y, memory_format=torch.channels_last).stride()
    # two parts (x twice): the C++ ops read each channel from its part (the apply writing channels-last)
    refused = stats_module._stats_cuda_refuse(x, x)
    assert (not refused) == cpp_runs(lambda: gn_stats(x, groups, 1e-5, x)), (case, refused)
    if not refused:
        mean, _ = gn_stats(x, groups, 1e-5, x)
        assert mean.shape == (x.shape[0], groups) and mean.dtype == torch.float32
    refused = apply_module._apply_cuda_refuse(x, st, st, None, None, groups, "silu", x)
    assert (not refused) == cpp_runs(lambda: gn_apply(x, st, st, None, None, groups, "silu", x)), (case, refused)
    if not refused:
        y = gn_apply(x, st, st, None, None, groups, "silu", x)
        assert y.shape == (x.shape[0], 2 * x.shape[1], *x.shape[2:])
        assert y.stride() == torch.empty_like(y, memory_format=torch.channels_last).stride()


LN_INPUTS = {
    "rows": meta(5, 40),
    "slice of wider rows": meta(5, 64)[:, :40],
    "one row": meta(1, 40),
    "no rows": meta(0, 40),
    "one column, strided": meta(5, 4)[:, :1],
    "column-strided": meta(40, 5).t(),
    "no columns": meta(5, 0),
    "3-D": meta(2, 5, 40),
    "fp64": meta(5, 40, dtype=torch.float64),
}


@needs_extension
@pytest.mark.parametrize("case", list(LN_INPUTS))
def test_layer_norm_statistics_refusal_matches_what_the_cpp_op_refuses(case, monkeypatch):
    module = importlib.import_module("ldmopt.ops.layer_norm_linear")
    monkeypatch.setattr(module, "cuda_extension_refusals", lambda *args: [])  # as where the extension is built
    x = LN_INPUTS[case]
    try:
        out = ln_stats(x, 1e-5)
        cpp_refuses = False
        assert tuple(out.shape) == (2, x.shape[0]) and out.dtype == torch.float32
    except (RuntimeError, TypeError):
        cpp_refuses = True
    refused = module._stats_refuse_cuda(x, 1e-5)
    assert bool(refused) == cpp_refuses, (case, refused)
