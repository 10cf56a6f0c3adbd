"""analyze on models as users hold them: real weights with their processors and adapters, SVD's one-key cross
attention inside temporal blocks, diffusers' baddbmm on an empty score tensor, fp32 at the rate torch runs it."""

import contextlib
import copy

import pytest
import torch

from ldmopt import configs
from ldmopt.profiler import GPUSpec, analyze

pytest.importorskip("diffusers")


def _tiny_sd15(device="cpu"):
    return configs.build_model("sd15", device=device, dtype=torch.float32, tiny=True)


def test_real_weights_keep_processors_and_adapters():
    from diffusers.models.attention_processor import AttnProcessor
    from peft import LoraConfig

    unet = _tiny_sd15()
    unet.set_attn_processor(AttnProcessor())  # materialises the score matrix: more attention bytes than SDPA
    unet.add_adapter(LoraConfig(r=4, target_modules=["to_q", "to_k", "to_v"]))
    stock = analyze(_tiny_sd15(), dtype=torch.float32)
    real = analyze(unet, dtype=torch.float32)
    meta = analyze(copy.deepcopy(unet).to("meta"), dtype=torch.float32)
    assert real.params == meta.params > stock.params  # the LoRA parameters are counted
    assert sum(c.flops for c in real.categories.values()) == sum(c.flops for c in meta.categories.values())
    assert sum(c.bytes for c in real.categories.values()) == sum(c.bytes for c in meta.categories.values())
    assert sum(c.bytes for c in real.categories.values()) > sum(c.bytes for c in stock.categories.values())
    assert next(unet.parameters()).device.type == "cpu"  # the user's model is untouched


def test_baddbmm_on_an_empty_score_tensor_reads_only_q_and_k():
    from diffusers.models.attention_processor import AttnProcessor

    unet = configs.build_model("sd15", tiny=True)
    unet.set_attn_processor(AttnProcessor())
    records = [r for r in analyze(unet).records if r.base == "baddbmm"]
    assert records and all(len(r.in_bytes) == 2 for r in records), {len(r.in_bytes) for r in records}


def test_svd_one_key_cross_attention_is_not_temporal():
    a = analyze("svd", tiny=True)
    kinds = {(call.kind, call.kv_len) for call in a.attention}
    assert ("temporal", 1) not in kinds, kinds
    assert any(kind == "cross" and kv == 1 for kind, kv in kinds) and any(kind == "temporal" for kind, _ in kinds)


@contextlib.contextmanager
def _tf32(conv: bool, matmul: bool = False):
    """torch's TF32 switches for cuDNN and cuBLAS, restored after. Not monkeypatch: cuBLAS's is served by a module
    __getattr__, which pytest 9.2's undo takes for an attribute it added and deletes (AttributeError)."""
    before = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = conv, matmul
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = before


def test_fp32_convolutions_at_the_rate_torch_runs_them():
    times = {}
    for allow_tf32 in (True, False):
        with _tf32(conv=allow_tf32):
            a = analyze("sd15", resolution=256, batch=1, dtype=torch.float32, gpu="H100")
        conv = [r for r in a.records if r.base == "convolution" and r.flops]
        rate = a.gpu.peak_flops("tf32" if allow_tf32 else "fp32")
        expected = sum(max(r.flops / rate, r.bytes / a.gpu.bandwidth) for r in conv)
        assert a.categories["convolution"].time_s == pytest.approx(expected, rel=1e-9)
        assert any("TF32" in note for note in a.notes) == allow_tf32
        times[allow_tf32] = expected
    assert times[True] < times[False] / 2  # TF32 tensor cores, not the CUDA-core fp32 rate


def test_a_meta_model_is_analysed_in_the_dtype_asked_and_in_eval_mode():
    # A model already on meta was analysed as it was: its own dtype (a bf16 analysis of the fp16 zoo model crashed
    # in the first convolution) and its own train/eval mode (dropout ops counted in an inference analysis).
    unet = configs.build_model("sd15", tiny=True)  # meta, fp16
    assert analyze(unet, dtype="bf16").dtype == "bf16"
    assert {p.dtype for p in unet.parameters()} == {torch.float16}  # the caller's model is not cast

    block = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Dropout(0.1)).train()
    inputs = (torch.empty(7, 64),)
    real = analyze(block, inputs=inputs, dtype="fp16")
    meta = analyze(copy.deepcopy(block).to("meta"), inputs=inputs, dtype="fp16")
    assert [r.name for r in meta.records] == [r.name for r in real.records] == ["aten::addmm"]
    assert meta.total_bytes == real.total_bytes == (7 * 64 + 64 * 128 + 128 + 7 * 128) * 2
    assert block.training


def test_one_tensor_as_inputs_is_one_positional_argument():
    # As profile() takes it: the tensor was unpacked along dim 0 (tuple(tensor)), each row a separate argument.
    linear = torch.nn.Linear(64, 128)
    for batch in (1, 4):
        a = analyze(linear, inputs=torch.empty(batch, 64), dtype="fp32")
        assert a.total_flops == analyze(linear, inputs=(torch.empty(batch, 64),), dtype="fp32").total_flops
        assert a.total_flops == 2 * batch * 64 * 128


@pytest.mark.parametrize(("conv_tf32", "matmul_tf32"), [(True, False), (False, True)])
def test_patched_fp32_fused_convs_and_gemms_at_the_rate_of_the_ops_they_replace(conv_tf32, matmul_tf32):
    # ldmopt's fused conv and GEMMs were projected at the CUDA-core fp32 peak while the stock convolutions got TF32:
    # the patched sd15 at fp32 was projected 1.6x slower than stock with fewer bytes and the same FLOPs.
    def patched_fp32(conv: bool, matmul: bool):
        with _tf32(conv, matmul):
            return analyze("sd15", tiny=True, batch=1, dtype=torch.float32, gpu=compute_bound, patched=True)

    # The tiny model's GEMMs are memory-bound on a real GPU: on this one every op with FLOPs is compute-bound.
    compute_bound = GPUSpec("compute-bound", hbm_bytes_per_s=1e18, matmul_flops={"fp32": 1e12, "tf32": 8e12},
                            vector_flops=1e12)  # fmt: skip

    ieee = patched_fp32(False, False)
    a = patched_fp32(conv_tf32, matmul_tf32)
    assert a.categories["ldmopt"].time_s < ieee.categories["ldmopt"].time_s
    fused = [r for r in a.records if r.category == "ldmopt"]
    follows = {r.name: r.fp32_follows for r in fused if r.flops}
    assert follows["ldmopt::gn_conv2d"] in ("conv", "matmul") and follows["ldmopt::linear_fwd"] == "matmul"
    tf32 = {"conv": conv_tf32, "matmul": matmul_tf32, "": False}
    expected = sum(a.gpu.op_time(r.flops, r.bytes, "tf32" if tf32[r.fp32_follows] else "fp32") for r in fused)
    assert a.categories["ldmopt"].time_s == pytest.approx(expected, rel=1e-9)


def test_a_groupnorm_outside_the_fused_blocks_is_projected_as_patch_runs_it():
    # GroupNorm -> SiLU -> Flatten -> Linear: patch fuses the pair into one pass (an nn.Sequential's), not into the
    # Linear's loads, which read C x H x W features; the projection claimed the loads fusion.
    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Conv2d(4, 8, 3, padding=1),
            torch.nn.GroupNorm(2, 8),
            torch.nn.SiLU(),
            torch.nn.Flatten(),
            torch.nn.Linear(8 * 16 * 16, 10),
        )

    x = torch.randn(2, 4, 16, 16)
    rules = analyze(model(), inputs=x, placement="triton")
    claimed = {name: stat.count for name, stat in rules.fusions.items() if stat.count}
    assert claimed == {"GroupNorm + SiLU in one pass": 1}
    recorded = analyze(model(), inputs=x, patched=True)
    assert rules.patched_bytes == pytest.approx(recorded.total_bytes, rel=0.01)
