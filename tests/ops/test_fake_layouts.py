"""Each op's register_fake gives the shapes, dtypes and strides that every backend really returns, for inputs in
the layouts models hand them (transposed [M, C] views of channel-major maps, channels-last images). torch.compile
plans buffers from the fake; a backend that returned other strides made Inductor's size/stride asserts fail (or, with
them off, read the result wrongly)."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree

import ldmopt
from ldmopt.ops._dispatch import BackendUnavailableError

R = torch.randn
M, C, N = 10, 24, 16


def T(rows: int, cols: int, dtype=torch.float32) -> torch.Tensor:
    """[rows, cols] as the transposed view of a [cols, rows] tensor (stride 1 along the rows)."""
    return R(cols, rows, dtype=dtype).t()


def _significant_strides(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(s for s, n in zip(t.stride(), t.shape) if n > 1)


def _assert_fake_matches_real(op, args, backends=("torch", "triton")):
    with FakeTensorMode() as mode:
        fake = op(*pytree.tree_map_only(torch.Tensor, mode.from_tensor, args))
    ran = []
    for backend in backends:
        try:
            with ldmopt.use_backend(backend):
                real = op(*args)
        except BackendUnavailableError:
            continue
        ran.append(backend)
        for i, (r, f) in enumerate(zip(real, fake)):
            where = f"{op} output {i} on {backend}"
            assert (r.shape, r.dtype) == (f.shape, f.dtype), where
            assert _significant_strides(r) == _significant_strides(f), f"{where}: strides {r.stride()} vs {f.stride()}"
    assert ran, f"no backend took {op}'s inputs"


def _rms_norm_cases():
    w, b = R(C), R(C)
    plain = (T(M, C), w, None, 1e-6, torch.float32, True)
    layer_norm = (T(M, C), w, b, 1e-5, torch.float16, True, None, None, 1, True, True)
    return {"rms_norm": plain, "layer_norm": layer_norm}


@pytest.mark.parametrize("case", ["rms_norm", "layer_norm"])
def test_rms_norm_fwd_and_bwd(case):
    args = _rms_norm_cases()[case]
    _assert_fake_matches_real(torch.ops.ldmopt.rms_norm_fwd.default, args)
    x, w, center = args[0], args[1], len(args) > 10
    with ldmopt.use_backend("torch"):
        stats = torch.ops.ldmopt.rms_norm_fwd.default(*args)[1]
    bwd = (T(M, C), x, stats, w, None, None, 1, True, center, center)
    _assert_fake_matches_real(torch.ops.ldmopt.rms_norm_bwd.default, bwd)


def test_adaln_modulate_fwd_and_bwd():
    scale, shift, gate = R(2, C), R(2, C), R(2, C)
    x, residual = T(M, C), T(M, C)
    _assert_fake_matches_real(
        torch.ops.ldmopt.adaln_modulate_fwd.default, (x, scale, shift, residual, gate, 1e-6, True, True)
    )
    with ldmopt.use_backend("torch"):
        outputs = torch.ops.ldmopt.adaln_modulate_fwd.default(x, scale, shift, residual, gate, 1e-6, True, True)
    _, s, mean, rstd = outputs
    s = s.t().contiguous().t()  # a column-major sum, as a compiled graph may hand it back
    for dsum, x_, gate_ in ((T(M, C), x, gate), (None, None, None)):
        args = (T(M, C), s, mean, rstd, scale, dsum, x_, gate_)
        _assert_fake_matches_real(torch.ops.ldmopt.adaln_modulate_bwd.default, args)


@pytest.mark.parametrize("activation", ["", "gelu"])
def test_linear_fwd_and_bwd(activation):
    w, b = R(N, C), R(N)
    args = (T(M, C), w, b, None, T(M, N), activation, True, None)
    _assert_fake_matches_real(torch.ops.ldmopt.linear_fwd.default, args)
    # pre (the GEMM's output) is saved for an activation's gradient or the gate's
    for pre, gate, need in ((T(M, N) if activation else None, None, False), (T(M, N), R(2, N), True)):
        _assert_fake_matches_real(torch.ops.ldmopt.linear_bwd.default, (T(M, N), pre, gate, activation, need))


def test_geglu_fwd_and_bwd():
    w, b = R(2 * N, C), R(2 * N)
    _assert_fake_matches_real(torch.ops.ldmopt.geglu_fwd.default, (T(M, C), w, b, True))
    _assert_fake_matches_real(torch.ops.ldmopt.geglu_bwd.default, (T(M, N), T(M, 2 * N)))


def test_layer_norm_stats_and_linear():
    x = T(M, C)
    _assert_fake_matches_real(torch.ops.ldmopt.layer_norm_stats.default, (x, 1e-5))
    with ldmopt.use_backend("torch"):
        stats = torch.ops.ldmopt.layer_norm_stats.default(x, 1e-5)
    for activation in ("", "geglu"):
        args = (x, stats, R(C), R(C), R(2 * N, C), R(2 * N), activation, True)
        _assert_fake_matches_real(torch.ops.ldmopt.layer_norm_linear_fwd.default, args)


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
def test_group_norm_fwd_and_bwd(memory_format):
    x = R(2, 6, 5, 3).to(memory_format=memory_format)
    w, b = R(6), R(6)
    _assert_fake_matches_real(torch.ops.ldmopt.group_norm_fwd.default, (x, w, b, 3, 1e-5, "silu"))
    with ldmopt.use_backend("torch"):
        _, mean, rstd = torch.ops.ldmopt.group_norm_fwd.default(x, w, b, 3, 1e-5, "silu")
    dy = R(2, 6, 5, 3)  # contiguous whatever x's layout
    _assert_fake_matches_real(torch.ops.ldmopt.group_norm_bwd.default, (dy, x, w, b, mean, rstd, 3, "silu"))


def test_ops_called_directly_check_the_rows_they_index():
    """torch.ops callers skip the public wrappers' checks; the kernels index per-sample rows from these shapes."""
    x, w = R(5, 8), R(4, 8)
    with pytest.raises(ValueError, match=r"gate of shape \(2, 4\) is not \[B, 4\] with B dividing M=5"):
        torch.ops.ldmopt.linear_fwd(x, w, None, R(2, 4), None, "", False, None)
    with pytest.raises(ValueError, match=r"residual of shape \(4, 4\) does not hold M=5 rows of 4"):
        torch.ops.ldmopt.linear_fwd(x, w, None, None, R(4, 4), "", False, None)
    with pytest.raises(ValueError, match=r"scale of shape \(2, 8\) is not \[B, 8\] \(as scale\) with B dividing M=5"):
        torch.ops.ldmopt.adaln_modulate_fwd(x, R(2, 8), R(2, 8), None, None, 1e-6, False, False)
    with pytest.raises(ValueError, match=r"gate of shape \(1, 8\) is not \[B, 8\] \(as scale\)"):
        torch.ops.ldmopt.adaln_modulate_fwd(x, R(5, 8), R(5, 8), R(5, 8), R(1, 8), 1e-6, False, False)
    with pytest.raises(ValueError, match="a gate needs a residual"):
        torch.ops.ldmopt.adaln_modulate_fwd(x, R(5, 8), R(5, 8), None, R(5, 8), 1e-6, False, False)


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
def test_gn_conv2d(memory_format):
    x = R(2, 8, 5, 3).to(memory_format=memory_format)
    mean, rstd = torch.ops.ldmopt.gn_conv2d_stats.default(x, 4, 1e-5)
    for out_groups in (0, 2):
        args = (x, mean, rstd, R(8), R(8), R(6, 8, 3, 3), R(6), None, None, None, None, None, None, 4, "silu", 1,
                [1, 1], "none", "none", "none", 1.0, out_groups, 1e-5)  # fmt: skip
        _assert_fake_matches_real(torch.ops.ldmopt.gn_conv2d.default, args)


def test_temporal_attention_on_strided_frames():
    # (B, F, N, H, D) views of a (B, N, F, H, D) tensor: frames read with a stride, as the temporal layout does
    q, k, v = (R(2, 5, 3, 2, 8).transpose(1, 2) for _ in range(3))
    _assert_fake_matches_real(torch.ops.ldmopt.temporal_attention_fwd.default, (q, k, v, 0.35))
    dout = R(2, 3, 5, 2, 8)
    _assert_fake_matches_real(torch.ops.ldmopt.temporal_attention_bwd.default, (dout, q, k, v, 0.35))


def test_rms_norm_joint_on_transposed_parts():
    head, tail = T(2 * 3, C), T(2 * 4, C)
    args = (head, tail, R(C), R(C), 1e-6, torch.float32, True, 3, 4)
    _assert_fake_matches_real(torch.ops.ldmopt.rms_norm_joint_fwd.default, args)
