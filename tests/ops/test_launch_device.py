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
