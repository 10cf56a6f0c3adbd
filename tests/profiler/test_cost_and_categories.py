"""Exact numbers of the analytic cost model on small hand-checked modules: FLOP formulas (grouped, strided and
transposed convolutions, bmm, attention with its value head dim), bytes moved, classification, the roofline's
efficiencies and dtypes, the shares a report prints, and the studies page's columns."""

import functools
import re

import pytest
import torch
import torch.nn.functional as F
from diffusers.models.attention_processor import Attention, AttnProcessor
from torch import nn

from ldmopt.profiler import GPUSpec, analyze, studies
from ldmopt.profiler import categories as C
from ldmopt.profiler.gpus import dtype_key

# A GPU on which every operator with FLOPs is compute-bound, with distinct peaks per operand type.
COMPUTE_BOUND = GPUSpec(
    "compute-bound-test", hbm_bytes_per_s=1e18, matmul_flops={"fp16": 8e12, "bf16": 4e12, "fp32": 1e12},
    vector_flops=1e12,
)  # fmt: skip


def _records(a, base):
    return [r for r in a.records if r.base == base]


# ---------------------------------------------------------------------------------------------- FLOP formulas


def test_grouped_and_strided_convolution_flops():
    """2 FLOPs per multiply-add over the output grid, Cin / groups input channels per output channel."""
    model = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1, groups=4), nn.Conv2d(16, 6, 3, stride=2, padding=1))
    a = analyze(model, inputs=(torch.empty(2, 8, 10, 12),), dtype="fp32", check_flops=True)
    grouped, strided = _records(a, "convolution")
    assert grouped.flops == 2 * 2 * (10 * 12) * 16 * (8 // 4) * 3 * 3
    assert strided.flops == 2 * 2 * (5 * 6) * 6 * 16 * 3 * 3  # the stride-2 output grid is 5 x 6
    assert a.total_flops == a.flop_counter_total == grouped.flops + strided.flops
    assert a.categories[C.CONV].flops == a.total_flops


def test_transposed_convolution_flops_scatter_each_input_pixel():
    """A transposed convolution does Cin x Cout x k x k multiply-adds per input pixel (not per output pixel)."""
    model = nn.ConvTranspose2d(6, 4, 4, stride=2, padding=1)
    a = analyze(model, inputs=(torch.empty(1, 6, 5, 7),), dtype="fp32", check_flops=True)
    (conv,) = _records(a, "convolution")
    assert conv.flops == 2 * 1 * (5 * 7) * 6 * 4 * 4 * 4  # output 10 x 14, four times the input grid
    assert a.flop_counter_total == conv.flops and conv.category == C.CONV


class _Attend(nn.Module):
    """SDPA with a value head dim other than the query/key one, called outside any diffusers attention module."""

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v)


def test_attention_flops_count_qk_and_pv_with_the_value_head_dim():
    q, k, v = torch.empty(2, 3, 5, 8), torch.empty(2, 3, 7, 8), torch.empty(2, 3, 7, 6)
    a = analyze(_Attend(), inputs=(q, k, v), dtype="fp16")
    (rec,) = [r for r in a.records if r.name == "attention"]
    qk, pv = 2 * (2 * 3) * 5 * 7 * 8, 2 * (2 * 3) * 5 * 7 * 6
    assert rec.flops == a.attention[0].flops == qk + pv
    # one fused kernel: q, k and v read once, the output (2, 3, 5, 6) written once, 2 bytes per fp16 element
    assert rec.bytes == 2 * (2 * 3 * 5 * 8 + 2 * 3 * 7 * 8 + 2 * 3 * 7 * 6 + 2 * 3 * 5 * 6)
    assert rec.category == C.ATTN_UNATTRIBUTED


class _PlainBmm(nn.Module):
    def forward(self, a, b):
        return torch.bmm(a, b)


def test_a_bmm_outside_attention_is_a_gemm():
    a = analyze(_PlainBmm(), inputs=(torch.empty(3, 4, 5), torch.empty(3, 5, 6)), dtype="fp32")
    (rec,) = _records(a, "bmm")
    assert rec.category == C.LINEAR and rec.flops == 2 * 3 * 4 * 5 * 6
    assert a.categories[C.LINEAR].flops == a.total_flops


def test_attention_without_sdpa_is_attention_flops_and_one_call():
    """diffusers' AttnProcessor (baddbmm + softmax + bmm) inside an attention module: all three are attention, and
    the call is logged with both products' FLOPs (4 x batch*heads x lq x lk x d), as an SDPA call is."""
    attn = Attention(query_dim=12, heads=3, dim_head=4)
    attn.set_processor(AttnProcessor())
    a = analyze(attn, inputs=(torch.empty(2, 10, 12),), dtype="fp32")
    expected = 4 * (2 * 3) * 10 * 10 * 4
    (call,) = a.attention
    assert (call.kind, call.batch_heads, call.q_len, call.kv_len, call.head_dim) == ("spatial", 6, 10, 10, 4)
    assert call.flops == expected
    assert a.flops_of(C.ATTN_SPATIAL) == expected
    inside = [r for r in a.records if r.path == "" and r.base in ("baddbmm", "bmm", "_softmax", "softmax")]
    assert {r.base for r in inside} >= {"baddbmm", "bmm"} and any("softmax" in r.base for r in inside)
    assert all(r.category == C.ATTN_SPATIAL for r in inside), [(r.name, r.category) for r in inside]


class _BatchedLinear(nn.Module):
    """A projection that runs as bmm (one weight per batch element)."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(features, features))

    def forward(self, x):
        return torch.bmm(x, self.weight.expand(x.shape[0], -1, -1))


def test_a_matmul_in_a_child_of_an_attention_module_is_not_attention():
    """Only matmuls run directly in the attention module are attention: a projection child's bmm is a GEMM, and
    it is not logged as an attention call."""
    attn = Attention(query_dim=8, heads=2, dim_head=4)
    attn.to_q = _BatchedLinear(8)
    a = analyze(attn, inputs=(torch.empty(2, 6, 8),), dtype="fp32")
    (bmm,) = [r for r in a.records if r.path == "to_q" and r.base == "bmm"]
    assert bmm.category == C.LINEAR and bmm.layer == "spatial"
    (call,) = a.attention
    assert (call.kind, call.q_len, call.kv_len, call.flops) == ("spatial", 6, 6, 4 * (2 * 2) * 6 * 6 * 4)


def test_a_measured_matmul_in_a_child_of_an_attention_module_is_not_attention():
    """profile() agrees with analyze(): the projection child's bmm is a GEMM, the attention's own matmuls are
    attention."""
    from ldmopt.profiler import profile

    attn = Attention(query_dim=8, heads=2, dim_head=4)
    attn.to_q = _BatchedLinear(8)
    result = profile(attn, inputs=(torch.randn(2, 6, 8),), steps=1, warmup=0)
    where = {name: category for category, c in result.categories.items() for name in c.top}
    assert where.get("aten::bmm") == C.LINEAR, where
    assert where.get("aten::_scaled_dot_product_flash_attention_for_cpu", C.ATTENTION[0]) in C.ATTENTION, where


# ---------------------------------------------------------------------------------------------- bytes


class _Copy(nn.Module):
    def forward(self, x):
        out = torch.empty_like(x)
        out.copy_(x)
        return out


def test_copy_reads_its_source_and_writes_its_destination_only():
    a = analyze(_Copy(), inputs=(torch.empty(4, 6, 10),), dtype="bf16")
    (copy,) = _records(a, "copy_")
    assert copy.in_bytes == (4 * 6 * 10 * 2,) and copy.out_bytes == 4 * 6 * 10 * 2
    assert copy.category == C.LAYOUT


class _ExpandedScale(nn.Module):
    def forward(self, x, scale):
        return x * scale.expand_as(x)


def test_an_expanded_input_is_read_once():
    """Broadcast (stride-0) dimensions of an input are read once: the expanded (1, 6, 1) scale is 6 elements."""
    a = analyze(_ExpandedScale(), inputs=(torch.empty(4, 6, 10), torch.empty(1, 6, 1)), dtype="fp16")
    (mul,) = _records(a, "mul")
    assert mul.in_bytes == (4 * 6 * 10 * 2, 6 * 2) and mul.out_bytes == 4 * 6 * 10 * 2


def test_linear_bytes_follow_the_element_size():
    """Each input read once, the output written once, at the analysed dtype's element size."""
    linear = nn.Linear(64, 128)
    for dtype, size in (("fp32", 4), ("bf16", 2)):
        a = analyze(linear, inputs=(torch.empty(7, 64),), dtype=dtype)
        assert a.total_bytes == (7 * 64 + 64 * 128 + 128 + 7 * 128) * size, dtype
        assert a.total_flops == 2 * 7 * 64 * 128


class _Modulate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16, elementwise_affine=False)

    def forward(self, x, scale, shift):
        return self.norm(x) * (1 + scale) + shift


def test_adaln_row_kernel_still_reads_its_input_and_modulation():
    """LayerNorm -> mul(1 + scale) -> add(shift) as one row kernel: x, the scale and the shift are read and the
    output written once; the normalised and the scaled tensors go (the 1 + scale add stays)."""
    x, vec = torch.empty(2, 10, 16), torch.empty(2, 1, 16)
    a = analyze(_Modulate(), inputs=(x, vec, vec), dtype="fp16", placement="triton")
    assert a.fusions["adaLN (LayerNorm + modulate)"].count == 1
    x_bytes, vec_bytes = 2 * 10 * 16 * 2, 2 * 16 * 2
    one_plus_scale = 2 * vec_bytes
    assert a.patched_bytes == one_plus_scale + x_bytes + vec_bytes + vec_bytes + x_bytes


# ---------------------------------------------------------------------------------------------- classification


def test_operator_categories():
    assert C.classify_op("aten::native_group_norm") == C.NORM
    assert C.classify_op("aten::native_group_norm_backward") == C.NORM
    assert C.classify_op("aten::group_norm") == C.NORM
    assert C.classify_op("aten::cat") == C.LAYOUT
    assert C.classify_op("aten::bmm") == C.LINEAR
    assert C.classify_op("aten::bmm", attention_kind="cross") == C.ATTN_CROSS
    assert C.classify_op("aten::_softmax", attention_kind="temporal") == C.ATTN_TEMPORAL
    assert C.classify_op("aten::_softmax") == C.ELEMENTWISE


def test_group_norm_backward_is_normalisation():
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.SiLU(), nn.Conv2d(8, 4, 1))
    a = analyze(model, inputs=(torch.empty(2, 3, 6, 6),), dtype="fp32", training=True)
    (bwd,) = [r for r in a.records if r.phase == "backward" and r.base == "native_group_norm_backward"]
    assert bwd.category == C.NORM and bwd.path == "1"
    assert a.phases["backward"][C.NORM].ops >= 1


def test_joint_image_text_attention_is_spatial_self_attention():
    """Flux's joint attention (text tokens projected beside the image ones, one sequence) is not cross-attention."""
    a = analyze("flux", tiny=True, batch=1)
    assert a.attention and {call.kind for call in a.attention} == {"spatial"}
    assert all(call.q_len == call.kv_len for call in a.attention)
    assert a.flops_of(C.ATTN_CROSS) == 0 and a.flops_of(C.ATTN_SPATIAL) == sum(c.flops for c in a.attention)


@pytest.mark.parametrize(
    ("kernel", "category"),
    [
        ("sm90_xmma_fprop_implicit_gemm_f16f16_f16f32_nhwckrsc_nhwc", C.CONV),
        ("cudnn::detail::dgrad_engine", C.CONV),
        ("sm80_xmma_wgrad_implicit_gemm_indexed", C.CONV),
        ("ampere_fp16_s16816gemm_fp16_128x128_ldg8_f2f_stages_32x5_tn", C.LINEAR),
        ("nchwToNhwcKernel", C.LAYOUT),
        ("void at::native::(anonymous namespace)::RowwiseMomentsCUDAKernel<float>", C.OTHER),
    ],
)
def test_kernels_without_a_launching_operator_are_classified_by_name(kernel, category):
    assert C.classify_kernel(kernel) == category


# ---------------------------------------------------------------------------------------------- roofline


def test_roofline_is_the_larger_of_compute_and_memory_time_at_the_attainable_rates():
    gpu = GPUSpec("eff-test", hbm_bytes_per_s=2e12, matmul_flops={"fp16": 100e12}, vector_flops=10e12,
                  compute_efficiency=0.5, memory_efficiency=0.25)  # fmt: skip
    assert gpu.op_time(0, 1e12, "fp16") == pytest.approx(2.0)  # 1e12 B at 0.25 x 2e12 B/s
    assert gpu.op_time(100e12, 0, "fp16") == pytest.approx(2.0)  # 100e12 FLOP at 0.5 x 100e12 FLOP/s
    assert gpu.op_time(1e12, 1e12, "fp16") == pytest.approx(2.0)  # memory-bound: the FLOPs take 0.02 s
    assert gpu.op_time(200e12, 1e12, "fp16") == pytest.approx(4.0)  # compute-bound
    assert gpu.ridge("fp16") == pytest.approx(100.0)


def test_dtype_keys():
    assert dtype_key(torch.bfloat16) == "bf16" and dtype_key(torch.float16) == "fp16"
    assert dtype_key(torch.float8_e4m3fn) == "fp8"
    assert dtype_key("bfloat16") == "bf16"


def test_bf16_operators_run_at_the_bf16_peak():
    linear = nn.Linear(64, 128)
    for dtype, peak in (("bf16", 4e12), ("fp16", 8e12)):
        a = analyze(linear, inputs=(torch.empty(32, 64),), dtype=dtype, gpu=COMPUTE_BOUND)
        assert a.categories[C.LINEAR].time_s == pytest.approx(2 * 32 * 64 * 128 / peak, rel=1e-6), dtype


# ---------------------------------------------------------------------------------------------- shares


@pytest.fixture(scope="module")
def tiny_sd15():
    return analyze("sd15", tiny=True, batch=1)


def test_patched_shares_are_of_the_patched_totals(tiny_sd15):
    a = tiny_sd15
    by_bytes = a.shares("bytes", patched=True)
    by_time = a.shares("time", patched=True)
    for k, c in a.categories.items():
        assert by_bytes[k] == pytest.approx(c.patched_bytes / a.patched_bytes)
        assert by_time[k] == pytest.approx(c.patched_time_s / a.patched_time_s)
    assert by_bytes != a.shares("bytes")


def test_attention_split_is_of_attention_time_and_sequence_shares_of_attention_flops(tiny_sd15):
    a = tiny_sd15
    attention_time = sum(a.categories[c].time_s for c in C.ATTENTION)
    split = a.attention_split("time")
    assert split["spatial"] == pytest.approx(a.categories[C.ATTN_SPATIAL].time_s / attention_time)
    assert split["cross"] == pytest.approx(a.categories[C.ATTN_CROSS].time_s / attention_time)
    assert sum(split.values()) == pytest.approx(1.0)
    rows = a.sequence_lengths()
    assert len(rows) > 1 and sum(g["flops_share"] for g in rows) == pytest.approx(1.0)
    total = sum(call.flops for call in a.attention)
    assert all(g["flops_share"] == pytest.approx(g["flops"] / total) for g in rows)


class _SelfThenCross(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn1 = Attention(query_dim=16, heads=2, dim_head=8)
        self.attn2 = Attention(query_dim=16, cross_attention_dim=32, heads=2, dim_head=8)
        self.proj = nn.Linear(16, 16)

    def forward(self, x, context):
        return self.proj(self.attn2(self.attn1(x), encoder_hidden_states=context))


def test_attention_layer_split_counts_the_projections():
    """Module-level split: every record under an attention module (its Q/K/V/out projections included)."""
    a = analyze(_SelfThenCross(), inputs=(torch.empty(2, 64, 16), torch.empty(2, 5, 32)), dtype="fp16")
    times = {"attn1": 0.0, "attn2": 0.0}
    for rec in a.records:
        for path in times:
            if rec.path == path or rec.path.startswith(path + "."):
                times[path] += a.gpu.op_time(rec.flops, rec.bytes, "fp16")
    split = a.attention_layer_split()
    total = times["attn1"] + times["attn2"]
    assert split["spatial"] == pytest.approx(times["attn1"] / total)
    assert split["cross"] == pytest.approx(times["attn2"] / total)


# ---------------------------------------------------------------------------------------------- studies page


def _cells(lines: list[str]) -> list[list[str]]:
    """The data rows of the markdown table in ``lines``."""
    rows = [ln for ln in "\n".join(lines).splitlines() if ln.startswith("| ")]
    return [[c.strip() for c in row.strip("|").split("|")] for row in rows[1:]]


def _p(x: float) -> str:
    return f"{100 * x:.1f}%"


def test_studies_conv_section_columns(monkeypatch):
    monkeypatch.setattr(studies, "TTI_UNETS", (("sd15", (64,)),))
    tiny = functools.partial(analyze, tiny=True, batch=1)
    (row,) = _cells(studies._conv_section(tiny))
    a = tiny("sd15", resolution=64, gpu=studies.GPU)
    t, tp, f = a.shares("time"), a.shares("time", patched=True), a.shares("flops")
    assert row[3:7] == [_p(f[C.CONV]), _p(t[C.CONV]), _p(tp[C.CONV]), _p(t[C.NORM] + t[C.ELEMENTWISE])]


def test_studies_linear_section_counts_every_attention_kind(monkeypatch):
    monkeypatch.setattr(studies, "TTI_TRANSFORMERS", (("pixart-alpha", None),))
    tiny = functools.partial(analyze, tiny=True, batch=1)
    (row,) = _cells(studies._linear_section(tiny))
    a = tiny("pixart-alpha", resolution=None, gpu=studies.GPU)
    t = a.shares("time")
    assert t[C.ATTN_CROSS] > 0  # PixArt's cross-attention is part of the column
    assert row[5:8] == [_p(t[C.LINEAR]), _p(sum(t[c] for c in C.ATTENTION)),
                        _p(t[C.ELEMENTWISE] + t[C.NORM] + t[C.LAYOUT])]  # fmt: skip


def test_studies_training_rows_split_convolution_forward_and_backward():
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.SiLU(), nn.Conv2d(8, 8, 3, padding=1), nn.Linear(6, 6))
    a = analyze(model, inputs=(torch.empty(2, 3, 6, 6),), dtype="fp16", training=True)
    rows = dict(studies._training_rows(a))
    step = a.step_shares()
    assert rows["convolution forward"] == _p(step[("forward", C.CONV)])
    assert rows["convolution backward"] == _p(step[("backward", C.CONV)])
    assert rows["convolution backward"] != rows["convolution forward"]
    assert rows["AdamW update"] == _p(sum(v for (phase, _), v in step.items() if phase == "optimizer"))
    assert re.fullmatch(r"\d+\.\d%", rows["linear/GEMM (fwd + bwd)"])
