"""Threads and contexts: a server patching its shared model on the first requests, reading the report while others
run, serving a patched model from several threads, and use_backend in a generator that a thread pool resumes."""

from __future__ import annotations

import contextvars
import copy
import functools
import sys
import threading

import pytest
import torch

import ldmopt
from ldmopt.nn import child_check
from ldmopt.ops import _dispatch
from tests.patch import models
from tests.patch.helpers import assert_outputs_close, assert_same_snapshot, output_tensor, snapshot


@pytest.fixture
def eager_switches():
    """Let threads switch often, so that races show in a few trials."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


def _in_threads(n: int, fn) -> list:
    """``fn()`` in ``n`` threads released together; their results, or the exceptions they raised."""
    start, results = threading.Barrier(n), [None] * n

    def run(i):
        start.wait()
        try:
            results[i] = fn()
        except Exception as exc:  # returned for the test to assert on
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


@pytest.mark.parametrize("family", ["dit", "flux"])
def test_two_threads_patching_one_model_fuse_it_once(family, eager_switches):
    for _ in range(3):
        model = getattr(models, family)().eval()
        before = snapshot(model)
        reports = _in_threads(2, functools.partial(ldmopt.patch, model))
        assert all(isinstance(r, ldmopt.patch.PatchReport) for r in reports), reports
        totals = sorted(r.total for r in reports)
        assert totals[0] == 0 and totals[1] > 0, totals
        assert max(r.already_patched for r in reports) == totals[1]
        assert not [m for m in model.modules() if type(m).__qualname__.startswith("fused[fused[")]
        assert ldmopt.unpatch(model) == totals[1]
        assert_same_snapshot(before, snapshot(model))


def test_patched_model_serves_threads():
    model = models.dit().eval()
    batches = [models.inputs("dit", model) for _ in range(3)]
    with torch.no_grad():
        expected = [output_tensor(model(**b)) for b in batches]
    ldmopt.patch(model)

    def serve():
        with torch.no_grad(), ldmopt.use_backend("torch"):
            return [output_tensor(model(**b)) for b in batches]

    for outputs in _in_threads(3, serve):
        assert isinstance(outputs, list), outputs
        for got, want in zip(outputs, expected):
            assert_outputs_close(got, want, name="DiT from a thread")


def test_report_reads_while_other_threads_add_reasons(eager_switches):
    """Counters gain keys while a report is read (a new fall-back reason on another request): reading must not
    raise 'dictionary changed size during iteration'."""
    report = ldmopt.patch(models.dit().eval())
    stop = threading.Event()
    added = []

    def add_reasons():
        while not stop.is_set() and len(added) < 20_000:
            key = f"test_threads: reason {len(added)}"
            added.append(key)
            child_check.fallback_reasons[key] += 1  # past count_bounded's cap: as many new keys as possible

    writer = threading.Thread(target=add_reasons)
    writer.start()
    try:
        while writer.is_alive():
            report.fallbacks()
    finally:
        stop.set()
        writer.join()
        for key in added:
            child_check.fallback_reasons.pop(key, None)


def test_already_patched_counts_patches_not_touched_children():
    """Patching a block of a patched model again reports the patches at the block's modules, however it was fused."""
    alone = models.sd15_unet().eval()
    first = ldmopt.patch(alone.up_blocks[1])
    again_alone = ldmopt.patch(alone.up_blocks[1])
    whole = models.sd15_unet().eval()
    ldmopt.patch(whole)
    again_whole = ldmopt.patch(whole.up_blocks[1])
    fused_in_block = sum("_ldmopt_base" in type(m).__dict__ for m in whole.up_blocks[1].modules())
    assert again_alone.already_patched == first.total
    assert 0 < again_whole.already_patched <= first.total
    assert again_whole.already_patched >= fused_in_block  # each class-swapped module is one patch at least
    # A module swapped in as a child (its record sits with the parent): one patch.
    again_child = ldmopt.patch(whole.conv_norm_out)
    assert (again_child.total, again_child.already_patched) == (0, 1), str(again_child)


def test_use_backend_in_a_generator_resumed_in_copied_contexts():
    """Starlette/anyio run each step of a streaming generator in a fresh copy of the caller's context: leaving the
    ``with`` there must not raise (the token belongs to another context), and the caller's context is untouched."""

    def steps():
        with ldmopt.use_backend("torch"):
            yield _dispatch._forced.get()
            yield _dispatch._forced.get()

    gen = steps()
    first = contextvars.copy_context().run(next, gen)
    assert first is not None and first.name == "torch"
    contextvars.copy_context().run(next, gen)
    with pytest.raises(StopIteration):
        contextvars.copy_context().run(next, gen)
    assert _dispatch._forced.get() is None
    # Closed inside another context's own use_backend: that context keeps its choice.
    gen = steps()
    contextvars.copy_context().run(next, gen)
    with ldmopt.use_backend("triton"):
        gen.close()
        assert _dispatch._forced.get().name == "triton"
    assert _dispatch._forced.get() is None


def test_fused_classes_are_one_per_key_across_threads(eager_switches):
    """Two models patched from two threads share their fused classes (torch.compile guards and diffusers' block
    registry see one class per stock class)."""
    a = models.dit().eval()
    b = copy.deepcopy(a)
    queue = [a, b]
    reports = _in_threads(2, lambda: ldmopt.patch(queue.pop()))  # list.pop is atomic: one model per thread
    assert all(isinstance(r, ldmopt.patch.PatchReport) for r in reports), reports
    classes_a = {type(m).__qualname__: type(m) for m in a.modules() if "_ldmopt_base" in type(m).__dict__}
    classes_b = {type(m).__qualname__: type(m) for m in b.modules() if "_ldmopt_base" in type(m).__dict__}
    assert classes_a and classes_a == classes_b
