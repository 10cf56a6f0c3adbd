"""kernels/_tuned_launch.py: an autotuned kernel launched with the autotuner's own choice, without Autotuner.run on
calls whose key it has tuned; anything else goes through the autotuner."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from ldmopt.kernels import geglu, gn_conv2d, linear
from ldmopt.kernels._tuned_launch import TunedLaunch, tuned_launch
from triton.runtime.autotuner import Autotuner

import ldmopt


@triton.jit
def _scaled_add_kernel(out_ptr, x_ptr, y_ptr, n, alpha, KEY_N, DOUBLE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    out = x + alpha * y
    if DOUBLE:
        out = out * 2
    tl.store(out_ptr + offs, out, mask=mask)


def _autotuned(pre_hook=None):
    configs = [
        triton.Config({"BLOCK": 16}, num_warps=4, num_stages=3, pre_hook=pre_hook),
        triton.Config({"BLOCK": 32}, num_warps=2, num_stages=1, pre_hook=pre_hook),  # the benchmark's winner
    ]
    return triton.autotune(configs=configs, key=["KEY_N", "DOUBLE"])(_scaled_add_kernel)


def _record_launches(monkeypatch, tuner) -> list[dict]:
    """The keyword arguments (constexprs and launch options) of each launch of the tuner's kernel."""
    launches = []
    stock_run = tuner.fn.run

    def run(*args, **kwargs):
        launches.append(kwargs)
        return stock_run(*args, **kwargs)

    monkeypatch.setattr(tuner.fn, "run", run)
    return launches


class _Counting:
    """Counts Autotuner.run calls of one autotuner and makes its benchmark deterministic: the second config wins."""

    def __init__(self, monkeypatch, tuner):
        self.runs = 0
        stock_run = Autotuner.run

        def run(self_, *args, **kwargs):
            if self_ is tuner:
                self.runs += 1
            return stock_run(self_, *args, **kwargs)

        monkeypatch.setattr(Autotuner, "run", run)
        timings = {16: [2.0, 2.0, 2.0], 32: [1.0, 1.0, 1.0]}
        monkeypatch.setattr(tuner, "_bench", lambda *args, config, **kwargs: timings[config.kwargs["BLOCK"]])


def _call(launch, n, double, dtype=torch.float32):
    x, y = torch.randn(n, dtype=dtype), torch.randn(n, dtype=dtype)
    out = torch.full_like(x, float("nan"))
    launch[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](out, x, y, n, 0.75, n // 64, DOUBLE=double)
    expected = (x.double() + 0.75 * y.double()) * (2 if double else 1)
    torch.testing.assert_close(out.double(), expected, rtol=1e-3, atol=1e-3)


def test_a_tuned_key_skips_the_autotuner_and_launches_its_choice(monkeypatch):
    tuner = _autotuned()
    counting = _Counting(monkeypatch, tuner)
    launch = TunedLaunch(tuner)
    _call(launch, 200, False)
    assert counting.runs == 1 and tuner.best_config.kwargs["BLOCK"] == 32  # tuned through the autotuner
    x = torch.randn(200)
    key = launch.key((x, x, x, 200, 0.75, 3), {"DOUBLE": False})
    assert key in tuner.cache and launch.chosen((x, x, x, 200, 0.75, 3), {"DOUBLE": False}) is tuner.best_config
    launches = _record_launches(monkeypatch, tuner)
    _call(launch, 211, False)  # same key (KEY_N 3): the autotuner's choice, launched directly
    assert counting.runs == 1
    # the winning config with all its launch options, as Autotuner.run would launch it
    assert len(launches) == 1 and {k: launches[0][k] for k in ("BLOCK", "num_warps", "num_stages")} == {
        "BLOCK": 32,
        "num_warps": 2,
        "num_stages": 1,
    }
    assert tuner.best_config is tuner.cache[key]
    _call(launch, 200, True)  # another key: tuned first
    _call(launch, 200, False, dtype=torch.float16)  # another dtype: another key
    assert counting.runs == 3
    _call(launch, 205, True)
    assert counting.runs == 3


@pytest.fixture
def fresh(monkeypatch):
    """(autotuner, its Autotuner.run counter, its TunedLaunch), untuned."""
    tuner = _autotuned()
    return tuner, _Counting(monkeypatch, tuner), TunedLaunch(tuner)


def test_the_autotuners_cache_decides(fresh):
    # A cleared cache (or configs replaced, as tests do) must tune again, never launch a stale choice.
    tuner, counting, launch = fresh
    _call(launch, 100, False)
    tuner.cache.clear()
    _call(launch, 100, False)
    assert counting.runs == 2


def test_a_triton_keyed_otherwise_keeps_the_fast_path_off(monkeypatch, fresh):
    _, counting, launch = fresh
    monkeypatch.setattr(TunedLaunch, "key", lambda self, args, kwargs: ("not", "the", "autotuner's"))
    for _ in range(3):
        _call(launch, 100, False)
    assert launch._keys_match is False and counting.runs == 3


def test_configs_with_a_pre_hook_always_go_through_the_autotuner(monkeypatch):
    hooked = []
    tuner = _autotuned(pre_hook=lambda nargs: hooked.append(1))
    counting = _Counting(monkeypatch, tuner)
    launch = TunedLaunch(tuner)
    for _ in range(3):
        _call(launch, 100, False)
    assert counting.runs == 3 and hooked


def test_tuned_launch_is_made_once_per_autotuner_and_passes_other_kernels_through():
    for tuner in (linear._linear_fwd_tuned, geglu._geglu_fwd_tuned, gn_conv2d._gn_conv2d_fwd_kernel):
        assert isinstance(tuned_launch(tuner), TunedLaunch) and tuned_launch(tuner) is tuned_launch(tuner)
    assert tuned_launch(_scaled_add_kernel) is _scaled_add_kernel


@pytest.mark.parametrize("kernel", ["linear", "geglu", "gn_conv2d"])
def test_the_key_is_the_autotuners_at_a_real_launch(monkeypatch, kernel):
    # The key formed from positions equals the one Autotuner.run forms from its dicts, at the launchers' real calls.
    from ldmopt.ops import gn_silu_conv2d
    from ldmopt.ops import linear as fused_linear

    tuner = {
        "linear": linear._linear_fwd_tuned,
        "geglu": geglu._geglu_fwd_tuned,
        "gn_conv2d": gn_conv2d._gn_conv2d_fwd_kernel,
    }[kernel]
    seen = []
    stock_run = Autotuner.run

    def run(self_, *args, **kwargs):
        if self_ is tuner:
            launch_kwargs = {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")}
            all_args = {**dict(zip(self_.arg_names, args)), **launch_kwargs}
            named = {k: v for k, v in all_args.items() if k in self_.arg_names}
            expected = [named[k] for k in self_.keys if k in named]
            expected += [str(v.dtype) for v in named.values() if hasattr(v, "dtype")]
            mine = TunedLaunch(self_).key(args, launch_kwargs)
            out = stock_run(self_, *args, **kwargs)
            # the key the autotuner itself stored (the cache was emptied): Triton's own, not a copy of its formula
            seen.append((mine, tuple(expected), set(self_.cache)))
            return out
        return stock_run(self_, *args, **kwargs)

    monkeypatch.setattr(Autotuner, "run", run)
    # Two configs (the interpreter's one, twice) and an empty cache: the call reaches Autotuner.run's key.
    monkeypatch.setattr(tuner, "configs", [tuner.configs[0]] * 2)
    monkeypatch.setattr(tuner, "cache", {})
    monkeypatch.setattr(tuner, "_bench", lambda *args, config, **kwargs: [1.0, 1.0, 1.0])

    with ldmopt.use_backend("triton"):
        if kernel == "geglu":
            ldmopt.ops.geglu(torch.randn(2, 5, 24), torch.randn(32, 24), torch.randn(32))
        elif kernel == "linear":
            x = torch.randn(2, 5, 24)
            fused_linear(
                x, torch.randn(16, 24), torch.randn(16), gate=torch.randn(2, 16), residual=torch.randn(2, 5, 16)
            )
        else:
            x = torch.randn(2, 8, 5, 7).contiguous(memory_format=torch.channels_last)
            gn_silu_conv2d(x, torch.randn(8), torch.randn(8), 4, 1e-5, torch.randn(6, 8, 3, 3), torch.randn(6), 1, 1)
    assert seen and all(mine == expected and cached == {mine} for mine, expected, cached in seen), seen
