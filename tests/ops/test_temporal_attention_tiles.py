"""The temporal attention kernels' tiles: every candidate a GPU autotunes over computes the same attention (run here
forced, in the interpreter), and the autotuned launch runs the tile its timing chose, once per key.

The interpreter cannot time kernels, so the autotuned path is driven with a stand-in timing (the autotuner's own
``_bench``), as tests/ops/test_tuned_launch.py does.
"""

from __future__ import annotations

import pytest
import torch
from ldmopt.kernels import temporal_attention as T

import ldmopt
from ldmopt.ops.temporal_attention import temporal_attention
from tests.ops.test_temporal_attention import _make, _sdpa
from tests.tolerances import assert_within_torch_error

# (batch, F, N, heads, head_dim, layout): each branch of candidate_configs -- F <= 16 with a head dim tried whole
# (40 in 64, 72 in 128) or in the other chunk width (160: 16 beside the heuristic 32), SVD's packed 14 x 64, F = 25
# (one sequence per program, 4 or 8 warps) with a head dim tried whole (64) or in the wider chunk (80: 32 beside 16)
# and the longest sequence.
TILE_CASES = [
    (3, 16, 2, 3, 40, "bfnc"),
    (2, 7, 3, 2, 72, "diffusers"),
    (1, 5, 2, 2, 160, "bfnc"),
    (1, 14, 3, 5, 64, "packed"),
    (2, 25, 1, 2, 64, "diffusers"),
    (1, 25, 1, 2, 80, "bfnc"),
    (1, 64, 1, 2, 64, "bfnc"),
]


def _grads(leaves, dout, cast):
    """Gradients of SDPA in ``cast`` with respect to copies of ``leaves``."""
    ref_leaves = [t.detach().to(cast).requires_grad_() for t in leaves]
    _sdpa(*ref_leaves).backward(dout.to(cast))
    return [t.grad for t in ref_leaves]


def test_candidates_begin_with_the_heuristic_tile():
    for f, d in (*T.AOT_SHAPES, (1, 16), (16, 32), (7, 20), (32, 40), (48, 128), (16, 256)):
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            for backward in (False, True):
                candidates = T.candidate_configs(f, d, dtype, backward)
                assert candidates[0] == T.block_config(f, d, dtype, backward)
                assert len({T.tile_name(t) for t in candidates}) == len(candidates), candidates
                assert all(t["BLOCK_F"] == candidates[0]["BLOCK_F"] for t in candidates)
                # fp32 keeps its one tile; 16-bit inputs have several to time, except the backward of a head dim
                # that a 32-wide chunk holds over 16 padded frames (a single chunk; 8 or 2 sequences spilled there)
                single = dtype == torch.float32 or (backward and f <= 16 and 16 < d <= 32)
                assert (len(candidates) == 1) == single, (f, d, dtype, backward, candidates)


@pytest.mark.parametrize("case", TILE_CASES, ids=lambda c: "-".join(map(str, c)))
def test_every_candidate_tile_computes_the_attention(case):
    _batch, f, _n, _h, d, layout = case
    dtype = torch.float16
    q, k, v = leaves = _make(*case, dtype, requires_grad=layout != "packed")
    if layout == "packed":
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        q, k, v = leaves
    dout = torch.randn(q.shape, dtype=dtype)
    ref = _sdpa(*(t.detach().double() for t in leaves))
    lowp = _sdpa(*(t.detach() for t in leaves))
    ref_grads = _grads(leaves, dout, torch.float64)
    lowp_grads = _grads(leaves, dout, dtype)
    forward_tiles = T.candidate_configs(f, d, dtype)
    backward_tiles = T.candidate_configs(f, d, dtype, backward=True)
    pairs = T.tile_pairs(forward_tiles, backward_tiles)
    assert len(forward_tiles) > 1 and len(pairs) == max(len(forward_tiles), len(backward_tiles))
    assert [p[0] for p in pairs[: len(forward_tiles)]] == forward_tiles
    assert [p[1] for p in pairs[: len(backward_tiles)]] == backward_tiles
    for fwd_tile, bwd_tile in pairs:
        label = f"{case} {T.tile_name(fwd_tile)} / {T.tile_name(bwd_tile)}"
        for t in leaves:
            t.grad = None
        with ldmopt.use_backend("triton"), T.forced_config(fwd_tile, bwd_tile):
            out = temporal_attention(q, k, v)
            out.backward(dout)
        assert (T.launched_tile(), T.launched_tile(backward=True)) == (T.tile_name(fwd_tile), T.tile_name(bwd_tile))
        assert_within_torch_error(out, ref, lowp, f"out {label}")
        for i, t in enumerate(leaves):
            assert_within_torch_error(t.grad, ref_grads[i], lowp_grads[i], f"grad {i} {label}")


def test_a_tile_that_is_not_a_candidate_is_refused():
    q, k, v = _make(1, 16, 2, 2, 40, "bfnc", torch.float16)
    tile = {"BLOCK_P": 16, "BLOCK_F": 16, "BLOCK_D": 16, "num_warps": 4}
    with pytest.raises(ValueError, match=r"not a candidate for F=16, head_dim=40.*forward"), T.forced_config(tile):
        T.temporal_attention_fwd(q, k, v, 0.2)


class _StandInTiming:
    """Makes launches autotune in the interpreter, with ``winner`` the fastest tile; counts the tiles timed."""

    def __init__(self, monkeypatch, f: int, d: int, winner: int):
        self.timed = 0
        monkeypatch.setattr(T, "_autotunes", lambda q: True)
        for backward in (False, True):
            candidates = T.candidate_configs(f, d, torch.float16, backward)
            tuner = T._autotuner(f, d, torch.float16, backward)
            monkeypatch.setattr(tuner, "cache", {})  # untuned for this test, and left as it was after
            fastest = (candidates[winner]["BLOCK_P"], candidates[winner]["BLOCK_D"])
            monkeypatch.setattr(tuner, "_bench", self._timing(fastest))

    def _timing(self, fastest):
        def bench(*args, config, **kwargs):
            self.timed += 1
            ms = 1.0 if (config.kwargs["BLOCK_P"], config.kwargs["BLOCK_D"]) == fastest else 2.0
            return [ms, ms, ms]

        return bench


def test_autotuned_launches_run_the_fastest_tile_once_tuned(monkeypatch):
    f, d = 16, 40
    candidates = T.candidate_configs(f, d, torch.float16)
    timed_per_shape = len(candidates) + len(T.candidate_configs(f, d, torch.float16, backward=True))
    winner = 4  # 8 sequences on 8 warps, the head dim in one 64-wide chunk
    assert (candidates[winner]["BLOCK_P"], candidates[winner]["BLOCK_D"]) == (8, 64)
    timing = _StandInTiming(monkeypatch, f, d, winner)
    q, k, v = leaves = _make(3, f, 5, 2, d, "bfnc", torch.float16, requires_grad=True)
    dout = torch.randn(q.shape, dtype=torch.float16)
    with ldmopt.use_backend("triton"):
        out = temporal_attention(q, k, v)
        out.backward(dout)
    assert timing.timed == timed_per_shape  # forward and backward each timed every candidate once
    ref, lowp = _sdpa(*(t.detach().double() for t in leaves)), _sdpa(*(t.detach() for t in leaves))
    assert_within_torch_error(out, ref, lowp, "autotuned forward")
    grads = [t.grad for t in leaves]
    ref_grads = _grads(leaves, dout, torch.float64)
    lowp_grads = _grads(leaves, dout, torch.float16)
    for i, g in enumerate(grads):
        assert_within_torch_error(g, ref_grads[i], lowp_grads[i], f"autotuned grad {i}")

    chosen = T.tuned_choices()
    for direction in ("forward", "backward"):
        (key, tile), *more = chosen[direction].items()
        assert not more
        # 3 * 5 * 2 sequences in bucket 32; (B, F, N, H, D) with heads, pixels adjacent and frames outer
        assert key[: len(T.TUNING_KEY)] == (32, f, 2, d, 0b111), key
        assert (tile["BLOCK_P"], tile["BLOCK_D"], tile["num_warps"]) == (8, 64, 8)

    # the same shape and layout again: launched with the choice, nothing timed
    with ldmopt.use_backend("triton"), torch.no_grad():
        again = temporal_attention(q, k, v)
    assert timing.timed == timed_per_shape
    assert torch.equal(again, out.detach())
    # another layout of the same shape is another key: timed afresh
    # (B, F, N, H, D) views of (B*N, F, C) activations: q's shape, other strides
    q2, k2, v2 = (torch.randn(3 * 5, f, 2 * d).half().view(3, 5, f, 2, d).transpose(1, 2) for _ in range(3))
    assert q2.shape == q.shape and q2.stride() != q.stride()
    with ldmopt.use_backend("triton"), torch.no_grad():
        temporal_attention(q2, k2, v2)
    assert timing.timed == timed_per_shape + len(candidates)
    assert len(T.tuned_choices()["forward"]) == 2
    # another resolution and batch in the same power-of-two bucket and layout: the choice serves, nothing timed
    q3, k3, v3 = (torch.randn(2, f, 7, 2, d).half() for _ in range(3))  # 28 sequences, like 30 in bucket 32
    with ldmopt.use_backend("triton"), torch.no_grad():
        temporal_attention(q3, k3, v3)
    assert timing.timed == timed_per_shape + len(candidates)
    assert T.launched_tile() == "P8xD64w8"


def test_under_graph_capture_an_untuned_key_runs_the_heuristic_tile(monkeypatch):
    # Timing synchronises, which CUDA graph capture forbids: a key met first under capture runs the heuristic tile
    # untimed; once a call outside capture has tuned it, capture launches the tuned tile.
    f, d = 16, 40
    timing = _StandInTiming(monkeypatch, f, d, winner=4)
    capturing = [True]
    monkeypatch.setattr(T, "_capturing", lambda q: capturing[0])
    q, k, v = _make(2, f, 3, 2, d, "bfnc", torch.float16)
    with ldmopt.use_backend("triton"), torch.no_grad():
        first = temporal_attention(q, k, v)
        assert timing.timed == 0 and T.launched_tile() == "P4xD16w4"
        capturing[0] = False
        temporal_attention(q, k, v)  # tunes the key
        timed = timing.timed
        assert timed == len(T.candidate_configs(f, d, torch.float16)) and T.launched_tile() == "P8xD64w8"
        capturing[0] = True
        captured = temporal_attention(q, k, v)
        assert timing.timed == timed and T.launched_tile() == "P8xD64w8"
    ref, lowp = _sdpa(q.double(), k.double(), v.double()), _sdpa(q, k, v)
    assert_within_torch_error(first, ref, lowp, "heuristic tile under capture")
    assert_within_torch_error(captured, ref, lowp, "tuned tile under capture")
    # an autotuner whose cache cannot be read ahead (a subclass, launched as is): under capture, never timed
    monkeypatch.setattr(T, "tuned_launch", lambda tuner: tuner)
    q3, k3, v3 = _make(2, f, 4, 2, d, "bfnc", torch.float16)  # another key
    with ldmopt.use_backend("triton"), torch.no_grad():
        temporal_attention(q3, k3, v3)
    assert timing.timed == timed and T.launched_tile() == "P4xD16w4"


def test_an_output_overlapping_an_input_is_never_timed(monkeypatch):
    # Timing runs the kernel repeatedly: with out=q, every run after the first would read q overwritten. An untuned
    # key runs the heuristic tile once; a tuned one launches its choice once.
    f, d = 16, 40
    timing = _StandInTiming(monkeypatch, f, d, winner=4)
    q, k, v = _make(2, f, 3, 2, d, "bfnc", torch.float16)
    ref, lowp = _sdpa(q.double(), k.double(), v.double()), _sdpa(q, k, v)
    with ldmopt.use_backend("triton"), torch.no_grad():
        aliased = q.clone()
        temporal_attention(aliased, k, v, out=aliased)
        assert timing.timed == 0 and T.launched_tile() == "P4xD16w4"
        assert_within_torch_error(aliased, ref, lowp, "out=q, untuned")
        temporal_attention(q, k, v)  # tunes the key
        assert timing.timed > 0 and T.launched_tile() == "P8xD64w8"
        timed = timing.timed
        aliased = q.clone()
        temporal_attention(aliased, k, v, out=aliased)
        assert timing.timed == timed and T.launched_tile() == "P8xD64w8"
    assert_within_torch_error(aliased, ref, lowp, "out=q, tuned")


# (dtype, F, head_dim) whose heuristic chunk holds the whole head dim (fp32's is 16 wide, 16-bit ones' up to 32)
ONE_CHUNK_CASES = [
    *[(torch.float32, f, d) for f, d in ((7, 16), (7, 12), (64, 16))],
    *[(torch.float16, f, d) for f, d in ((7, 16), (7, 12), (16, 32), (25, 24), (64, 16))],
]


@pytest.mark.parametrize(("dtype", "f", "d"), ONE_CHUNK_CASES, ids=lambda v: str(v).removeprefix("torch."))
def test_head_dim_in_one_chunk(dtype, f, d):
    # Head dims up to the heuristic chunk width take the one-chunk paths (forward: v loaded with q and k; backward:
    # q, k, v and dO loaded once) with the heuristic tile: 4 sequences per program over 16 padded frames, one per
    # program as a 2-D product over 32 or 64; the head dim filling its chunk or masked inside it.
    assert T.block_config(f, d, dtype)["BLOCK_D"] >= d and T.block_config(f, d, dtype, backward=True)["BLOCK_D"] >= d
    q, k, v = leaves = _make(2, f, 2, 3, d, "bfnc", dtype, requires_grad=True)
    dout = torch.randn(q.shape, dtype=dtype)
    with ldmopt.use_backend("triton"):
        out = temporal_attention(q, k, v)
        out.backward(dout)
    ref, lowp = _sdpa(*(t.detach().double() for t in leaves)), _sdpa(*(t.detach() for t in leaves))
    assert_within_torch_error(out, ref, lowp, f"out d={d} {dtype}")
    ref_grads, lowp_grads = _grads(leaves, dout, torch.float64), _grads(leaves, dout, dtype)
    for i, t in enumerate(leaves):
        assert_within_torch_error(t.grad, ref_grads[i], lowp_grads[i], f"grad {i} d={d} {dtype}")


def test_a_dout_of_another_dtype_takes_the_reference_backward():
    # autograd hands dout in q's dtype; a direct call with another would fail inside the kernel's products
    q, k, v = _make(1, 7, 2, 2, 16, "bfnc", torch.float16)
    dout = torch.randn(q.shape, dtype=torch.float32)
    ldmopt.ops.backend_counts.clear()
    dq, dk, dv = torch.ops.ldmopt.temporal_attention_bwd(dout, q, k, v, 0.25)
    assert ldmopt.ops.backend_counts[("temporal_attention_backward", "torch")] == 1
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    _sdpa(*leaves, scale=0.25).backward(dout.double())
    for got, leaf in zip((dq, dk, dv), leaves, strict=True):
        torch.testing.assert_close(got.double(), leaf.grad, rtol=2e-2, atol=2e-2)
    with (
        pytest.raises(ldmopt.BackendUnavailableError, match=r"dout of dtype torch\.float32"),
        ldmopt.use_backend("triton"),
    ):
        torch.ops.ldmopt.temporal_attention_bwd(dout, q, k, v, 0.25)


#: (B, F, N, H, D) = (2, 16, 5, 3, 40) views -> their layout class
_LAYOUTS = {
    "bfnc": (lambda: torch.randn(2, 16, 5, 3, 40), 0b111),
    # diffusers' (B*N, F, C): consecutive pixels are F*C apart
    "diffusers": (lambda: torch.randn(10, 16, 120).view(2, 5, 16, 3, 40).transpose(1, 2), 0b001),
    "packed_qkv": (lambda: torch.randn(10, 16, 3, 3, 40)[:, :, 0].view(2, 5, 16, 3, 40).transpose(1, 2), 0b001),
    "heads_strided": (lambda: torch.randn(2, 16, 5, 40, 3).transpose(3, 4), 0b100),
    "one_head": (lambda: torch.randn(2, 16, 5, 1, 40), 0b111),
}


@pytest.mark.parametrize("layout", list(_LAYOUTS))
def test_layout_class_tells_the_layouts_apart(layout):
    make, expected = _LAYOUTS[layout]
    q = make()
    assert q.shape[1] == 16 and q.shape[4] == 40
    assert T.layout_class(q) == expected


@pytest.mark.parametrize("pixel_stride", [80, 81, 84])
def test_alignment_hint_holds_for_every_operand(monkeypatch, pixel_stride):
    # ALIGN tells the compiler every sequence's rows start at a multiple of it in every operand: the output gradient,
    # a view autograd hands over with strides of its own (here a slice of wider pixel rows), must lower it too, or a
    # GPU would issue misaligned vector loads. 80 keeps 8 fp16 elements (16 bytes), 84 four, 81 none.
    launched = {}
    real_launch = T._launch

    def spy(backward, q, n_seq, args, kwargs, may_time=True):
        launched[backward] = (args, kwargs)
        return real_launch(backward, q, n_seq, args, kwargs, may_time)

    monkeypatch.setattr(T, "_launch", spy)
    b, f, n, h, d = 2, 16, 3, 2, 40
    q, k, v = (torch.randn(b, f, n, h, d).half() for _ in range(3))
    base = torch.randn(b * f * n * pixel_stride).half()
    dout = base.as_strided((b, f, n, h, d), (f * n * pixel_stride, n * pixel_stride, pixel_stride, d, 1))
    out = T.temporal_attention_fwd(q, k, v, d**-0.5)
    T.temporal_attention_bwd(dout, q, k, v, d**-0.5)
    expected = {80: 8, 81: 1, 84: 4}[pixel_stride]
    for backward, (args, kwargs) in launched.items():
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        assert all(st % kwargs["ALIGN"] == 0 for t in tensors for st in t.stride()[:4]), (backward, kwargs["ALIGN"])
        assert kwargs["ALIGN"] == (expected if backward else 8), backward
    assert out.isfinite().all()
