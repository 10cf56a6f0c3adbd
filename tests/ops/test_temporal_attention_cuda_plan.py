"""The cuda backend of temporal attention refuses shapes whose shared-memory plan exceeds the GPU's opt-in limit.

On CPU the extension check is replaced by one that accepts, and the device limit by an A100's or an H200's, so the
dispatcher's choice and recorded reasons are those of a real GPU. tests/csrc/test_emulated_kernels.py checks that
``cuda_smem_bytes`` matches the C++ ``make_plan``.
"""

import importlib
from types import SimpleNamespace

import pytest
import torch

import ldmopt
from tests.tolerances import assert_close

ta = importlib.import_module("ldmopt.ops.temporal_attention")  # ldmopt.ops.temporal_attention is also the function

A100 = 166_912  # cudaDevAttrMaxSharedMemoryPerBlockOptin, sm_80
H200 = 232_448  # sm_90
LARGEST = (1, 64, 1, 1, 256)  # F=64, head_dim=256: 217,088 bytes per block in fp32


def _qkv(shape, dtype=torch.float32):
    return [torch.randn(shape, dtype=torch.float64).to(dtype) for _ in range(3)]


@pytest.fixture
def gpu(monkeypatch):
    """Pretend the extension is loaded and the tensors are on a CUDA device; returns a setter for the smem limit."""
    seen = []

    def set_limit(limit):
        def read(index):
            seen.append(index)
            return limit

        monkeypatch.setattr(ta, "smem_optin_limit", read)
        return seen

    monkeypatch.setattr(ta, "cuda_extension_refusals", lambda symbol, *tensors: [])
    return set_limit


def test_rule_on_a100_and_h200():
    need = ta.cuda_smem_bytes(64, 256, torch.float32, 1)
    assert need == 217_088
    (reason,) = ta.cuda_smem_refusals(64, 256, torch.float32, 1, A100)
    for part in ("F=64", "head_dim=256", "torch.float32", "217600 bytes", "allows 166912"):
        assert part in reason, reason
    assert ta.cuda_smem_refusals(64, 256, torch.float32, 1, H200) == []
    # the kernel's 512 bytes of static shared memory count too
    assert ta.cuda_smem_refusals(64, 256, torch.float32, 1, need + ta.CUDA_STATIC_SMEM_BYTES) == []
    assert ta.cuda_smem_refusals(64, 256, torch.float32, 1, need + ta.CUDA_STATIC_SMEM_BYTES - 1)
    # 16-bit types need less: 128,000 bytes fit an A100, not an sm_86/sm_89 (101,376)
    for dtype in (torch.float16, torch.bfloat16):
        assert ta.cuda_smem_refusals(64, 256, dtype, 1, A100) == []
        assert ta.cuda_smem_refusals(64, 256, dtype, 1, 101_376)
    # typical shapes stay within the 48 KiB a block aims for, whatever the sequence count
    for f, d in ((14, 64), (16, 40), (25, 80), (16, 160)):
        for n_seq in (1, 7, 10**6):
            assert ta.cuda_smem_bytes(f, d, torch.float32, n_seq) <= 48 * 1024
            assert ta.cuda_smem_refusals(f, d, torch.float32, n_seq, 48 * 1024 + ta.CUDA_STATIC_SMEM_BYTES) == []


@pytest.mark.parametrize("table", [ta.FORWARD, ta.FORWARD_OUT], ids=lambda t: t.op_name)
def test_a100_routes_largest_fp32_shape_to_triton(gpu, table):
    seen = gpu(A100)
    q, k, v = _qkv(LARGEST)
    args = (q, k, v, 0.0625) if table is ta.FORWARD else (q, k, v, 0.0625, torch.empty_like(q))
    reasons = table.reasons(*args)
    assert len(reasons["cuda"]) == 1 and "needs 217600 bytes" in reasons["cuda"][0], reasons
    assert "this GPU allows 166912" in reasons["cuda"][0]
    assert table.select(*args).name == "triton"
    assert seen and set(seen) == {q.get_device()}
    forced = pytest.raises(ldmopt.BackendUnavailableError, match=r"'cuda' was forced.*needs 217600 bytes")
    with forced, ldmopt.use_backend("cuda"):
        table.select(*args)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_a100_keeps_16bit_largest_shape_on_cuda(gpu, dtype):
    gpu(A100)
    q, k, v = _qkv(LARGEST, dtype)
    assert ta.FORWARD.reasons(q, k, v, 0.0625)["cuda"] == []
    assert ta.FORWARD.select(q, k, v, 0.0625).name == "cuda"


def test_h200_keeps_largest_fp32_shape_on_cuda(gpu):
    gpu(H200)
    q, k, v = _qkv(LARGEST)
    assert ta.FORWARD.select(q, k, v, 0.0625).name == "cuda"
    assert ta.FORWARD_OUT.select(q, k, v, 0.0625, torch.empty_like(q)).name == "cuda"


def test_a100_keeps_small_shape_on_cuda(gpu):
    gpu(A100)
    q, k, v = _qkv((2, 14, 3, 5, 64))
    assert ta.FORWARD.reasons(q, k, v, 0.125)["cuda"] == []
    assert ta.FORWARD.select(q, k, v, 0.125).name == "cuda"


def test_other_refusals_come_first_and_skip_the_device_query(gpu):
    seen = gpu(A100)
    q, k, v = _qkv((1, 65, 1, 1, 256))
    assert ta.FORWARD.reasons(q, k, v, 0.0625)["cuda"] == ["F=65 frames (kernels serve F <= 64)"]
    q, k, v = _qkv((0, 64, 1, 1, 256))  # an empty launch uses no shared memory
    assert ta.FORWARD.reasons(q, k, v, 0.0625)["cuda"] == []
    assert seen == []


def test_public_call_on_simulated_a100_runs_triton(gpu):
    gpu(A100)
    q, k, v = _qkv(LARGEST)
    ldmopt.ops.backend_counts.clear()
    out = ta.temporal_attention(q, k, v)
    assert ldmopt.ops.backend_counts[("temporal_attention", "triton")] == 1
    assert ldmopt.ops.backend_counts[("temporal_attention", "cuda")] == 0
    assert_close(out, ta._fwd_torch(q.double(), k.double(), v.double(), 0.0625), torch.float32, "F=64 D=256")


def test_limit_is_read_lazily_once_per_device(monkeypatch):
    calls = []

    def props(index):
        calls.append(index)
        return SimpleNamespace(shared_memory_per_block_optin=A100 if index == 0 else H200)

    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    ta.smem_optin_limit.cache_clear()
    try:
        assert [ta.smem_optin_limit(i) for i in (0, 1, 0, 1)] == [A100, H200, A100, H200]
        assert calls == [0, 1]
    finally:
        ta.smem_optin_limit.cache_clear()


@pytest.mark.parametrize("table", [ta.FORWARD, ta.FORWARD_OUT], ids=lambda t: t.op_name)
def test_non_finite_scale_goes_to_a_backend_that_takes_it(gpu, table):
    # The extension raises on a non-finite scale; Triton and torch return the reference's NaN.
    gpu(H200)
    q, k, v = _qkv((1, 5, 2, 3, 16))
    for scale, expect_refused in ((float("inf"), True), (float("nan"), True), (0.25, False)):
        args = (q, k, v, scale) if table is ta.FORWARD else (q, k, v, scale, torch.empty_like(q))
        reasons = table.reasons(*args)["cuda"]
        assert bool(reasons) == expect_refused, (scale, reasons)
        if expect_refused:
            assert f"scale={scale}" in reasons[0], reasons


def test_more_sequences_than_the_kernels_index_are_refused():
    # An expanded (stride-0) view has 2^31 sequences without the memory: B*N*H past the kernels' int32 index.
    big = torch.randn(1, 3, 1, 1, 16).expand(2**20, 3, 2**11, 1, 16)
    (reason,) = ta._kernel_refusals(big, big, big, 0.25)
    assert f"B*N*H={2**31} sequences" in reason and str(ta.MAX_SEQUENCES) in reason, reason
    assert ta._kernel_refusals(big[: 2**19], big[: 2**19], big[: 2**19], 0.25) == []


def test_a_q_of_another_rank_is_refused_not_unpacked():
    # A direct torch.ops call with 4-D q: a refusal naming the shape, not "not enough values to unpack".
    q = torch.randn(2, 3, 4, 8)
    assert ta._kernel_refusals(q, q, q, 0.25) == [
        "q of shape (2, 3, 4, 8) (kernels serve 5-D (B, F, N, heads, head_dim))"
    ]
