"""The analytic model on Wan-style blocks and torch's RMSNorm: what the GPU runs, as is and as ldmopt patches it."""

import inspect

import pytest
import torch
from torch import nn

from ldmopt.profiler import analyze
from ldmopt.profiler import categories as C
from ldmopt.profiler.fusions import (
    ADALN,
    GATED_RESIDUAL,
    QK_CONCAT,
    QK_NORM_ROPE,
    RMS_NORM,
    WAN_ROUND_TRIPS,
    plan_fusions,
)


def _wan_model(layers=2, dim=64, ffn=96):
    from diffusers import WanTransformer3DModel

    with torch.device("meta"):
        model = WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=dim // 2, in_channels=4, out_channels=4,
            text_dim=24, freq_dim=16, ffn_dim=ffn, num_layers=layers, cross_attn_norm=True,
        )  # fmt: skip
    model = model.to(torch.bfloat16)
    model.rope.float()  # what from_pretrained(torch_dtype=bf16) keeps in fp32: the rotary tables,
    for block in model.blocks:  # the modulation table and the block norms
        block.scale_shift_table.data = block.scale_shift_table.data.float()
        for name in ("norm1", "norm2", "norm3"):
            getattr(block, name).float()
    return model


def _wan_inputs(batch=1, frames=3, h=8, w=10):
    meta = dict(device="meta")
    return {
        "hidden_states": torch.empty(batch, 4, frames, h, w, dtype=torch.bfloat16, **meta),
        "timestep": torch.empty(batch, **meta),
        "encoder_hidden_states": torch.empty(batch, 7, 24, dtype=torch.bfloat16, **meta),
        "return_dict": False,
    }


def test_wan_round_trips_and_epilogues_are_projected():
    a = analyze(_wan_model(), inputs=_wan_inputs(), dtype="bf16", gpu="H200")
    trips = a.fusions[WAN_ROUND_TRIPS]
    # Per block: hidden.float() before norm1, the two gated adds and norm3, their .type_as(h), ff.float(), temb.float()
    assert trips.count >= 2 * 8 and trips.ops_removed == trips.count
    assert a.fusions[ADALN].count >= 2 * 2  # norm1 and norm3 modulations of both blocks
    assert a.fusions[GATED_RESIDUAL].count >= 2 * 2  # attn1 to_out and the feed-forward, through its fp32 cast
    removed = {r.index for r in a.records if r.base == "_to_copy" and r.owner.endswith(".WanTransformerBlock")}
    assert removed and a.patched_bytes < a.total_bytes
    layout = a.categories[C.LAYOUT]
    assert layout.patched_bytes < 0.5 * layout.bytes  # the block's fp32 casts are most of the layout traffic


def test_a_wan_with_weights_keeps_its_fp32_modules_in_the_analysis():
    # The meta copy of a real-weights model cast the modules from_pretrained keeps in fp32 (Wan's time embedder,
    # modulation tables, norms) to the analysis dtype: fewer bytes than the same model analysed by name.
    from ldmopt import configs

    model = configs.build_model("wan", tiny=True, device="cpu", dtype=torch.bfloat16)
    assert model.scale_shift_table.dtype == torch.float32
    by_name = analyze("wan", tiny=True, dtype=torch.bfloat16)
    assert analyze(model, dtype=torch.bfloat16).total_bytes == by_name.total_bytes


def test_round_trips_only_in_wan_blocks():
    class CastBlock(nn.Module):  # the same casts in a block ldmopt does not patch
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(32, elementwise_affine=False)

        def forward(self, x):
            return self.norm(x.float()).type_as(x)

    with torch.device("meta"):
        block = CastBlock().to(torch.bfloat16)
    x = torch.empty(2, 50, 32, device="meta", dtype=torch.bfloat16)
    a = analyze(block, inputs=(x,), dtype="bf16")
    assert a.fusions[WAN_ROUND_TRIPS].count == 0 and a.patched_bytes == a.total_bytes


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # the composite, on purpose
def test_torch_rms_norm_is_one_fused_op_when_torch_fuses_it():
    """torch.nn.RMSNorm runs aten::_fused_rms_norm on a GPU when the weight has the input's dtype (one read, one
    write); with another input dtype (here a model that upcasts, as analyze casts every weight to its dtype) torch
    runs the composite (eight ops), and so does the count."""

    class Upcast(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.RMSNorm(128, eps=1e-6)

        def forward(self, x):
            return self.norm(x.float())

    def records(module):
        x = torch.empty(4, 300, 128, device="meta", dtype=torch.bfloat16)
        return analyze(module, inputs=(x,), dtype="bf16").records

    fused = records(nn.RMSNorm(128, eps=1e-6))
    assert [r.name for r in fused] == ["aten::_fused_rms_norm"]
    assert fused[0].category == C.NORM
    assert fused[0].in_bytes == (4 * 300 * 128 * 2, 128 * 2) and fused[0].out_bytes == 4 * 300 * 128 * 2
    composite = records(Upcast())
    assert len(composite) > 4 and all(r.name != "aten::_fused_rms_norm" for r in composite)


def test_diffusers_rms_norm_is_projected_as_one_row_kernel():
    """diffusers' RMSNorm (SD3.5's qk norms) runs eight ops as is; patched, one read of x and one write of y each."""
    from diffusers import SD3Transformer2DModel

    with torch.device("meta"):
        model = SD3Transformer2DModel(
            sample_size=16, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
            joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=16, out_channels=4,
            pos_embed_max_size=16, qk_norm="rms_norm",
        ).to(torch.bfloat16)  # fmt: skip
    meta = dict(device="meta", dtype=torch.bfloat16)
    inputs = dict(hidden_states=torch.empty(2, 4, 16, 16, **meta), encoder_hidden_states=torch.empty(2, 9, 32, **meta),
                  pooled_projections=torch.empty(2, 16, **meta), timestep=torch.empty(2, device="meta"),
                  return_dict=False)  # fmt: skip
    a = analyze(model, inputs=inputs, dtype="bf16")
    norms = sum(type(m).__name__ == "RMSNorm" for m in model.modules())
    assert norms == 8 and a.fusions[RMS_NORM].count == norms  # q, k, added q, added k per block
    runs = [r for r in a.records if r.owner == "diffusers.models.normalization.RMSNorm"]
    assert a.fusions[RMS_NORM].ops_removed == len(runs) - norms
    norm = a.categories[C.NORM]
    assert norm.patched_bytes < 0.4 * norm.bytes


def test_torch_rms_norm_composite_is_not_claimed():
    with torch.device("meta"):
        norm = nn.RMSNorm(128, eps=1e-6)  # fp32 weight, bf16 input: torch runs the composite, ldmopt leaves it
    x = torch.empty(4, 300, 128, device="meta", dtype=torch.bfloat16)
    a = analyze(norm, inputs=(x,), dtype="bf16")
    assert a.fusions[RMS_NORM].count == 0 and a.patched_bytes == a.total_bytes


def test_projected_savings_add_up():
    """Bytes saved per fusion add up to the total minus the patched bytes: a removed op keeps what its rule left
    counted (the gate/shift/residual reads and the fusing kernel's output write), nothing is saved twice."""
    a = analyze(_wan_model(), inputs=_wan_inputs(), dtype="bf16")
    saved = sum(f.bytes_saved for f in a.fusions.values())
    assert saved > 0 and a.total_bytes - a.patched_bytes == saved
    dit = analyze("dit", tiny=True)
    assert dit.total_bytes - dit.patched_bytes == sum(f.bytes_saved for f in dit.fusions.values())


def test_cast_look_through_only_in_wan_blocks():
    class CastEpilogue(nn.Module):  # GEMM -> fp32 cast -> gate -> residual, in a block ldmopt does not fuse so
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(32, 32)

        def forward(self, x, gate):
            return (x.float() + self.proj(x).float() * gate).type_as(x)

    with torch.device("meta"):
        block = CastEpilogue().to(torch.bfloat16)
    x, gate = torch.empty(2, 50, 32, device="meta", dtype=torch.bfloat16), torch.empty(2, 1, 32, device="meta")
    a = analyze(block, inputs=(x, gate), dtype="bf16")
    assert a.fusions[GATED_RESIDUAL].count == 0 and a.patched_bytes == a.total_bytes


def test_one_diffusers_rms_norm_called_twice_is_two_kernels():
    from diffusers.models.normalization import RMSNorm

    class SharedNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = RMSNorm(64, eps=1e-6)

        def forward(self, q, k):
            return self.norm(q), self.norm(k)

    with torch.device("meta"):
        module = SharedNorm().to(torch.bfloat16)
    q = torch.empty(2, 100, 64, device="meta", dtype=torch.bfloat16)
    a = analyze(module, inputs=(q, q.clone()), dtype="bf16")
    assert a.fusions[RMS_NORM].count == 2
    kernel_bytes = 2 * (2 * q.numel() * 2 + 64 * 2)  # per call: x read, y written, the weight
    assert a.patched_bytes == kernel_bytes


def test_a_patched_model_can_be_analysed_on_meta():
    """The fused ops run on meta tensors too (no autocast query for the meta device): analyze counts ldmopt's ops."""
    import ldmopt
    from ldmopt import configs

    model = configs.build_model("dit", tiny=True)
    assert ldmopt.patch(model).counts()
    a = analyze(model, tiny=True)
    assert any(r.name.startswith("ldmopt::") for r in a.records)


def test_wan_rope_is_projected_into_the_norm_kernel():
    """Wan's processor rotates the query and key norms' outputs with eight elementwise ops each (four multiplies by
    the angle tables, a sub, an add, two strided copies); patched, the norm's row kernel rotates before its write."""
    model = _wan_model(layers=2)
    a = analyze(model, inputs=_wan_inputs(), dtype="bf16", gpu="H200")
    rope = a.fusions[QK_NORM_ROPE]
    assert rope.count == 2 * 2 and rope.ops_removed == 2 * 2 * 8  # q and k of each block's self-attention
    in_attn1 = [r for r in a.records if r.path.endswith("attn1") and r.base in ("mul", "sub", "add", "copy_")]
    assert len(in_attn1) == rope.ops_removed
    cross = [r for r in a.records if r.path.endswith("attn2") and r.base in ("mul", "sub", "add", "copy_")]
    assert not cross  # no RoPE in cross-attention
    # What stays of each chain: one read of each angle table (the kernel still reads cos and sin).
    angle_reads = sum(min(b for b in r.in_bytes) for r in in_attn1 if r.base == "mul") // 4
    assert a.total_bytes - a.patched_bytes >= rope.bytes_saved > 0
    assert rope.bytes_saved == sum(r.bytes for r in in_attn1) - 2 * angle_reads


def test_allocations_move_no_bytes():
    class Fresh(nn.Module):
        def forward(self, x):
            out = torch.empty_like(x)
            out[..., 0::2] = x[..., 1::2] * 2
            out[..., 1::2] = x[..., 0::2]
            return out

    x = torch.empty(2, 50, 32, device="meta", dtype=torch.bfloat16)
    records = analyze(Fresh(), inputs=(x,), dtype="bf16").records
    empty = [r for r in records if r.base == "empty_like"]
    assert len(empty) == 1 and empty[0].bytes == 0 and empty[0].producers == ()


def test_flux_rope_is_projected_into_the_norm_kernels():
    """Flux rotates q and k after concatenating text and image streams: negation, interleave, three casts, two
    multiplies and an add per tensor go; the joint norm kernel writes the concatenated q and k (those two
    concatenations go, the values' stays)."""
    from diffusers import FluxTransformer2DModel

    with torch.device("meta"):
        model = FluxTransformer2DModel(
            patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=32,
            num_attention_heads=2, joint_attention_dim=24, pooled_projection_dim=12, axes_dims_rope=(8, 12, 12),
        ).to(torch.bfloat16)  # fmt: skip
    meta = dict(device="meta")
    inputs = dict(
        hidden_states=torch.empty(1, 60, 16, dtype=torch.bfloat16, **meta),
        encoder_hidden_states=torch.empty(1, 7, 24, dtype=torch.bfloat16, **meta),
        pooled_projections=torch.empty(1, 12, dtype=torch.bfloat16, **meta), timestep=torch.empty(1, **meta),
        img_ids=torch.empty(60, 3, **meta), txt_ids=torch.empty(7, 3, **meta), return_dict=False,
    )  # fmt: skip
    a = analyze(model, inputs=inputs, dtype="bf16", gpu="H200")
    rope = a.fusions[QK_NORM_ROPE]
    assert rope.count == 2 * 3 and rope.ops_removed == 8 * rope.count  # q and k of three attentions
    rotation = [r for r in a.records if r.path.endswith(".attn") and r.base in ("neg", "stack", "mul", "_to_copy")]
    assert len(rotation) + rope.count == rope.ops_removed  # and one add per tensor
    _saved, rule, removed, _stats = plan_fusions(a.records)
    cats = [r for r in a.records if r.path.endswith(".attn") and r.base == "cat"]  # q, k, v of the double block
    assert [(r.index in removed, rule.get(r.index)) for r in cats] == [(True, QK_CONCAT)] * 2 + [(False, None)]


def test_rope_of_generic_attention_processors_is_projected():
    """Qwen-Image and HunyuanVideo rotate in diffusers' generic Attention: their records carry the processor's name,
    so only those processors' rotations are projected (SD3's generic Attention rotates nothing)."""
    from diffusers import HunyuanVideoTransformer3DModel, QwenImageTransformer2DModel

    meta = dict(device="meta")
    with torch.device("meta"):
        qwen = QwenImageTransformer2DModel(
            patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
            joint_attention_dim=24, axes_dims_rope=(4, 6, 6),
        ).to(torch.bfloat16)  # fmt: skip
        hunyuan = HunyuanVideoTransformer3DModel(
            in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=1,
            num_single_layers=1, num_refiner_layers=1, text_embed_dim=24, pooled_projection_dim=12,
            rope_axes_dim=(4, 6, 6),
        ).to(torch.bfloat16)  # fmt: skip
    bf16 = dict(dtype=torch.bfloat16, **meta)
    qwen_inputs = dict(
        hidden_states=torch.empty(1, 15, 16, **bf16), encoder_hidden_states=torch.empty(1, 7, 24, **bf16),
        encoder_hidden_states_mask=None, timestep=torch.empty(1, **meta), img_shapes=[[(1, 3, 5)]], return_dict=False,
    )  # fmt: skip
    if "txt_seq_lens" in inspect.signature(type(qwen).forward).parameters:  # diffusers before 0.37 needs them
        qwen_inputs["txt_seq_lens"] = [7]
    fusions = analyze(qwen, inputs=qwen_inputs, dtype="bf16").fusions
    rope = fusions[QK_NORM_ROPE]
    assert rope.count == 2 * 4 and rope.ops_removed == 3 * rope.count  # cast, complex multiply, cast back
    assert fusions[QK_CONCAT].count == 2 * 2  # [text | image] q and k of each block, written by the joint kernel
    hunyuan_inputs = dict(
        hidden_states=torch.empty(1, 4, 3, 6, 10, **bf16), timestep=torch.empty(1, dtype=torch.long, **meta),
        encoder_hidden_states=torch.empty(1, 7, 24, **bf16), encoder_attention_mask=torch.ones(1, 7, **meta),
        pooled_projections=torch.empty(1, 12, **bf16), guidance=torch.empty(1, **meta), return_dict=False,
    )  # fmt: skip
    fusions = analyze(hunyuan, inputs=hunyuan_inputs, dtype="bf16").fusions
    rope = fusions[QK_NORM_ROPE]
    assert rope.count == 2 * 2 and rope.ops_removed == 8 * rope.count  # q, k of the dual and the single block
    # The dual block's [video | text] q and k (joint kernel); the single block's cat of the rotated video rows and
    # the text rows of q and k (one kernel over all rows, the text rows turned by zero)
    assert fusions[QK_CONCAT].count == 2 + 2


def test_cogvideox_layer_norm_rope_is_projected():
    """CogVideoX rotates the video tokens of its per-head LayerNorm'd q and k and copies them back into the slice:
    negation, interleave, three casts, two multiplies, an add and the copy go per tensor (the norm stays)."""
    from diffusers import CogVideoXTransformer3DModel

    meta = dict(device="meta")
    with torch.device("meta"):
        model = CogVideoXTransformer3DModel(
            num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, time_embed_dim=16,
            text_embed_dim=24, num_layers=2, sample_width=8, sample_height=6, sample_frames=5, max_text_seq_length=7,
            use_rotary_positional_embeddings=True,
        ).to(torch.bfloat16)  # fmt: skip
    bf16 = dict(dtype=torch.bfloat16, **meta)
    inputs = dict(
        hidden_states=torch.empty(1, 2, 4, 6, 8, **bf16), encoder_hidden_states=torch.empty(1, 7, 24, **bf16),
        timestep=torch.empty(1, dtype=torch.long, **meta), return_dict=False,
        image_rotary_emb=(torch.empty(24, 16, **meta), torch.empty(24, 16, **meta)),
    )  # fmt: skip
    a = analyze(model, inputs=inputs, dtype="bf16")
    rope = a.fusions[QK_NORM_ROPE]
    assert rope.count == 2 * 2 and rope.ops_removed == 9 * rope.count  # q and k of two layers
    norms = [r for r in a.records if r.base == "native_layer_norm" and r.path.endswith((".norm_q", ".norm_k"))]
    removed = plan_fusions(a.records)[2]
    assert len(norms) == 4 and not removed & {r.index for r in norms}


def test_hunyuan_dit_layer_norm_rope_is_projected():
    """HunyuanDiT rotates every query (and the self-attention's keys) after the per-head LayerNorms."""
    from diffusers import HunyuanDiT2DModel

    meta = dict(device="meta")
    with torch.device("meta"):
        model = HunyuanDiT2DModel(
            num_attention_heads=2, attention_head_dim=8, in_channels=4, patch_size=2, sample_size=8, hidden_size=16,
            num_layers=2, cross_attention_dim=24, cross_attention_dim_t5=32, pooled_projection_dim=12, text_len=5,
            text_len_t5=6,
        )  # fmt: skip
    inputs = dict(
        hidden_states=torch.empty(1, 4, 8, 8, **meta), timestep=torch.empty(1, **meta),
        encoder_hidden_states=torch.empty(1, 5, 24, **meta), text_embedding_mask=torch.ones(1, 5, **meta),
        encoder_hidden_states_t5=torch.empty(1, 6, 32, **meta), text_embedding_mask_t5=torch.ones(1, 6, **meta),
        image_meta_size=torch.empty(1, 6, **meta), style=torch.zeros(1, dtype=torch.long, **meta),
        image_rotary_emb=(torch.empty(16, 8, **meta), torch.empty(16, 8, **meta)), return_dict=False,
    )  # fmt: skip
    rope = analyze(model, inputs=inputs, dtype="fp32").fusions[QK_NORM_ROPE]
    assert rope.count == 2 * 3  # per block: attn1's q and k, attn2's q (its keys are the text's, not rotated)
    assert rope.ops_removed == 5 * rope.count  # negation, interleave, two multiplies, the add (fp32: no casts)


def test_ltx_rope_is_projected():
    """LTX-Video rotates its self-attention's q and k, normed across heads, on [B, S, C] with per-sample tables."""
    from diffusers import LTXVideoTransformer3DModel

    meta = dict(device="meta")
    with torch.device("meta"):
        model = LTXVideoTransformer3DModel(
            in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=12, cross_attention_dim=24,
            num_layers=2, caption_channels=16,
        ).to(torch.bfloat16)  # fmt: skip
    bf16 = dict(dtype=torch.bfloat16, **meta)
    inputs = dict(
        hidden_states=torch.empty(1, 30, 8, **bf16), encoder_hidden_states=torch.empty(1, 6, 16, **bf16),
        timestep=torch.empty(1, dtype=torch.long, **meta), encoder_attention_mask=torch.ones(1, 6, **meta),
        num_frames=2, height=3, width=5, return_dict=False,
    )  # fmt: skip
    rope = analyze(model, inputs=inputs, dtype="bf16").fusions[QK_NORM_ROPE]
    # negation, interleave, three casts, two multiplies, the add per tensor
    assert rope.count == 2 * 2 and rope.ops_removed == 8 * rope.count


def test_wan_image_to_video_cross_attention_is_cross_not_joint():
    """attn2 of Wan's image-to-video model projects image keys with add_k_proj beside the text keys: cross-attention
    (keys from the context only), where an added projection otherwise means SD3/Flux's joint attention."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
        text_dim=32, freq_dim=32, ffn_dim=64, num_layers=1, image_dim=24, added_kv_proj_dim=32,
    )  # fmt: skip
    inputs = {
        "hidden_states": torch.randn(1, 4, 3, 16, 16),
        "timestep": torch.tensor([500]),
        "encoder_hidden_states": torch.randn(1, 512, 32),  # Wan's processor takes the image keys past 512 text ones
        "encoder_hidden_states_image": torch.randn(1, 7, 24),
    }
    a = analyze(model, inputs=inputs, dtype="fp32")
    kinds = sorted((g["kind"], g["q_len"], g["kv_len"]) for g in a.sequence_lengths())
    assert kinds == [("cross", 192, 7), ("cross", 192, 512), ("spatial", 192, 192)], kinds
