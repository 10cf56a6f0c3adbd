"""Triton kernels launch on the GPU that holds their inputs, whatever device is current."""

import torch


class _OnSecondGpu(torch.Tensor):
    """A CPU tensor that says it lives on cuda:1 (no GPU here): what ``launch`` reads to pick the device."""

    is_cuda = True

    def get_device(self):
        return 1

    @property
    def device(self):
        return torch.device("cuda", 1)


def test_triton_launches_make_the_inputs_gpu_current(monkeypatch):
    # Triton launches on the current device's stream: a model on cuda:1 while cuda:0 is current must switch first.
    from ldmopt.ops._dispatch import Backend, launch

    entered = []

    class _DeviceContext:
        def __init__(self, device):
            self.device = device

        def __enter__(self):
            entered.append(self.device)

        def __exit__(self, *exc):
            entered.append("exit")

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", _DeviceContext)
    x = torch.randn(3).as_subclass(_OnSecondGpu)
    seen = []

    def run(*args):
        seen.append(list(entered))
        return "ran"

    assert launch(Backend("triton", run), (None, x)) == "ran"
    assert seen == [[torch.device("cuda", 1)]] and entered[-1] == "exit"
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)  # already current: no switch
    entered.clear()
    assert launch(Backend("triton", run), (x,)) == "ran" and not entered
    assert launch(Backend("torch", run), (x,)) == "ran" and not entered  # reference ops follow their tensors


class _OnMps(torch.Tensor):
    """A CPU tensor that says it lives on an MPS device (none here)."""

    is_cpu = False
    is_cuda = False

    @property
    def device(self):
        return torch.device("mps")


def test_backends_run_with_autocast_off_on_every_device_type():
    """A backend's own F.conv2d / matmul must not cast again under autocast, on any device type: MPS autocast is one
    that torch._C._is_any_autocast_enabled does not cover, and the CPU's is."""
    from ldmopt.ops._dispatch import Backend, launch

    seen = []
    backend = Backend(
        "torch", lambda t: seen.append((torch.is_autocast_enabled("mps"), torch.is_autocast_enabled("cpu")))
    )
    for device_type, x in (("mps", torch.zeros(2).as_subclass(_OnMps)), ("cpu", torch.zeros(2))):
        torch.set_autocast_enabled(device_type, True)
        try:
            launch(backend, [x])
        finally:
            torch.set_autocast_enabled(device_type, False)
    assert seen == [(False, False), (False, False)], seen
