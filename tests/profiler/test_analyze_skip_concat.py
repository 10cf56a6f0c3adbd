"""The analytic model's ``skip concatenation -> conv loads`` fusion: the UNet up blocks' channel concatenation of the
running activation with the down path's skip, which the patched resnets read in two parts (``up_block_skip``)."""

import pytest
import torch

from ldmopt.profiler import analyze
from ldmopt.profiler.fusions import SKIP_CONCAT, plan_fusions, single_key_paths


@pytest.mark.parametrize("name", ["sd15", "animatediff", "modelscope", "svd"])
def test_every_up_block_concatenation_goes(name):
    from ldmopt.configs import build_model

    model = build_model(name, tiny=True, device="meta", dtype=torch.float16)
    video = name in ("animatediff", "modelscope", "svd")
    a = analyze(model, gpu="H200", **({"frames": 2} if video else {}))
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
