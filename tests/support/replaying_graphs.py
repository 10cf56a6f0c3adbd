"""A stand-in for torch.cuda's graph capture, so that ``ldmopt.cuda_graphs`` runs on the CPU in tests.

Its "capture" runs the forward (the warm-up calls, then one whose output it keeps as the graph's static output) and
its "replay" runs the forward again on the static inputs and writes the result into those static output tensors,
which is what a CUDA graph replay does. A wrapper that forgot to copy a call's tensors into the static buffers, or
handed out buffers the next replay overwrites, computes wrong results with it as it would on a GPU.
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from ldmopt import graphs


class ReplayingBackend:
    def __init__(self):
        self.captures = 0
        self.replays = 0
        self.warmups = 0
        self.pools = 0
        self.fail: Exception | None = None

    def supports(self, device):
        return None if device.type == "cpu" else f"the test backend runs on the CPU, not {device}"

    def new_pool(self, device):
        self.pools += 1
        return object()

    def order_after_last_replay(self, device):
        pass

    def capture(self, run, warmup, device, pool):
        if self.fail is not None:
            raise self.fail
        for _ in range(warmup):
            run()
            self.warmups += 1
        output = run()
        self.captures += 1

        def replay():
            self.replays += 1
            fresh = run()
            for static, new in zip(pytree.tree_leaves(output), pytree.tree_leaves(fresh), strict=True):
                if isinstance(static, torch.Tensor):
                    static.copy_(new)

        replay()  # as capture_graph replays once
        return replay, output


def replaying_backend(monkeypatch) -> ReplayingBackend:
    """Installs a :class:`ReplayingBackend` in ldmopt.graphs for the test; returns it."""
    fake = ReplayingBackend()
    monkeypatch.setattr(graphs, "_BACKEND", fake)
    return fake
