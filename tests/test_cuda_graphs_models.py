"""ldmopt.cuda_graphs on whole diffusers models and pipelines (patched and stock), on the CPU: tiny SD UNet, DiT,
ControlNet beside a UNet, the demo's StableDiffusionPipeline, and the GPU check script's own logic.

tests/support/replaying_graphs.py's backend stands in for torch.cuda's capture (a replay reruns the forward on the
static inputs and overwrites the static outputs, as a graph replay does); the wrapper's own logic is tested with a
toy model in tests/test_cuda_graphs.py. The real capture runs in benchmarks/check_cuda_graphs.py, a stage of
run_gpu.sh.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import ldmopt
from ldmopt import graphs
from ldmopt.configs import build_model
from ldmopt.demo import build_tiny_sd_pipeline, run_sd
from ldmopt.patch import PatchError
from tests.support.replaying_graphs import replaying_backend


@pytest.fixture
def backend(monkeypatch):
    return replaying_backend(monkeypatch)


def _unet():
    torch.manual_seed(0)
    model = build_model("sd15", "cpu", torch.float32, tiny=True).eval()
    return model.to(memory_format=torch.channels_last)


def _unet_inputs(model, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    size = 16
    sample = torch.randn(batch, model.config.in_channels, size, size, generator=g)
    sample = sample.contiguous(memory_format=torch.channels_last)
    context = torch.randn(batch, 7, model.config.cross_attention_dim, generator=g)
    timestep = torch.randint(1, 999, (), generator=g)
    return {"sample": sample, "timestep": timestep, "encoder_hidden_states": context}


def _stock_outputs(model, calls):
    with torch.no_grad():
        return [model(**kw).sample for kw in calls]


def test_replays_match_eager_and_outputs_stay_the_callers(backend):
    model = _unet()
    calls = [_unet_inputs(model, seed=s) for s in range(4)]
    expected = _stock_outputs(model, calls)
    handle = ldmopt.cuda_graphs(model, warmup_calls=2)
    with torch.no_grad():
        got = [model(**kw).sample for kw in calls]
    assert backend.captures == 1 and backend.warmups == 2 and backend.replays == 4
    wrapper = handle.wrappers["UNet2DConditionModel"]
    assert wrapper.replays == 4 and not wrapper.eager_calls
    # Every call's own inputs (new latents, timestep, context each time), and the earlier outputs were not
    # overwritten by later replays (cloned out of the static buffers).
    for out, ref in zip(got, expected, strict=True):
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert len({out.data_ptr() for out in got}) == 4
    handle.remove()


def test_signatures_get_their_own_graphs_and_the_oldest_is_evicted(backend):
    model = _unet()
    wide, narrow = _unet_inputs(model, batch=2), _unet_inputs(model, batch=1, seed=3)
    contiguous = dict(wide, sample=wide["sample"].contiguous())  # same shape, other strides: another graph
    expected = _stock_outputs(model, [wide, narrow, contiguous])
    handle = ldmopt.cuda_graphs(model, max_graphs=2)
    wrapper = handle.wrappers["UNet2DConditionModel"]
    with torch.no_grad():
        for _ in range(2):
            outs = [model(**kw).sample for kw in (wide, narrow, contiguous)]
            for out, ref in zip(outs, expected, strict=True):
                torch.testing.assert_close(out, ref, rtol=0, atol=0)
        tuple_out = model(**narrow, return_dict=False)  # a non-tensor argument is part of the key
    assert isinstance(tuple_out, tuple)
    torch.testing.assert_close(tuple_out[0], expected[1], rtol=0, atol=0)
    assert len(wrapper.graphs) == 2 and wrapper.evicted == wrapper.captures - 2 and wrapper.captures == 7
    handle.remove()


def test_eager_reasons_are_counted_and_warned_once(backend):
    model = _unet()
    kw = _unet_inputs(model)
    (expected,) = _stock_outputs(model, [kw])
    handle = ldmopt.cuda_graphs(model)
    wrapper = handle.wrappers["UNet2DConditionModel"]
    with pytest.warns(RuntimeWarning, match="autograd is recording"):
        out = model(**kw).sample  # grad mode with parameters that require grad
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert out.requires_grad  # ran eagerly, with autograd
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(**kw)  # the same reason is not warned again
    model.train()
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="train mode"):
        model(**kw)
    assert wrapper.eager_calls["train mode (dropout and other training behaviour would be frozen in the graph)"] == 1
    assert sum(n for why, n in wrapper.eager_calls.items() if "autograd" in why) == 2
    assert backend.captures == 0
    assert "eager x2: autograd is recording" in str(handle)
    handle.remove()


def test_patch_and_unpatch_refuse_a_graphed_model(backend):
    model = _unet()
    report = ldmopt.patch(model)
    handle = ldmopt.cuda_graphs(model)
    with pytest.raises(PatchError, match=r"wrapped by ldmopt\.cuda_graphs"):
        ldmopt.unpatch(model)
    with pytest.raises(PatchError, match=r"wrapped by ldmopt\.cuda_graphs"):
        ldmopt.patch(model)
    handle.remove()
    assert ldmopt.unpatch(model) == report.total


def test_a_patched_pipeline_graphs_its_unet_end_to_end(backend):
    pipe = build_tiny_sd_pipeline("cpu", torch.float32, seed=0)
    ldmopt.patch(pipe)
    with ldmopt.use_backend("torch"):
        eager, _ = run_sd(pipe, steps=3, seed=1)
        handle = ldmopt.cuda_graphs(pipe)
        assert set(handle.wrappers) == {"unet"}
        assert set(handle.skipped) == {"vae", "text_encoder"}
        graphed, _ = run_sd(pipe, steps=3, seed=1)
    # One signature (batch 2 with classifier-free guidance): captured once, replayed on each of the 3 steps.
    wrapper = handle.wrappers["unet"]
    assert wrapper.captures == 1 and wrapper.replays == 3 and not wrapper.eager_calls, str(handle)
    torch.testing.assert_close(graphed, eager, rtol=0, atol=0)
    assert "unet: 1 graphs held" in str(handle) and "vae: not graphed" in str(handle)
    with pytest.raises(ValueError, match=r"none of components=.*'nope'"):
        ldmopt.cuda_graphs(pipe, components="nope")
    assert ldmopt.remove_cuda_graphs(pipe) == 1
    assert "forward" not in pipe.unet.__dict__
    ldmopt.unpatch(pipe)


def test_the_gpu_check_script_runs_on_the_cpu(backend, monkeypatch, capsys):
    from benchmarks import check_cuda_graphs

    monkeypatch.setattr(check_cuda_graphs, "DEVICE", "cpu")
    monkeypatch.setattr(check_cuda_graphs, "TINY", True)
    monkeypatch.setattr(check_cuda_graphs, "DTYPE", torch.float32)  # fp16 on the CPU adds only time here
    with ldmopt.use_backend("torch"):
        assert check_cuda_graphs.main([]) == 0
    out = capsys.readouterr().out
    assert out.count(" PASS") == len(check_cuda_graphs.CASES), out
    assert "check_cuda_graphs: all passed" in out
    # A replay that missed its inputs is caught: every call's output would be the first call's.
    monkeypatch.setattr(graphs.GraphedMethod, "_key", _stale_key(graphs.GraphedMethod._key))
    with ldmopt.use_backend("torch"):
        assert check_cuda_graphs.main(["--only", "dit-256-patched"]) == 1
    assert " FAIL" in capsys.readouterr().out


def _stale_key(key):
    def stale(self, args, kwargs):
        out = key(self, args, kwargs)
        if self.graphs:  # hand the replay the captured call's tensors instead of this call's
            leaves = [s for g in self.graphs.values() for s in g.static_inputs]
            it = iter(leaves)
            return (*out[:2], [next(it) if isinstance(x, torch.Tensor) else x for x in out[2]], *out[3:])
        return out

    return stale


def test_expanded_timesteps_replay(backend):
    """DiT-class pipelines pass ``t.expand(batch)``: a stride-0 view, which a buffer with its strides could not take."""
    torch.manual_seed(0)
    model = build_model("dit", "cpu", torch.float32, tiny=True).eval()
    inputs = ldmopt.configs.example_inputs(model, batch=2).kwargs
    calls = []
    for step in range(3):
        kw = dict(inputs, hidden_states=torch.randn_like(inputs["hidden_states"]))
        kw["timestep"] = torch.tensor(900 - 100 * step).expand(2)
        calls.append(kw)
    with torch.no_grad():
        expected = [model(**kw)[0] for kw in calls]
        handle = ldmopt.cuda_graphs(model)
        got = [model(**kw)[0] for kw in calls]
    assert backend.captures == 1 and handle.replays == 3, str(handle)
    for out, ref in zip(got, expected, strict=True):
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
    handle.remove()


def test_hooks_inside_the_model_keep_it_eager(backend):
    from diffusers.hooks import HookRegistry, ModelHook

    model = _unet()
    kw = _unet_inputs(model)
    handle = ldmopt.cuda_graphs(model)
    hook = model.down_blocks[0].register_forward_hook(lambda module, args, out: None)
    with torch.no_grad(), pytest.warns(RuntimeWarning, match=r"forward hooks on down_blocks\.0: their Python would"):
        model(**kw)
    hook.remove()
    HookRegistry.check_if_exists_or_initialize(model.mid_block).register_hook(ModelHook(), "a_cache")
    with torch.no_grad(), pytest.warns(RuntimeWarning, match=r"diffusers hooks on mid_block \(a_cache\)"):
        model(**kw)
    assert backend.captures == 0
    handle.remove()


def test_a_controlnet_pipeline_graphs_the_controlnet_and_the_unet(backend):
    """The default components include the ControlNet, called every step beside the UNet: its residuals (a tuple of
    tensors out, then the UNet's list of tensors in) and its conditioning scale (a number that takes two values with
    control_guidance_start/end) replay like any other arguments."""
    from diffusers import ControlNetModel

    unet = _unet()
    torch.manual_seed(1)
    controlnet = ControlNetModel.from_unet(unet).eval()
    for block in controlnet.controlnet_down_blocks:  # zero-initialised: random, so the residuals matter
        torch.nn.init.normal_(block.weight, std=0.1)
    torch.nn.init.normal_(controlnet.controlnet_mid_block.weight, std=0.1)

    from types import SimpleNamespace

    pipe = SimpleNamespace(components={"unet": unet, "controlnet": controlnet})

    def step(kw, scale):
        down, mid = controlnet(**kw, controlnet_cond=kw["sample"].new_ones(2, 3, 128, 128), conditioning_scale=scale,
                               return_dict=False)  # fmt: skip
        return unet(**kw, down_block_additional_residuals=list(down), mid_block_additional_residual=mid).sample

    calls = [(_unet_inputs(unet, seed=s), scale) for s, scale in enumerate((1.0, 1.0, 0.0, 1.0))]
    with torch.no_grad():
        expected = [step(kw, scale) for kw, scale in calls]
        handle = ldmopt.cuda_graphs(pipe)
        got = [step(kw, scale) for kw, scale in calls]
    assert set(handle.wrappers) == {"unet", "controlnet"}
    assert handle.wrappers["controlnet"].captures == 2 and handle.wrappers["unet"].captures == 1, str(handle)
    assert not handle.eager_calls and handle.replays == 8
    for out, ref in zip(got, expected, strict=True):
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
    handle.remove()
