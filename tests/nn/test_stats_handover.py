"""ldmopt.nn.stats_handover: a fused ResnetBlock2D hands its output's GroupNorm statistics (summed in conv2's
epilogue) to the fused GroupNorm that reads that output next, once the consumer has asked for its (groups, eps); the
consumer then skips its own statistics pass. A hand-over must never change a result."""

import pytest
import torch

import ldmopt
from ldmopt.nn import stats_handover as handover
from tests.patch import models
from tests.patch.helpers import assert_outputs_close, output_tensor, triton_only_for
from tests.tolerances import assert_within_torch_error

pytest.importorskip("diffusers")


pytestmark = pytest.mark.usefixtures("fresh_handover")


class _Producer(torch.nn.Module):
    pass


def _stats(n=2, g=4):
    return torch.randn(n, g), torch.rand(n, g) + 0.5


def test_take_returns_what_was_offered_for_the_same_tensor_and_config():
    producer, out, stats = _Producer(), torch.randn(2, 8, 3, 3), _stats()
    handover.offer(out, producer, (4, 1e-5), stats)
    got = handover.take(out, 4, 1e-5, "test")
    assert all(a is not None and torch.equal(a, b) for a, b in zip(got, stats)) and handover.handed_over["test"] == 1
    assert handover.take(out, 4, 1e-5, "test") is None  # an offer is taken once


def test_offered_statistics_hold_no_autograd_graph():
    # The consumer treats them as constants; a grad_fn held in the slot would keep the producer's graph alive.
    producer, out = _Producer(), torch.randn(2, 8, 3, 3)
    leaf = torch.randn(2, 4, requires_grad=True)
    handover.offer(out, producer, (4, 1e-5), (leaf * 2, leaf.exp()))
    mean, rstd = handover.take(out, 4, 1e-5, "test")
    assert mean.grad_fn is None and rstd.grad_fn is None and not mean.requires_grad
    torch.testing.assert_close(mean, leaf.detach() * 2)


@pytest.mark.parametrize("change", ["other tensor", "modified in place", "other groups", "other eps"])
def test_take_refuses_anything_but_the_unmodified_offered_tensor(change):
    producer, out, stats = _Producer(), torch.randn(2, 8, 3, 3), _stats()
    handover.offer(out, producer, (4, 1e-5), stats)
    x, groups, eps = out, 4, 1e-5
    if change == "other tensor":
        x = out.clone()
    elif change == "modified in place":
        out.add_(1.0)
    elif change == "other groups":
        groups = 2
    else:
        eps = 1e-6
    assert handover.take(x, groups, eps, "test") is None
    assert not handover.handed_over
    # A consumer that read the offered tensor with other statistics asked for them: the producer computes those next.
    expected = (groups, eps) if change.startswith("other g") or change.startswith("other e") else None
    assert handover.wanted(producer, out) == expected


def test_nothing_is_handed_over_under_inference_mode_or_tracing():
    producer = _Producer()
    with torch.inference_mode():
        out = torch.randn(2, 8, 3, 3)
        handover.offer(out, producer, (4, 1e-5), _stats())
        assert handover.take(out, 4, 1e-5, "test") is None  # inference tensors keep no version counter
    out = torch.randn(2, 8, 3, 3)
    handover.offer(out, producer, (4, 1e-5), _stats())
    seen = []

    def consumer(x):
        seen.append(handover.take(x, 4, 1e-5, "test"))
        return x * 2

    torch.jit.trace(consumer, (out,), check_trace=False)
    assert seen == [None]


def _patched_unet(dtype=torch.float32):
    torch.manual_seed(0)
    stock = models.sd15_unet().eval().to(dtype)
    patched = models.sd15_unet().eval().to(dtype)
    patched.load_state_dict(stock.state_dict())
    ldmopt.patch(patched)
    # One image: the producers' and consumers' kernels run in the interpreter, and what is handed over is per call
    return stock, patched, models.inputs("sd15", stock, batch=1)


def test_patched_unet_hands_statistics_over_from_its_second_call_and_matches_stock(triton_launches):
    stock, patched, kw = _patched_unet()
    # The producers' and consumers' kernels in the interpreter; the attention GEMMs on the reference path
    with torch.no_grad(), triton_only_for("gn_silu_conv2d", "group_norm"):
        expected = output_tensor(stock(**kw))
        first = output_tensor(patched(**kw))
        assert not handover.handed_over  # the first call learns what each consumer wants
        partials_first = triton_launches.count("_group_norm_fwd_partial_kernel")
        triton_launches.clear()
        second = output_tensor(patched(**kw))
    assert_outputs_close(first, expected, name="first call")
    assert_outputs_close(second, expected, name="with statistics handed over")
    # The tiny UNet: every Transformer2DModel norm (4) reads a resnet's output; down1's resnet reads the
    # downsampler's, the mid block's resnets a resnet's and an attention block's; the up blocks' resnets read (mid
    # output, down1's resnet output), (up0's first resnet's, the downsampler's) and (the upsampler's, down0's
    # attention output), whose producers summed them per channel. Left with their passes: whatever reads conv_in's
    # output, a stock convolution (down0's resnet, one part; up1's second resnet, two parts).
    assert handover.handed_over["Transformer2DModel.norm"] == 4, dict(handover.handed_over)
    assert handover.handed_over["ResnetBlock2D.norm1"] == 6, dict(handover.handed_over)
    assert triton_launches.count("_group_norm_fwd_partial_kernel") == 3 == partials_first - 13
    assert triton_launches.count("_group_norm_stats_from_sums_kernel") == 3


def test_patch_report_counts_the_statistics_passes_handed_over():
    torch.manual_seed(0)
    model = models.sd15_unet().eval()
    kw = models.inputs("sd15", model)
    report = ldmopt.patch(model)
    with torch.no_grad(), ldmopt.use_backend("torch"):
        model(**kw)
        assert report.handovers() == {}  # the first call learns what each consumer wants
        model(**kw)
    handed = report.handovers()
    # each of the 4 transformers: its GroupNorm from the resnet before it, its one block's norm1 from its proj_in
    assert handed["Transformer2DModel.norm"] == 4 and handed["norm1"] == 4, handed
    assert "statistics passes skipped since patch" in str(report) and "norm1 x4" in str(report), str(report)
    with torch.inference_mode(), ldmopt.use_backend("torch"):  # inference tensors keep no version counter
        model(**kw)
    assert report.handovers() == handed
    ldmopt.unpatch(model)


def test_training_step_with_statistics_handed_over_matches_stock_gradients():
    stock, patched, kw = _patched_unet()
    with triton_only_for("gn_silu_conv2d", "group_norm"):
        output_tensor(patched(**kw)).float().square().mean().backward()  # learn (grads discarded)
        patched.zero_grad()
        handover.handed_over.clear()
        output_tensor(stock(**kw)).float().square().mean().backward()
        output_tensor(patched(**kw)).float().square().mean().backward()
    assert sum(handover.handed_over.values()) >= 5, dict(handover.handed_over)
    for (name, p_stock), p_patched in zip(stock.named_parameters(), patched.parameters()):
        if p_stock.grad is None:
            assert p_patched.grad is None or not p_patched.grad.any(), name
            continue
        assert_outputs_close(p_patched.grad, p_stock.grad, name=f"grad {name}")


def test_gradient_checkpointing_keeps_the_hand_over():
    """Training with gradient checkpointing still hands statistics over from the second step on. Reentrant
    checkpoints recompute each resnet alone in backward, its offer untaken there: the producer keeps its request
    (PyTorch's default non-reentrant checkpoint stops its recompute before the offer)."""
    import functools

    _, patched, kw = _patched_unet()
    reentrant = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=True)
    patched.train().enable_gradient_checkpointing(reentrant)
    with ldmopt.use_backend("torch"):
        for _ in range(3):
            handover.handed_over.clear()
            output_tensor(patched(**kw)).float().square().mean().backward()
    assert sum(handover.handed_over.values()) >= 5, dict(handover.handed_over)


def test_unpatched_model_neither_offers_nor_takes():
    _, patched, kw = _patched_unet()
    with torch.no_grad(), ldmopt.use_backend("torch"):
        patched(**kw)
        ldmopt.unpatch(patched)
        patched(**kw)
        patched(**kw)
    assert not handover.handed_over


def test_a_producer_whose_statistics_go_untaken_stops_computing_them():
    producer, other, stats = _Producer(), _Producer(), _stats()

    def learn():
        out = torch.randn(2, 8, 3, 3)
        handover.offer(out, producer)  # the first call: no statistics yet
        assert handover.take(out, 4, 1e-5, "test") is None  # the consumer's miss records its request
        assert handover.wanted(producer, out) == (4, 1e-5)

    def untaken(by_miss=False):
        handover.offer(torch.randn(2, 8, 3, 3), producer, (4, 1e-5), stats)
        if by_miss:
            assert handover.take(torch.randn(2, 8, 3, 3), 4, 1e-5, "test") is None  # a fused norm reading another
        else:
            handover.offer(torch.randn(2, 8, 3, 3), other)  # the next producer offers: nobody took them

    def taken():
        out = torch.randn(2, 8, 3, 3)
        handover.offer(out, producer, (4, 1e-5), stats)
        assert handover.take(out, 4, 1e-5, "test") is not None

    for by_miss in (False, True):
        learn()
        untaken(by_miss)
        assert handover.wanted(producer, torch.randn(1)) == (4, 1e-5)  # once: a checkpointing recompute does this
        untaken(by_miss)
        assert handover.wanted(producer, torch.randn(1)) is None  # twice in a row: the consumer is gone
    learn()
    for _ in range(3):  # gradient checkpointing: taken in forward, recomputed alone in backward, and so on
        taken()
        untaken()
    assert handover.wanted(producer, torch.randn(1)) == (4, 1e-5)


def test_unpatch_forgets_what_its_producers_learned():
    """tune patches a model again and again: a kept resnet must not go on summing statistics for a transformer norm
    that is stock in this configuration."""
    _, patched, kw = _patched_unet()
    with torch.no_grad(), ldmopt.use_backend("torch"):  # the choice of what to hand on is the same on every backend
        patched(**kw)
        patched(**kw)
    learned = [m for m in patched.modules() if m in handover._wanted]
    assert len(learned) >= 5, len(learned)
    ldmopt.unpatch(patched)
    assert not any(m in handover._wanted for m in patched.modules())
    ldmopt.patch(patched, filter_fn=lambda module, name: "attentions" not in name)  # resnets fused, transformers stock
    handover.handed_over.clear()
    with torch.no_grad(), ldmopt.use_backend("torch"):
        patched(**kw)
        patched(**kw)
    # only the producers a resnet reads next are asked (the tiny UNet: a resnet and the downsampler); none sums for a
    # stock transformer
    producers = sorted(type(m).__name__ for m in patched.modules() if m in handover._wanted)
    assert producers == ["Downsample2D", "ResnetBlock2D"], producers
    assert handover.handed_over == {"ResnetBlock2D.norm1": 2}, handover.handed_over
    ldmopt.unpatch(patched)


def _transformer_of_three_blocks(linear_projection=True):
    """A Transformer2DModel with three BasicTransformerBlocks in a row (SDXL runs ten), odd sizes, drawn weights;
    proj_in a Linear (SD2.1, SDXL) or a 1x1 conv (SD1.5)."""
    from diffusers.models.transformers.transformer_2d import Transformer2DModel

    torch.manual_seed(0)
    model = Transformer2DModel(
        num_attention_heads=2, attention_head_dim=12, in_channels=24, num_layers=3, cross_attention_dim=20,
        norm_num_groups=4, use_linear_projection=linear_projection,
    ).eval()  # fmt: skip
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1 + 0.4 * torch.randn_like(p)) if name.endswith("norm1.weight") else 0.3 * torch.randn_like(p))
    hidden = torch.randn(2, 24, 5, 7).to(memory_format=torch.channels_last)
    kw = dict(hidden_states=hidden, encoder_hidden_states=torch.randn(2, 6, 20))
    return model, kw


@pytest.mark.parametrize(
    "linear_projection, dtype",
    [(True, torch.float32), (False, torch.float16)],
    ids=["linear proj_in fp32", "conv proj_in fp16"],
)
def test_proj_in_and_blocks_in_a_row_hand_layer_norm_statistics_to_the_next_norm1(
    triton_launches, linear_projection, dtype
):
    import copy

    stock, kw = _transformer_of_three_blocks(linear_projection)
    exact = copy.deepcopy(stock).double()
    with torch.no_grad():
        reference = exact(**{k: v.double() for k, v in kw.items()}).sample
    stock, kw = stock.to(dtype), {k: v.to(dtype) for k, v in kw.items()}
    patched = copy.deepcopy(stock)
    ldmopt.patch(patched)
    with torch.no_grad(), ldmopt.use_backend("triton"):
        expected = stock(**kw).sample
        first = patched(**kw).sample
        assert not handover.handed_over  # the first call learns that each next block's norm1 wants them
        passes_first = triton_launches.count("_row_stats_kernel")
        triton_launches.clear()
        second = patched(**kw).sample
    # block 1's from proj_in's epilogue (a 1x1 conv's pixel rows), blocks 2 and 3's from the feed-forward GEMMs'
    assert handover.handed_over["norm1"] == 3, dict(handover.handed_over)
    # fp32 operands: proj_in's come from one pass over its output (the conv's epilogue sums rows for 16-bit ones)
    assert passes_first == 3 and triton_launches.count("_row_stats_kernel") == (dtype == torch.float32)
    if dtype == torch.float32:
        assert_outputs_close(first, expected, name="first call")
        assert_outputs_close(second, expected, name="norm1 statistics handed over")
    else:
        assert_within_torch_error(first, reference, expected, "first call")
        assert_within_torch_error(second, reference, expected, "norm1 statistics handed over")


def test_a_hooked_norm1_asks_nothing_of_its_producer():
    """A norm1 that will run as a module (here hooked after patching) computes its own statistics: it takes none and
    asks for none, so proj_in sums nothing for it and the report counts no skipped pass."""
    model, kw = _transformer_of_three_blocks(linear_projection=False)
    report = ldmopt.patch(model)
    calls = []
    model.transformer_blocks[0].norm1.register_forward_hook(lambda m, args, out: calls.append(out.shape))
    with torch.no_grad(), ldmopt.use_backend("torch"):
        model(**kw)
        model(**kw)
    assert len(calls) == 2 and report.handovers() == {"norm1": 2}, report.handovers()  # blocks 2 and 3, 2nd call
    assert model not in handover._wanted  # the Transformer2DModel (proj_in's producer) was never asked
    ldmopt.unpatch(model)


def test_blocks_in_a_row_train_with_handed_over_statistics():
    import copy

    stock, kw = _transformer_of_three_blocks()
    patched = copy.deepcopy(stock)
    ldmopt.patch(patched, training=True)
    with ldmopt.use_backend("triton"):
        patched(**kw).sample.square().mean().backward()  # learn (grads discarded)
        patched.zero_grad()
        handover.handed_over.clear()
        stock(**kw).sample.square().mean().backward()
        patched(**kw).sample.square().mean().backward()
    assert handover.handed_over["norm1"] == 3, dict(handover.handed_over)  # from proj_in and two feed-forwards
    for (name, p_stock), p_patched in zip(stock.named_parameters(), patched.parameters()):
        assert_outputs_close(p_patched.grad, p_stock.grad, name=f"grad {name}")
