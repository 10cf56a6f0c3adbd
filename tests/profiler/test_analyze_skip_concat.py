"""The analytic model's ``skip concatenation -> conv loads`` fusion (the UNet up blocks' channel concatenation of the
running activation with the down path's skip, which the patched resnets read in two parts: ``up_block_skip``) and
``nearest upsample -> conv loads`` (Upsample2D's conv reading its input through index arithmetic: ``upsample_conv``)."""

import pytest
import torch

from ldmopt.profiler import analyze
from ldmopt.profiler.fusions import SKIP_CONCAT, plan_fusions, single_key_paths


@pytest.mark.parametrize("name", ["sd15", "animatediff", "modelscope", "svd"])
def test_every_up_block_concatenation_goes(name):
    from ldmopt.configs import build_model

    model = build_model(name, tiny=True, device="meta", dtype=torch.float16)
    video = name in ("animatediff", "modelscope", "svd")
    a = analyze(model, gpu="H200", placement="triton", **({"frames": 2} if video else {}))
    up_resnets = sum(len(block.resnets) for block in model.up_blocks)
    _saved, rule, removed, _stats = plan_fusions(a.records, single_key_paths(a.attention))
    cats = [r for r in a.records if r.base == "cat" and r.path.startswith("up_blocks.") and r.path.count(".") == 1]
    assert len(cats) == up_resnets > 0
    assert all(r.index in removed and rule[r.index] == SKIP_CONCAT for r in cats)
    stat = a.fusions[SKIP_CONCAT]
    assert stat.count == stat.ops_removed == up_resnets
    assert stat.bytes_saved == sum(r.bytes for r in cats)
    # What reads the concatenation (norm1 statistics, conv_shortcut) still reads the two parts: not claimed.
    readers = {i for r in cats for i in r.consumers}
    assert readers and not any(i in removed for i in readers)


def test_other_concatenations_stay():
    # The rule is about the up blocks' skip only: a concatenation that another module makes is left to other rules.
    from ldmopt.configs import build_model

    model = build_model("flux", tiny=True, device="meta", dtype=torch.bfloat16)
    a = analyze(model, gpu="H200", dtype="bf16")
    assert a.fusions[SKIP_CONCAT].count == 0
    assert any(r.base == "cat" for r in a.records)


@pytest.mark.parametrize("name", ["sd15", "sd15-vae"])
def test_upsampler_interpolation_goes_and_its_conv_reads_the_input(name):
    from ldmopt.configs import build_model
    from ldmopt.profiler.fusions import UPSAMPLE_CONV

    model = build_model(name, tiny=True, device="meta", dtype=torch.float16)
    a = analyze(model, gpu="H200", placement="triton")
    upsamplers = [m for m in model.modules() if type(m).__name__ == "Upsample2D" and m.use_conv]
    saved, rule, removed, _stats = plan_fusions(a.records, single_key_paths(a.attention))
    ups = [r for r in a.records if r.base == "upsample_nearest2d"]
    assert len(ups) == len(upsamplers) == a.fusions[UPSAMPLE_CONV].count > 0
    assert all(r.index in removed and rule[r.index] == UPSAMPLE_CONV for r in ups)
    for up in ups:
        (conv,) = [a.records[i] for i in up.consumers]
        # The conv now reads x, a quarter of the upsampled tensor it read before.
        assert conv.index not in removed and saved[conv.index] >= conv.in_bytes[0] - up.in_bytes[0] > 0
        assert 4 * up.in_bytes[0] == conv.in_bytes[0]
