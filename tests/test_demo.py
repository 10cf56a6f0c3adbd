"""`ldmopt demo` runs on CPU, exits 0, prints what was patched, and saves both images."""

from PIL import Image

from ldmopt.cli import main


def test_demo_sd_exits_zero_and_saves(tmp_path, capsys):
    out = tmp_path / "demo.png"
    assert main(["demo", "--steps", "2", "--backend", "torch", "--save", str(out)]) == 0
    text = capsys.readouterr().out
    assert "outputs agree: yes" in text
    assert "group_norm_silu" in text and "time per step: stock" in text
    assert "reference backend (torch)" in text
    image = Image.open(out)
    assert image.width == 2 * image.height  # stock | patched


def test_demo_other_family_denoiser(capsys):
    assert main(["demo", "--model", "animatediff", "--steps", "2", "--backend", "torch"]) == 0
    assert "outputs agree: yes" in capsys.readouterr().out


def test_demo_tune_prints_the_tuning_table(capsys):
    assert main(["demo", "--model", "dit", "--steps", "1", "--backend", "torch", "--tune"]) == 0
    text = capsys.readouterr().out
    assert "ldmopt.tune (time.perf_counter; median of 3 calls after 1 warm-up" in text
    assert "outputs agree: yes" in text and ", tuned " in text


def test_demo_forced_backend_that_cannot_run_is_a_clear_error(capsys):
    # The interpreter refuses bf16 matrix products (it computes them wrongly): a message, not a traceback.
    assert main(["demo", "--model", "dit", "--steps", "1", "--dtype", "bfloat16", "--backend", "triton"]) == 2
    assert "--backend triton: ldmopt.linear: backend 'triton' was forced" in capsys.readouterr().err


def _backend_lines(text: str) -> list[str]:
    lines = text.splitlines()
    start = lines.index("  backends that ran since patch (process-wide):")
    return [line for line in lines[start + 1 :] if line.startswith("    ")][:50]


def test_demo_report_counts_one_patched_run_not_the_profiling_pass(capsys, monkeypatch):
    import ldmopt.demo as demo

    args = ["demo", "--model", "dit", "--steps", "2", "--backend", "torch"]
    monkeypatch.setattr(demo, "_category_split", lambda run, modules, device: "split skipped")
    assert main(args) == 0
    without_profiling = _backend_lines(capsys.readouterr().out)
    monkeypatch.undo()
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "per-category time split of one patched run" in text  # the profiling pass did run the model again
    assert _backend_lines(text) == without_profiling


def test_demo_flux_in_fp16_agrees(capsys):
    # Flux multiplies its timestep by 1000 itself: the zoo inputs pass t / 1000 as FluxPipeline does (999 was 999,000:
    # inf in fp16, and a stock output of NaN).
    assert main(["demo", "--model", "flux", "--steps", "1", "--dtype", "float16", "--backend", "torch"]) == 0
    assert "outputs agree: yes" in capsys.readouterr().out


def test_demo_cuda_graphs_times_both_runs_graphed(capsys, monkeypatch):
    """``--cuda-graphs`` with the CPU stand-in for the capture (tests/support/replaying_graphs.py): the stock and the
    patched pipeline each replay their UNet, agree with the stock eager images, and leave the pipeline as it was."""
    from tests.support.replaying_graphs import replaying_backend

    backend = replaying_backend(monkeypatch)
    assert main(["demo", "--steps", "3", "--backend", "torch", "--cuda-graphs"]) == 0
    out = capsys.readouterr().out
    assert "time per step, stock + CUDA graphs:" in out and "time per step, patched + CUDA graphs:" in out, out
    assert out.count(": agrees)") == 2 and "DOES NOT AGREE" not in out
    assert out.count("unet: 1 graphs held (1 captured, 0 evicted, 0 recaptures after parameters moved), 3 replays") == 2
    assert backend.captures == 2


def test_demo_cuda_graphs_without_a_gpu_says_why(capsys):
    assert main(["demo", "--model", "dit", "--steps", "1", "--backend", "torch", "--cuda-graphs"]) == 0
    assert "--cuda-graphs skipped: tensors on cpu: CUDA graphs hold CUDA work only" in capsys.readouterr().out
