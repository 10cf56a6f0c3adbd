"""Every family ldmopt.patch covers: tiny random-weight model, patched vs stock output, report counts, exact unpatch.

Reference backend (``use_backend("torch")``) for all; the Triton kernels in the interpreter for SD-UNet, DiT and
AnimateDiff. Tolerances: tests/patch/helpers.py (fp32 rounding only).
"""

import pytest
import torch

import ldmopt
from tests.patch import models
from tests.patch.helpers import (
    ATOL_TRITON,
    RTOL_TRITON,
    assert_outputs_close,
    assert_same_snapshot,
    output_tensor,
    snapshot,
)

# Modules replaced per rule on each tiny model (tests/patch/models.py).
EXPECTED = {
    "sd15": {"group_norm": 20, "group_norm_silu": 1},
    "sd21": {"group_norm": 20, "group_norm_silu": 1},
    "sdxl": {"group_norm": 20, "group_norm_silu": 1},
    "vae": {"group_norm": 22, "group_norm_silu": 2},
    "dit": {},
    "pixart": {},
    "sd3": {},
    "flux": {},
    "animatediff": {"group_norm": 27, "group_norm_silu": 1},
    "svd": {"group_norm": 36, "group_norm_silu": 1},
    "modelscope": {"group_norm": 25, "group_norm_silu": 1, "group_norm_silu_seq": 32},
    "latte": {},
}


def _build(family):
    model = models.BUILDERS[family]().eval()
    return model, models.inputs(family, model)


def _run(model, kwargs):
    with torch.no_grad():
        return output_tensor(model(**kwargs))


@pytest.mark.parametrize("family", list(EXPECTED))
def test_family_reference_backend(family):
    model, x = _build(family)
    ref = _run(model, x)
    before = snapshot(model)
    report = ldmopt.patch(model)
    assert report.counts() == EXPECTED[family]
    assert not report.skipped
    with ldmopt.use_backend("torch"):
        out = _run(model, x)
    assert_outputs_close(out, ref, name=family)
    assert ldmopt.unpatch(model) == report.total
    assert_same_snapshot(before, snapshot(model))
    assert torch.equal(_run(model, x), ref)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["sd15", "dit", "animatediff"])
def test_family_triton_interpreter(family):
    model, x = _build(family)
    ref = _run(model, x)
    report = ldmopt.patch(model)
    with ldmopt.use_backend("triton"):
        out = _run(model, x)
    assert_outputs_close(out, ref, ATOL_TRITON, RTOL_TRITON, name=f"{family} triton")
    ran = report.backends()
    assert all(set(per) == {"triton"} for per in ran.values()), ran
    assert sum(sum(per.values()) for per in ran.values()) >= report.total
