"""The analytic model's projection of the temporal convolution blocks ldmopt fuses (ldmopt/nn/temporal_resnet.py):
SVD's temporal resnet with its alpha blend and the UNet3D's TemporalConvLayer; GroupNorm statistics that a fused
conv's epilogue hands to the next GroupNorm of its block; and Conv3d that ldmopt leaves to cuDNN."""

import torch
from torch import nn

from ldmopt.profiler import analyze
from ldmopt.profiler.fusions import ALPHA_BLEND, BLEND_GEMM, CONV_EPILOGUE, GN_CONV, GN_STATS, plan_fusions


def _plan(a):
    _saved, rule, removed, _stats = plan_fusions(a.records)
    return rule, removed


def _statistics_pass_gone(a, r) -> bool:
    """GroupNorm ``r`` is read through the conv's loads (GN_CONV) and its statistics pass went too (GN_STATS)."""
    saved, rule, removed, _stats = plan_fusions(a.records)
    return rule.get(r.index) == GN_CONV and r.index in removed and saved[r.index] == r.bytes


def _count(model, name):
    return sum(type(m).__name__ == name for m in model.modules())


def test_svd_temporal_resnets_blend_in_the_epilogue():
    from ldmopt.configs import build_model

    model = build_model("svd", tiny=True, device="meta", dtype=torch.float16)
    a = analyze(model, gpu="H200", frames=2)
    rule, removed = _plan(a)
    resblocks = _count(model, "SpatioTemporalResBlock")
    # Each resnet block's blend (two products and the add) goes; the transformers' blends stay.
    assert a.fusions[ALPHA_BLEND].count == resblocks > 0
    assert a.fusions[ALPHA_BLEND].ops_removed == 3 * resblocks
    # The containers' blends go into their proj_out's loads (one per container: SVD has one block each).
    assert a.fusions[BLEND_GEMM].count == _count(model, "TransformerSpatioTemporalModel") > 0
    blend_ops = [r for r in a.records if r.owner.endswith(".AlphaBlender") and r.base in ("mul", "add")]
    for r in blend_ops:
        expected = ALPHA_BLEND if ".resnets." in r.path else BLEND_GEMM
        assert r.index in removed and rule[r.index] == expected, r
    # Every Conv3d is a temporal resnet's (3, 1, 1): fused with GroupNorm + SiLU in its loads.
    convs3d = [r for r in a.records if r.base == "convolution" and r.owner.endswith(".Conv3d")]
    norms = [a.records[r.producers[0]] for r in convs3d]
    assert len(convs3d) == 2 * resblocks
    silus = [n for n in norms if n.base == "silu"]
    assert len(silus) == len(norms) and all(rule.get(s.index) == GN_CONV for s in silus)


def test_group_norm_statistics_from_the_previous_conv_of_the_block():
    from ldmopt.configs import build_model

    model = build_model("modelscope", tiny=True, device="meta", dtype=torch.float16)
    a = analyze(model, gpu="H200", frames=2, placement="triton")
    rule, removed = _plan(a)
    norms = [r for r in a.records if r.base == "native_group_norm"]
    by_path = {r.path: r for r in norms}
    # ResnetBlock2D: norm2's statistics come from conv1's epilogue; norm1 keeps its statistics pass (GN_CONV).
    for path, r in by_path.items():
        if path.endswith(".norm2") and ".resnets." in path:
            assert _statistics_pass_gone(a, r), path
        if path.endswith(".norm1") and ".resnets." in path:
            assert rule.get(r.index) == GN_CONV and r.index not in removed, path
    # TemporalConvLayer: stages 2-4 from the previous stage's epilogue, stage 1 from a statistics pass.
    temp = [r for r in norms if ".temp_convs." in r.path]
    assert temp and len(temp) == 4 * _count(model, "TemporalConvLayer")
    for r in temp:
        assert rule.get(r.index) == GN_CONV and _statistics_pass_gone(a, r) != r.path.endswith(".conv1.0"), r.path
    # Chained across blocks they are not (each block computes its norm1 statistics).
    assert a.fusions[GN_STATS].count == sum(_statistics_pass_gone(a, r) for r in norms)


class _VideoVAEBlock(nn.Module):
    """A 3x3x3 video convolution after GroupNorm + SiLU, with a residual: not a kernel ldmopt fuses."""

    def __init__(self):
        super().__init__()
        self.norm = nn.GroupNorm(4, 16)
        self.act = nn.SiLU()
        self.conv = nn.Conv3d(16, 16, 3, padding=1)

    def forward(self, x):
        return x + self.conv(self.act(self.norm(x)))


def test_other_conv3d_stays_unfused():
    with torch.device("meta"):
        model = _VideoVAEBlock().half()
        x = torch.empty(1, 16, 4, 8, 8, dtype=torch.float16)
    a = analyze(model, gpu="H200", inputs={"x": x})
    rule, _ = _plan(a)
    conv = next(r for r in a.records if r.base == "convolution")
    assert not rule.get(a.records[conv.producers[0]].index)  # the SiLU before it stays
    assert not [r for r in a.records if rule.get(r.index) in (GN_CONV, CONV_EPILOGUE)]


def test_container_proj_out_adds_the_residual_and_skips_the_nchw_copy():
    from ldmopt.configs import build_model
    from ldmopt.profiler.fusions import RESIDUAL

    for name, frames in (("sdxl", None), ("sd15", None), ("svd", 2)):
        model = build_model(name, tiny=True, device="meta", dtype=torch.float16)
        a = analyze(model, gpu="H200", frames=frames)
        rule, removed = _plan(a)
        containers = {"Transformer2DModel", "TransformerSpatioTemporalModel"}
        owned = [r for r in a.records if r.owner.rpartition(".")[2] in containers]
        copies = [r for r in owned if r.base in ("clone", "contiguous", "copy_")]
        adds = [r for r in owned if r.base == "add" and r.in_bytes[0] == r.out_bytes == r.in_bytes[1]]
        assert copies and all(r.index in removed for r in copies), name
        # The output add goes (GEMM epilogue, or conv epilogue for SD1.5's 1x1 proj_out); SVD's "+ emb" before the
        # temporal block stays (its time embedding is broadcast: not a same-shape add).
        assert adds and all(r.index in removed and rule[r.index] in (RESIDUAL, CONV_EPILOGUE) for r in adds), name
        # A Linear proj_in on the GroupNorm's strided output: its separate bias add goes with the fused conv.
        for r in a.records:
            if r.base == "add" and r.path.endswith(".proj_in"):
                assert r.index in removed and rule[r.index] == GN_CONV, r
