"""ldmopt.cuda_graphs: the wrapper's keys, static buffers, outputs, eager reasons and removal, on the CPU.

No GPU here: tests/support/replaying_graphs.py's backend stands in for torch.cuda's capture (a replay reruns the
forward on the static inputs and overwrites the static outputs, as a graph replay does). Whole models and pipelines:
tests/test_cuda_graphs_models.py. The real capture runs in benchmarks/check_cuda_graphs.py, a stage of run_gpu.sh.
"""

from __future__ import annotations

import functools
import inspect
import warnings

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
        """Toy forward."""
        return {"out": x * self.weight * scale, "count": 3}


def _graphed_toy(**options):
    toy = Toy().eval()
    handle = ldmopt.cuda_graphs(toy, **options)
    return toy, handle, handle.wrappers["Toy"]


def test_unhashable_and_off_device_arguments_run_eagerly(backend):
    toy, handle, _ = _graphed_toy()
    x = torch.randn(2, 5)
    with torch.no_grad():
        with pytest.warns(RuntimeWarning, match=r"argument 1 is a set, neither a tensor nor hashable"):
            out = toy(x, {1, 2})
        torch.testing.assert_close(out["out"], x * toy.weight)
        with pytest.warns(RuntimeWarning, match="no tensor arguments"):
            toy(3.0)
        with pytest.warns(RuntimeWarning, match="several devices"):
            toy(x, torch.ones(1, device="meta"))
    assert backend.captures == 0
    handle.remove()


def test_non_tensor_values_are_keys_and_outputs_keep_their_structure(backend):
    toy, handle, wrapper = _graphed_toy()
    x = torch.randn(3, 5)
    with torch.no_grad():
        for scale in (1.0, 2.0, 1.0, 2.0):
            out = toy(x, scale=scale)
            assert out["count"] == 3
            torch.testing.assert_close(out["out"], x * toy.weight * scale, rtol=0, atol=0)
    assert wrapper.captures == 2 and wrapper.replays == 4
    handle.remove()


def test_another_dtype_of_the_same_shape_is_another_graph(backend):
    # Keyed on the inputs' dtype as well as their shape: an fp64 call must not replay the fp32 graph (its static
    # input would round the values to fp32 and its output would stay fp32).
    toy, handle, wrapper = _graphed_toy()
    x = torch.randn(2, 5, dtype=torch.float64)
    with torch.no_grad():
        for dtype in (torch.float32, torch.float64, torch.float32, torch.float64):
            out = toy(x.to(dtype))["out"]
            expected = x.to(dtype) * toy.weight
            assert out.dtype == expected.dtype == dtype
            torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert wrapper.captures == 2 and wrapper.replays == 4
    handle.remove()


def test_capture_failure_keeps_that_signature_eager(backend):
    toy, handle, wrapper = _graphed_toy()
    backend.fail = RuntimeError("operation not permitted when stream is capturing\nmore")
    x = torch.randn(2, 5)
    with torch.no_grad():
        with pytest.warns(RuntimeWarning, match="capture failed: RuntimeError: operation not permitted"):
            out = toy(x)
        torch.testing.assert_close(out["out"], x * toy.weight)
        backend.fail = None
        toy(x)  # the refused key stays eager: no second capture
        assert backend.captures == 0
        toy(torch.randn(4, 5))  # another signature captures
    assert backend.captures == 1
    assert sum(wrapper.eager_calls.values()) == 2
    handle.remove()


def test_what_a_wrapper_remembers_is_bounded(backend, monkeypatch):
    # A server seeing ever-new shapes: the value variants and failed captures kept per signature stay bounded (the
    # graphs by max_graphs), and capture errors naming shapes are counted like every other reason.
    monkeypatch.setattr(graphs, "MAX_REMEMBERED_KEYS", 4)
    toy, handle, wrapper = _graphed_toy(max_graphs=2)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for rows in range(1, 11):
            toy(torch.randn(rows, 5))
        backend.fail = RuntimeError("capture failed for this shape")
        for rows in range(11, 21):
            x = torch.randn(rows, 5)
            torch.testing.assert_close(toy(x)["out"], x * toy.weight)
    assert len(wrapper.graphs) <= 2 and len(wrapper._variants) == 4 and len(wrapper.refused) == 4
    assert backend.captures == 10 and sum(wrapper.eager_calls.values()) == 10
    backend.fail = None
    with torch.no_grad():
        toy(torch.randn(11, 5))  # forgotten as refused: captured when it returns
        toy(torch.randn(20, 5))  # still remembered: eager
    assert backend.captures == 11 and sum(wrapper.eager_calls.values()) == 11
    handle.remove()


def test_moved_parameters_recapture_then_give_up(backend):
    toy, handle, wrapper = _graphed_toy()
    x = torch.randn(2, 5)
    with torch.no_grad():
        toy(x)
        for moves in range(1, graphs.MAX_RECAPTURES + 1):
            toy.weight.data = toy.weight.data + 1  # new storage, as .to() or an offloading hook would give
            torch.testing.assert_close(toy(x)["out"], x * toy.weight, rtol=0, atol=0)  # the new values
            assert wrapper.recaptures == moves and backend.captures == moves + 1
        toy.weight.data = toy.weight.data + 1
        with pytest.warns(RuntimeWarning, match="parameters moved on 3 calls"):
            torch.testing.assert_close(toy(x)["out"], x * toy.weight, rtol=0, atol=0)
        toy(x)
    assert wrapper.disabled and backend.captures == graphs.MAX_RECAPTURES + 1
    # In-place updates keep the addresses: the graph reads the new values (load_state_dict, an optimizer step).
    handle.remove()
    handle = ldmopt.cuda_graphs(toy)
    with torch.no_grad():
        toy(x)
        toy.weight.mul_(3)
        torch.testing.assert_close(toy(x)["out"], x * toy.weight, rtol=0, atol=0)
    assert handle.wrappers["Toy"].recaptures == 0
    handle.remove()


def test_clone_outputs_false_hands_out_the_static_buffers(backend):
    toy, handle, _ = _graphed_toy(clone_outputs=False)
    with torch.no_grad():
        first = toy(torch.ones(2, 5))["out"]
        second = toy(torch.full((2, 5), 2.0))["out"]
    assert first.data_ptr() == second.data_ptr()  # overwritten by the next replay, as documented
    torch.testing.assert_close(first, 2.0 * toy.weight.detach().expand(2, 5))
    handle.remove()


def test_remove_restores_the_forward_exactly_and_keeps_signature(backend):
    toy = Toy().eval()
    assert "forward" not in toy.__dict__
    handle = ldmopt.cuda_graphs(toy)
    assert inspect.signature(toy.forward) == inspect.signature(Toy.forward.__get__(toy))
    assert toy.forward.__doc__ == "Toy forward."
    with pytest.raises(ValueError, match="already graphed"):
        ldmopt.cuda_graphs(toy)
    handle.remove()
    assert "forward" not in toy.__dict__ and graphs.GRAPHED not in toy.__dict__
    handle.remove()  # twice: nothing left to do

    def custom(x, options=None, *, scale=1.0):  # an instance forward of the user's own (e.g. a hook's wrapper)
        return {"out": x, "count": 0}

    toy.forward = custom
    handle = ldmopt.cuda_graphs(toy)
    with torch.no_grad():
        assert toy(torch.ones(1, 5))["count"] == 0
    assert ldmopt.remove_cuda_graphs(toy) == 1
    assert toy.__dict__["forward"] is custom
    # replaced by a wrapper that still calls the graphs (functools.wraps, as a hook's): refused, it would be lost
    handle = ldmopt.cuda_graphs(toy)
    installed = toy.__dict__["forward"]
    toy.forward = functools.wraps(installed)(lambda *a, **k: installed(*a, **k))
    still_calls = r"was replaced since the graphs were installed \(by .*\), which still calls them"
    with pytest.raises(RuntimeError, match=still_calls):
        handle.remove()
    # replaced by something that no longer calls them (accelerate's hooks re-installed around the forward they saved
    # before): the graphs are freed with a warning, and the model is no longer graphed (patch / unpatch accept it)
    toy.forward = custom
    with pytest.warns(RuntimeWarning, match="no longer calls them"):
        handle.remove()
    assert graphs.GRAPHED not in toy.__dict__ and toy.__dict__["forward"] is custom


@pytest.mark.parametrize("bad", [{"max_graphs": 0}, {"warmup_calls": 0}, {"max_graphs": True}])
def test_bad_options_name_the_argument(bad):
    name, value = next(iter(bad.items()))
    with pytest.raises(ValueError, match=f"{name}={value!r} is not supported"):
        ldmopt.cuda_graphs(Toy().eval(), **bad)


def test_without_cuda_the_real_backend_runs_eagerly_with_the_reason():
    toy, handle, _ = _graphed_toy()
    x = torch.randn(2, 5)
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="tensors on cpu: CUDA graphs hold CUDA work only"):
        torch.testing.assert_close(toy(x)["out"], x * toy.weight)
    handle.remove()


def test_the_least_recently_used_graph_is_the_one_evicted(backend):
    toy, handle, wrapper = _graphed_toy(max_graphs=2)
    a, b, c = (torch.randn(n, 5) for n in (1, 2, 3))
    with torch.no_grad():
        for x in (a, b, a, c):  # c evicts b, the least recently used, and keeps a
            toy(x)
        assert wrapper.captures == 3 and wrapper.evicted == 1
        torch.testing.assert_close(toy(a)["out"], a * toy.weight, rtol=0, atol=0)
        assert wrapper.captures == 3
        toy(b)
    assert wrapper.captures == 4 and wrapper.evicted == 2
    handle.remove()


def test_another_method_is_graphed_as_asked(backend):
    toy = Toy().eval()
    toy.decode = None  # an attribute, not a method
    with pytest.raises(ValueError, match=r"method='decode' is not a method of Toy"):
        ldmopt.cuda_graphs(toy, method="decode")
    del toy.decode
    with pytest.raises(ValueError, match=r"method='decode' is not a method of Toy"):
        ldmopt.cuda_graphs(toy, method="decode")

    class Vae(Toy):
        def decode(self, z):
            return (z * self.weight).sum(-1)

    vae = Vae().eval()
    handle = ldmopt.cuda_graphs(vae, method="decode")
    z = torch.randn(3, 5)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(vae.decode(z), (z * vae.weight).sum(-1), rtol=0, atol=0)
        vae(z)  # forward stays as it was
    assert backend.captures == 1 and handle.replays == 2
    handle.remove()
    assert "decode" not in vae.__dict__


def test_lazy_names_and_no_cuda_at_import():
    import subprocess
    import sys

    code = (
        "import torch, ldmopt\n"
        "assert ldmopt.cuda_graphs is ldmopt.graphs.cuda_graphs\n"
        "assert ldmopt.remove_cuda_graphs is ldmopt.graphs.remove_cuda_graphs\n"
        "print(torch.cuda.is_initialized())\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_the_cuda_backend_captures_into_the_shared_pool(monkeypatch):
    """CudaBackend's calls into torch.cuda, mocked (no GPU here): warm-up calls on a side stream, the capture with the
    model's pool on its device, one replay, and what the captured call returned as the static output."""
    device = torch.device("cuda", 1)
    api = mock_cuda_graph_api(monkeypatch, device)
    steps = api.steps
    backend = graphs.CudaBackend()
    assert backend.supports(device) is None and "CUDA work only" in backend.supports(torch.device("cpu"))
    pool = backend.new_pool(device)
    calls = iter(range(10))
    replay, output = backend.capture(lambda: steps.append("run") or next(calls), 2, device, pool)
    assert output == 2  # the third call, the captured one
    assert steps == [
        "side waits for caller", "on side", "run", "run", "caller waits for side", "capture", "run", "replay"
    ]  # fmt: skip
    assert api.pools == ["pool-1"]
    replay()
    assert steps[-1] == "replay"


def test_capture_under_autocast_casts_from_the_weights(backend):
    """Autocast's cache of cast weights is freed when the caller's region ends: the capture runs without it."""
    seen = []

    class Recording(Toy):
        def forward(self, x):
            seen.append(torch.is_autocast_cache_enabled())
            return super().forward(x)

    toy = Recording().eval()
    handle = ldmopt.cuda_graphs(toy)
    x = torch.randn(2, 5)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.is_autocast_cache_enabled()
        assert toy(x)["out"].dtype == torch.float32  # a mul: autocast leaves it
        toy(x)
    autocast_calls = len(seen)
    with torch.no_grad():
        toy(x)  # autocast off: another key
    assert handle.wrappers["Recording"].captures == 2 and handle.replays == 3
    assert seen[:autocast_calls] == [False] * autocast_calls and all(seen[autocast_calls:])
    handle.remove()


def test_a_number_that_changes_every_call_stops_capturing(backend):
    toy, handle, wrapper = _graphed_toy()
    x = torch.randn(2, 5)
    with torch.no_grad():
        with pytest.warns(RuntimeWarning, match="a non-tensor argument took more than 3 values"):
            for step in range(6):
                torch.testing.assert_close(toy(x, scale=0.1 * step)["out"], x * toy.weight * 0.1 * step)
        toy(x, scale=0.0)  # a value captured before still replays
    assert wrapper.captures == graphs.MAX_VALUE_VARIANTS and sum(wrapper.eager_calls.values()) == 3
    assert wrapper.replays == graphs.MAX_VALUE_VARIANTS + 1
    handle.remove()


def test_replaced_parameters_are_noticed_and_reset_starts_over(backend):
    toy, handle, wrapper = _graphed_toy()
    x = torch.randn(2, 5)
    with torch.no_grad():
        toy(x)
        toy.weight = torch.nn.Parameter(torch.randn(5))  # a new object: load_state_dict(assign=True) does this
        torch.testing.assert_close(toy(x)["out"], x * toy.weight, rtol=0, atol=0)
    assert wrapper.recaptures == 1 and wrapper.captures == 2
    wrapper.disabled = "given up"
    handle.reset()
    with torch.no_grad():
        toy(x)
    assert wrapper.disabled is None and wrapper.recaptures == 0 and wrapper.captures == 3
    handle.remove()


def test_a_pool_no_graph_holds_is_not_captured_into_again(backend):
    toy, handle, _ = _graphed_toy(max_graphs=1)
    with torch.no_grad():
        for n in (1, 2, 3):
            toy(torch.randn(n, 5))
    assert backend.pools == 3 and handle.wrappers["Toy"].evicted == 2
    handle.remove()


def test_calls_from_threads_take_turns_at_the_static_buffers(backend):
    import threading

    toy, handle, wrapper = _graphed_toy()
    replay = backend.capture

    def capture(run, warmup, device, pool):
        inner, output = replay(run, warmup, device, pool)

        def checked():
            assert wrapper._lock._is_owned(), "a replay outside the wrapper's lock"
            inner()

        return checked, output

    backend.capture = capture
    inputs = [torch.randn(2, 5) for _ in range(8)]
    results = [None] * 8

    def call(i):
        with torch.no_grad():
            results[i] = toy(inputs[i])["out"]

    threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for x, out in zip(inputs, results, strict=True):
        torch.testing.assert_close(out, x * toy.weight, rtol=0, atol=0)
    assert wrapper.captures == 1 and wrapper.replays == 8
    handle.remove()


def test_a_graphed_model_refuses_copies_with_a_clear_error(backend):
    import copy
    import pickle

    toy, handle, _ = _graphed_toy()
    for copier in (copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError, match=r"Toy\.forward is replayed from CUDA graphs, which cannot be copied"):
            copier(toy)
    assert set(toy.state_dict()) == {"weight"}
    handle.remove()
    copy.deepcopy(toy)


def test_torch_compile_of_a_graphed_model_traces_the_forward_itself(backend):
    toy, handle, _ = _graphed_toy()
    compiled = torch.compile(toy, backend="eager", fullgraph=True)
    x = torch.randn(2, 5)
    with torch.no_grad():
        out = compiled(x)
    torch.testing.assert_close(out["out"], x * toy.weight, rtol=0, atol=0)
    assert backend.captures == 0 and not handle.wrappers["Toy"].eager_calls
    handle.remove()


def test_signatures_evicted_and_back_are_not_counted_as_new_values(backend):
    toy, handle, _ = _graphed_toy(max_graphs=1)
    a, b = torch.randn(1, 5), torch.randn(2, 5)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # no eager call
        for _ in range(4):
            toy(a)
            toy(b)
    assert handle.wrappers["Toy"].captures == 8 and not handle.wrappers["Toy"].eager_calls
    handle.remove()


def test_offloading_hooks_on_the_model_itself_keep_it_eager(backend):
    toy, handle, _ = _graphed_toy()
    toy._hf_hook = object()  # accelerate's cpu offload wraps the model's own forward
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="accelerate hooks on the model"):
        toy(torch.randn(2, 5))
    assert backend.captures == 0
    handle.remove()


def test_wrapper_subclass_weights_are_guarded_through_their_parts():
    class Packed(torch.Tensor):  # stands for a quantized weight: its data lives in the tensors it flattens to
        def __tensor_flatten__(self):
            return ["qdata", "scale"], None

    inner = torch.randn(3)
    packed = torch.randn(3).as_subclass(Packed)
    packed.qdata, packed.scale = inner, torch.ones(1)
    assert graphs._data_addresses(packed) == (inner.data_ptr(), packed.scale.data_ptr())
    assert graphs._data_addresses(inner) == inner.data_ptr()
