"""ldmopt.nn.stats_handover for two-part inputs: an up block's resnet reads ``cat([hidden, skip], 1)``, skip written
by the down block long before. Each offered output is recorded with its channel sums (when its producer summed them);
``take_parts`` finalises the concatenation's GroupNorm statistics from both parts' sums, or teaches their producers to
sum. A hand-over must never change a result."""

import pytest
import torch

import ldmopt
from ldmopt.nn import stats_handover as handover
from ldmopt.ops.gn_conv2d import channel_sums_torch
from tests.patch import models
from tests.patch.helpers import assert_outputs_close, output_tensor, triton_only_for
from tests.tolerances import assert_close

pytest.importorskip("diffusers")


pytestmark = pytest.mark.usefixtures("fresh_handover")


class _Producer(torch.nn.Module):
    pass


def _expected(head, tail, groups, eps):
    both = torch.cat([head, tail], 1).double()
    var, mean = torch.var_mean(both.reshape(both.shape[0], groups, -1), dim=-1, unbiased=False)
    return mean, torch.rsqrt(var + eps)


def _offered_pair(with_sums=True):
    """Two producers' outputs (10 and 14 channels: groups of 4 straddle them), offered in order as a down block's
    skip and an up block's hidden would be."""
    skip_producer, hidden_producer = _Producer(), _Producer()
    skip, hidden = torch.randn(2, 14, 5, 3) + 0.5, torch.randn(2, 10, 5, 3) * 2.0
    handover.offer(skip, skip_producer, sums=channel_sums_torch(skip) if with_sums else None)
    handover.offer(torch.randn(2, 14, 5, 3), _Producer())  # what came in between moves the single slot on
    handover.offer(hidden, hidden_producer, sums=channel_sums_torch(hidden) if with_sums else None)
    return (hidden, skip), (hidden_producer, skip_producer)


def test_statistics_of_the_concatenation_come_from_both_parts_sums():
    (hidden, skip), _ = _offered_pair()
    with ldmopt.use_backend("torch"):
        mean, rstd = handover.take_parts(hidden, skip, 6, 1e-5, "test")
    expected = _expected(hidden, skip, 6, 1e-5)
    assert_close(mean, expected[0], torch.float32, "mean")
    assert_close(rstd, expected[1], torch.float32, "rstd")
    assert handover.handed_over["test"] == 1
    # a record stays while its tensor lives: a skip read by two consumers serves both
    assert handover.take_parts(hidden, skip, 3, 1e-6, "test") is not None


def test_producers_without_sums_learn_to_sum():
    (hidden, skip), (hidden_producer, skip_producer) = _offered_pair(with_sums=False)
    assert not handover.wants_sums(hidden_producer, hidden)
    assert handover.take_parts(hidden, skip, 6, 1e-5, "test") is None
    assert not handover.handed_over
    assert handover.wants_sums(hidden_producer, hidden) and handover.wants_sums(skip_producer, skip)
    assert not handover.wants_sums(hidden_producer, hidden.double())  # fp64 runs the reference: nothing handed
    handover.forget_modules([hidden_producer])
    assert not handover.wants_sums(hidden_producer, hidden) and handover.wants_sums(skip_producer, skip)


@pytest.mark.parametrize("change", ["skip modified in place", "hidden modified in place", "hidden unrecorded"])
def test_anything_but_two_unmodified_recorded_parts_is_refused(change):
    (hidden, skip), _ = _offered_pair()
    if change == "skip modified in place":
        skip.mul_(2.0)
    elif change == "hidden modified in place":
        hidden[:, :, 0].add_(1.0)  # as FreeU scales part of hidden's channels
    else:
        hidden = hidden.clone()
    assert handover.take_parts(hidden, skip, 6, 1e-5, "test") is None
    assert not handover.handed_over


def test_fp64_parts_take_nothing_and_teach_nothing():
    # fp64 runs the reference backend, whose statistics pass is as exact as it gets: nothing to hand over
    producers = (_Producer(), _Producer())
    parts = (torch.randn(2, 10, 5, 3, dtype=torch.float64), torch.randn(2, 14, 5, 3, dtype=torch.float64))
    for producer, part in zip(producers, parts):
        handover.offer(part, producer, sums=channel_sums_torch(part))
    assert handover.take_parts(*parts, 6, 1e-5, "test") is None and not handover.handed_over
    assert not any(handover.wants_sums(p, t.float()) for p, t in zip(producers, parts))


def test_a_part_no_producer_offered_teaches_the_other_nothing():
    # An up block's skip from conv_in or a stock downsampler never comes with sums: the hidden's sums could not serve
    hidden_producer, hidden, skip = _Producer(), torch.randn(2, 10, 5, 3), torch.randn(2, 14, 5, 3)
    handover.offer(hidden, hidden_producer)
    assert handover.take_parts(hidden, skip, 6, 1e-5, "test") is None
    assert not handover.wants_sums(hidden_producer, hidden)


def test_records_die_with_their_tensors():
    (hidden, skip), _ = _offered_pair()
    assert len(handover._produced) == 2  # the output offered in between is gone already
    del hidden, skip
    assert len(handover._produced) == 0


def test_up_blocks_of_a_linear_projection_unet_take_two_part_statistics_and_match_stock(triton_launches):
    """SD2.1's transformers project with Linear layers: their proj_out runs as a 1x1 conv (the Linear's weight read
    as one) once asked for sums. The tiny UNet's up blocks: (mid output, down1's resnet output), (up0's first resnet's
    output, the downsampler's) and (the upsampler's output, down0's attention output) come with both parts' sums
    from the second call on (test_stats_handover counts the same for SD1.5's 1x1 conv projections)."""
    torch.manual_seed(0)
    stock, patched = models.sd21_unet().eval(), models.sd21_unet().eval()
    patched.load_state_dict(stock.state_dict())
    ldmopt.patch(patched)
    kw = models.inputs("sd21", stock)
    # the fused convs read (hidden, skip) in place in the interpreter; everything else on the reference path
    with torch.no_grad(), triton_only_for("gn_silu_conv2d"):
        expected = output_tensor(stock(**kw))
        patched(**kw)
        triton_launches.clear()
        handover.handed_over.clear()
        got = output_tensor(patched(**kw))
    assert_outputs_close(got, expected, name="two-part statistics handed over")
    assert triton_launches.count("_group_norm_stats_from_sums_kernel") == 3
    assert handover.handed_over["ResnetBlock2D.norm1"] == 6, dict(handover.handed_over)


def test_video_statistics_add_the_frames_sums():
    producer, frames = _Producer(), 3
    x = torch.randn(2 * frames, 12, 4, 5) * 1.5 + 0.3
    handover.offer(x, producer)
    assert handover.take_video(x, frames, 4, 1e-6, "test") is None  # no sums yet: the producer learns to sum
    assert handover.wants_sums(producer, x)
    handover.offer(x, producer, sums=channel_sums_torch(x))
    with ldmopt.use_backend("torch"):
        mean, rstd = handover.take_video(x, frames, 4, 1e-6, "test")
    # GroupNorm over each video's (C/G, F, H, W): the (B, C, F, H*W) view of the frames
    video = x.double().reshape(2, frames, 4, 3, 20).transpose(1, 2).reshape(2, 4, -1)
    var, expected_mean = torch.var_mean(video, dim=-1, unbiased=False)
    assert mean.shape == (2, 4) and handover.handed_over["test"] == 1
    assert_close(mean, expected_mean, torch.float32, "mean")
    assert_close(rstd, torch.rsqrt(var + 1e-6), torch.float32, "rstd")


@pytest.mark.parametrize(
    ("family", "consumer"),
    [("animatediff", "AnimateDiffTransformer3D.norm"), ("svd", "TemporalResnetBlock.norm1")],
    ids=["motion modules", "svd temporal resnets"],
)
def test_video_models_take_their_video_statistics_from_frame_sums_and_match_stock(family, consumer):
    """AnimateDiff's motion modules normalise the attention's (or resnet's) output per video, SVD's temporal resnets
    the spatial resnet's: from the second call on, from the producers' per-frame channel sums."""
    torch.manual_seed(0)
    stock = getattr(models, family)().eval()
    patched = getattr(models, family)().eval()
    patched.load_state_dict(stock.state_dict())
    ldmopt.patch(patched)
    kw = models.inputs(family, stock)
    # the reference path (the kernels have their own tests): what is handed over is the same
    with torch.no_grad(), ldmopt.use_backend("torch"):
        expected = output_tensor(stock(**kw))
        patched(**kw)
        handover.handed_over.clear()
        got = output_tensor(patched(**kw))
    assert handover.handed_over[consumer] >= 2, dict(handover.handed_over)
    assert_outputs_close(got, expected, name=f"{family} with video statistics handed over")
