"""ldmopt.cuda_graphs: what a call's signature is, and what the wrappers remember, forget and leave behind.

The key's grad and inference modes and argument types, autocast's dtype at capture, the strides the forward sees,
autograd for inputs, root and pre-hooks, value variants after eviction, what a wrapper forgets first, guarded
buffers, stream ordering, and what reset / remove / a failed install leave behind. On the CPU, with
tests/support/replaying_graphs.py's backend standing in for torch.cuda's capture.
"""

from __future__ import annotations

import functools
import warnings
from types import SimpleNamespace

import pytest
import torch

import ldmopt
from ldmopt import graphs
from tests.support.cuda_graph_api import mock_cuda_graph_api
from tests.support.replaying_graphs import replaying_backend


@pytest.fixture
def backend(monkeypatch):
    return replaying_backend(monkeypatch)


class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(5))

    def forward(self, x, options=None, *, scale=1.0):
        return {"out": x * self.weight * scale, "options": options}


def _graphed(model=None, **options):
    model = (model or Toy()).eval()
    handle = ldmopt.cuda_graphs(model, **options)
    return model, handle, handle.wrappers[type(model).__name__]


@pytest.fixture
def no_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def test_grad_mode_is_part_of_the_key(backend):
    """With frozen weights a grad-enabled call replays too, but not the graph of a no_grad call: the forward may
    branch on the grad mode."""

    class GradAware(Toy):
        def forward(self, x):
            return x * self.weight * (2.0 if torch.is_grad_enabled() else 1.0)

    model, handle, wrapper = _graphed(GradAware().requires_grad_(False))
    x = torch.randn(2, 5)
    with torch.no_grad():
        torch.testing.assert_close(model(x), x * model.weight, rtol=0, atol=0)
    torch.testing.assert_close(model(x), 2 * x * model.weight, rtol=0, atol=0)
    assert wrapper.captures == 2 and not wrapper.eager_calls
    handle.remove()


def test_inference_mode_is_part_of_the_key(backend, no_warnings):
    """Static buffers made under inference_mode are inference tensors, which a no_grad call may not copy into: each
    mode gets its own graph."""
    model, handle, wrapper = _graphed()
    x = torch.randn(2, 5)
    for mode in (torch.inference_mode, torch.no_grad, torch.inference_mode, torch.no_grad):
        with mode():
            torch.testing.assert_close(model(x)["out"], x * model.weight, rtol=0, atol=0)
    assert wrapper.captures == 2 and wrapper.replays == 4
    handle.remove()


def test_equal_values_of_other_types_are_other_keys(backend):
    """1, 1.0 and True hash and compare equal; the key keeps their types apart (the forward may tell them apart)."""
    model, handle, wrapper = _graphed()
    x = torch.randn(2, 5)
    with torch.no_grad():
        for _ in range(2):
            for value in (1, True, 1.0):
                got = model(x, value)["options"]
                assert got is value or (type(got) is type(value) and got == value)
    assert wrapper.captures == 3 and wrapper.replays == 6
    handle.remove()


def test_capture_under_autocast_keeps_the_callers_dtype(backend):
    """The capture re-enters autocast with the caller's dtype (float16 here, not the CPU's default bfloat16)."""
    seen = []

    class Recording(Toy):
        def forward(self, x):
            seen.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None)
            return x * self.weight

    model, handle, wrapper = _graphed(Recording())
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        model(torch.randn(2, 5))
        model(torch.randn(2, 5))
    assert wrapper.captures == 1 and wrapper.replays == 2
    assert seen and set(seen) == {torch.float16}
    handle.remove()


def test_the_forward_sees_the_callers_strides(backend):
    """A dense input's static buffer keeps its strides (channels-last here): captured kernels see the layout the
    caller passes, as an eager call would."""
    strides = []

    class Recording(Toy):
        def forward(self, x):
            strides.append(x.stride())
            return x * self.weight

    model, handle, wrapper = _graphed(Recording())
    x = torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(model(x), x * model.weight, rtol=0, atol=0)
    assert wrapper.captures == 1 and strides and set(strides) == {x.stride()}
    handle.remove()


def test_an_input_that_needs_grad_runs_eagerly_with_autograd(backend):
    """Frozen weights, but an input that requires grad under grad mode: eager, and the gradient reaches the input."""
    model, handle, wrapper = _graphed(Toy().requires_grad_(False))
    x = torch.randn(2, 5, requires_grad=True)
    with pytest.warns(RuntimeWarning, match="autograd is recording"):
        out = model(x)["out"]
    out.sum().backward()
    torch.testing.assert_close(x.grad, model.weight.expand(2, 5), rtol=0, atol=0)
    assert backend.captures == 0 and sum(wrapper.eager_calls.values()) == 1
    handle.remove()


def test_hooks_on_the_model_itself_run_every_call_and_replay(backend, no_warnings):
    """The root's own torch hooks run outside its forward, on every call: they do not keep it eager."""
    model, handle, wrapper = _graphed()
    calls = []
    model.register_forward_pre_hook(lambda module, args: calls.append("pre"))
    model.register_forward_hook(lambda module, args, out: calls.append("post"))
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(2, 5))
    assert calls == ["pre", "post"] * 3
    assert wrapper.captures == 1 and wrapper.replays == 3 and not wrapper.eager_calls
    handle.remove()


def test_forward_pre_hooks_on_submodules_keep_it_eager(backend):
    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.Linear(5, 5)

        def forward(self, x):
            return self.inner(x)

    model, handle, _ = _graphed(Outer())
    model.inner.register_forward_pre_hook(lambda module, args: None)
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="forward hooks on inner: their Python would run once"):
        model(torch.randn(2, 5))
    assert backend.captures == 0
    handle.remove()


def test_a_value_captured_before_captures_again_after_eviction(backend, no_warnings):
    """The value-variant limit counts distinct values: one seen before and evicted (max_graphs) is not a new one."""
    model, handle, wrapper = _graphed(max_graphs=1)
    x = torch.randn(2, 5)
    with torch.no_grad():
        for scale in (1.0, 2.0, 3.0) * 2:
            torch.testing.assert_close(model(x, scale=scale)["out"], x * model.weight * scale, rtol=0, atol=0)
    assert wrapper.captures == 6 and not wrapper.eager_calls
    handle.remove()


@pytest.mark.parametrize("refresh", ["eager", "replay"])
def test_remembered_signatures_are_forgotten_least_recently_seen_first(backend, monkeypatch, refresh):
    """The value variants remembered per set of tensors: the one seen last survives a newcomer, the older one goes.
    Seen last by an eager call (one value too many) or by a replay of a captured value alike: the set's further
    value still runs eagerly instead of capturing one graph too many."""
    monkeypatch.setattr(graphs, "MAX_REMEMBERED_KEYS", 2)
    model, handle, wrapper = _graphed()
    a, b, c = (torch.randn(n, 5) for n in (1, 2, 3))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for scale in range(graphs.MAX_VALUE_VARIANTS):
            model(a, scale=float(scale))
        model(b)
        model(a, scale=10.0 if refresh == "eager" else 0.0)  # a's variants are now the most recently seen
        model(c)  # forgets b's, not a's
        model(a, scale=11.0)  # still one value too many
    eager = 2 if refresh == "eager" else 1
    assert wrapper.captures == graphs.MAX_VALUE_VARIANTS + 2 and sum(wrapper.eager_calls.values()) == eager
    handle.remove()


def test_a_failed_signature_seen_again_is_forgotten_last(backend, monkeypatch):
    """A signature whose capture failed is the most recently seen again when it is called again: one that fails
    every step is not forgotten (and its warm-ups and capture retried) before one seen once, earlier."""
    monkeypatch.setattr(graphs, "MAX_REMEMBERED_KEYS", 2)
    model, handle, _ = _graphed()
    backend.fail = RuntimeError("capture failed")
    attempts = []
    capture = backend.capture
    monkeypatch.setattr(backend, "capture", lambda *args: (attempts.append(1), capture(*args))[1])
    a, b, c = (torch.randn(n, 5) for n in (1, 2, 3))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for x in (a, b, a, c):
            model(x)
        assert len(attempts) == 3  # a, b and c once each; a's second call was eager at once
        model(a)  # still remembered: c forgot b, the least recently seen
        assert len(attempts) == 3
        model(b)  # forgotten: tried once more
        assert len(attempts) == 4
    handle.remove()


def test_moved_buffers_are_noticed(backend):
    class Shifted(Toy):
        def __init__(self):
            super().__init__()
            self.register_buffer("shift", torch.zeros(5))

        def forward(self, x):
            return x * self.weight + self.shift

    model, handle, wrapper = _graphed(Shifted())
    x = torch.randn(2, 5)
    with torch.no_grad():
        model(x)
        model.shift = torch.ones(5)  # a new buffer object, as .to() or load_state_dict(assign=True) gives
        torch.testing.assert_close(model(x), x * model.weight + 1, rtol=0, atol=0)
    assert wrapper.recaptures == 1 and wrapper.captures == 2
    handle.remove()


def test_a_replay_is_ordered_after_the_last_one_before_its_inputs_are_copied(backend, monkeypatch):
    model, handle, wrapper = _graphed()
    x, y = torch.randn(2, 5), torch.randn(2, 5)
    seen = []
    monkeypatch.setattr(backend, "order_after_last_replay", lambda device: seen.append(static.clone()))
    with torch.no_grad():
        model(x)
        (static,) = next(iter(wrapper.graphs.values())).static_inputs
        model(y)
    assert len(seen) == 1
    torch.testing.assert_close(seen[0], x, rtol=0, atol=0)  # still the previous call's: not yet overwritten
    handle.remove()


def test_the_cuda_backend_waits_for_a_replay_on_another_stream_only(monkeypatch):
    device = torch.device("cuda", 0)
    api = mock_cuda_graph_api(monkeypatch, device)
    backend = graphs.CudaBackend()
    replay, _ = backend.capture(lambda: None, 1, device, backend.new_pool(device))
    first, second = torch.cuda.Stream(device, "first"), torch.cuda.Stream(device, "second")
    current = [first]
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d: current[0])
    replay()
    api.steps.clear()
    backend.order_after_last_replay(device)  # the same stream: in order already
    assert api.steps == []
    current[0] = second
    backend.order_after_last_replay(device)
    assert api.steps == ["second waits for first"]


def test_reset_warns_a_reason_again(backend):
    """reset() forgets why calls ran eagerly: a reason met again after it is warned again."""
    model, handle, _ = _graphed()
    with torch.no_grad():
        with pytest.warns(RuntimeWarning, match="no tensor arguments"):
            model(3.0)
        handle.reset()
        with pytest.warns(RuntimeWarning, match="no tensor arguments"):
            model(3.0)
    handle.remove()


def test_remove_frees_the_graphs(backend):
    model, handle, wrapper = _graphed()
    with torch.no_grad():
        model(torch.randn(2, 5))
    assert len(wrapper.graphs) == 1
    handle.remove()
    assert not wrapper.graphs and wrapper._pool is None and "0 graphs held" in str(handle)


def test_remove_refuses_a_class_forward_that_calls_the_saved_graphs(backend):
    """accelerate hooks a module whose forward is its class's by saving the forward in ``_old_forward`` and
    replacing the class's: removing the graphs then would lose them."""
    model, handle, _ = _graphed()
    model._old_forward = model.__dict__.pop("forward")
    with pytest.raises(RuntimeError, match=r"replaced since the graphs were installed \(by the class's\)"):
        handle.remove()
    model.forward = model.__dict__.pop("_old_forward")
    handle.remove()
    assert "forward" not in model.__dict__


def test_remove_restores_the_other_models_before_raising(backend):
    unet, controlnet = Toy().eval(), Toy().eval()
    handle = ldmopt.cuda_graphs(SimpleNamespace(components={"unet": unet, "controlnet": controlnet}))
    installed = unet.__dict__["forward"]
    unet.forward = functools.wraps(installed)(lambda *a, **k: installed(*a, **k))
    with pytest.raises(RuntimeError, match=r"unet\.forward was replaced"):
        handle.remove()
    assert "forward" not in controlnet.__dict__ and graphs.GRAPHED not in controlnet.__dict__


def test_a_failed_install_leaves_no_model_graphed(backend):
    unet, controlnet = Toy().eval(), Toy().eval()
    ldmopt.cuda_graphs(controlnet)
    with pytest.raises(ValueError, match="controlnet is already graphed"):
        ldmopt.cuda_graphs(SimpleNamespace(components={"unet": unet, "controlnet": controlnet}))
    assert "forward" not in unet.__dict__ and graphs.GRAPHED not in unet.__dict__
    ldmopt.remove_cuda_graphs(controlnet)
