"""Settings the models would change or ignore are refused; output folders are made; --check-flops changes nothing."""

import argparse
import importlib.util
import json
import re
import sys

import pytest
import torch

from ldmopt.profiler import analyze, cli, profile
from ldmopt.profiler.measure import _save_trace

needs_matplotlib = pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="needs matplotlib")


def _parse(command: str, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"ldmopt {command}")
    getattr(cli, f"configure_{command}")(parser)
    return parser.parse_args(argv)


def _run(command: str, argv: list[str]) -> int:
    return getattr(cli, f"run_{command}")(_parse(command, argv))


def test_check_flops_leaves_the_recorded_ops_bytes_and_times_unchanged():
    # FlopCounterMode inside the recorder decomposed upsample_nearest2d into arange/mul/_unsafe_index records.
    plain, checked = analyze("sd15", tiny=True), analyze("sd15", tiny=True, check_flops=True)
    assert checked.flop_counter_total == checked.total_flops == plain.total_flops
    assert (checked.ops, checked.total_bytes, checked.patched_bytes) == (
        plain.ops,
        plain.total_bytes,
        plain.patched_bytes,
    )
    assert checked.time_s == plain.time_s and checked.patched_time_s == plain.patched_time_s


def test_check_flops_refuses_a_patched_model(capsys):
    """FlopCounterMode's module hooks sent every fused block to its stock forward, so a patched recording with
    --check-flops was the stock model's (0 of DiT's 140 ldmopt ops), its FLOPs still 'equal'."""
    import ldmopt
    from ldmopt.configs import build_model

    with pytest.raises(ValueError, match="check_flops=True with a patched model"):
        analyze("dit", tiny=True, patched=True, check_flops=True)
    model = build_model("dit", device="meta", tiny=True)
    ldmopt.patch(model)
    with pytest.raises(ValueError, match="Check the stock model"):
        analyze(model, check_flops=True)
    assert _run("analyze", ["dit", "--tiny", "--patched", "--check-flops"]) == 2
    assert "--check-flops with --patched: torch's FlopCounterMode has no formulas" in capsys.readouterr().err


def test_analyze_names_the_model_to_pass_for_a_pipeline():
    from diffusers import DiTPipeline, DPMSolverMultistepScheduler

    from ldmopt.configs import build_model

    class Vae(torch.nn.Module):
        pass

    pipe = DiTPipeline(transformer=build_model("dit", device="meta", tiny=True), vae=Vae(),
                       scheduler=DPMSolverMultistepScheduler())  # fmt: skip
    with pytest.raises(
        TypeError, match=r"analyze takes one model, not a pipeline \(DiTPipeline.*pass pipe.transformer"
    ):
        analyze(pipe)
    with pytest.raises(TypeError, match="model_or_name is of type int; expected a zoo name"):
        analyze(3)


@pytest.mark.parametrize(
    ("name", "kwargs", "match"),
    [
        ("sd15", {"frames": 4}, "sd15 .* image model: it has no frames"),
        ("dit", {"frames": 4}, "dit .* image model"),
        ("sd15", {"batch": 0}, "batch must be a positive integer, got 0"),
        ("animatediff", {"frames": 0}, "frames must be a positive integer, got 0"),
        ("sd15", {"batch": -1}, "batch must be a positive integer"),
        ("flux", {"resolution": 1000}, "multiple of 16 px .* 1000x1000, which it would run as 992x992"),
        ("dit", {"resolution": 264}, "multiple of 16 px"),
        ("sd3", {"resolution": (1024, 1032)}, "multiple of 16 px"),
        ("wan2.1-1.3b", {"resolution": (488, 832)}, "multiple of 16 px"),
        ("latte", {"resolution": 520}, "multiple of 16 px"),
        # diffusers' DiT unpatchify assumes a square latent: a reshape error deep in the forward
        ("dit", {"resolution": (64, 128)}, r"dit \(DiTTransformer2DModel\) takes square images only; got .* 64x128"),
    ],
)
def test_settings_the_model_would_change_or_ignore_are_refused(name, kwargs, match):
    with pytest.raises(ValueError, match=match):
        analyze(name, tiny=True, **kwargs)


def test_unets_and_vaes_take_any_multiple_of_8():
    # diffusers sizes each UNet upsampler to its skip connection: 520 px (65x65 latents) is analysed as 520 px.
    a, b = analyze("sd15", tiny=True, resolution=520), analyze("sd15", tiny=True, resolution=512)
    assert a.resolution == (520, 520) and a.total_flops > b.total_flops
    assert analyze("sd15-vae", tiny=True, resolution=520).resolution == (520, 520)


def test_profile_refuses_frames_on_an_image_model_before_building():
    with pytest.raises(ValueError, match="no frames"):
        profile("sd15", tiny=True, device="cpu", frames=4)
    with pytest.raises(ValueError, match="steps must be a positive integer"):
        profile("sd15", tiny=True, device="cpu", steps=0)


@pytest.mark.parametrize("setting", [{"batch": 7}, {"frames": 3}, {"resolution": 1024}])
def test_a_setting_given_with_explicit_inputs_is_refused(setting):
    # The inputs ran as given while the setting labelled the result ("3 frames, batch 7" for a batch-2 image input).
    import torch

    conv = torch.nn.Conv2d(4, 4, 3, padding=1)
    inputs = {"input": torch.randn(2, 4, 8, 8)}
    name, value = next(iter(setting.items()))
    with pytest.raises(ValueError, match=f"{name}={value} given with explicit inputs"):
        analyze(conv, inputs=inputs, dtype="fp32", **setting)
    with pytest.raises(ValueError, match=f"{name}={value} given with explicit inputs"):
        profile("sd15", tiny=True, device="cpu", inputs=inputs, **setting)
    assert analyze(conv, inputs=inputs, dtype="fp32").setting() == "Conv2d, fp32"


def test_profile_refuses_the_meta_device_and_points_to_analyze(capsys):
    # It "ran" on meta tensors and reported dispatcher overhead as measured convolution/GEMM/attention time.
    from ldmopt import configs

    with pytest.raises(ValueError, match=r"device 'meta': profile measures real execution.*ldmopt\.analyze"):
        profile("sd15", tiny=True, device="meta")
    with pytest.raises(ValueError, match=r"on the meta device: profile measures real execution.*ldmopt\.analyze"):
        profile(configs.build_model("sd15", tiny=True), steps=1, warmup=0)  # build_model's default device is meta
    assert _run("profile", ["sd15", "--tiny", "--device", "meta"]) == 2
    assert "ldmopt analyze" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ({"dtype": "fp16"}, "dtype='fp16'"),
        ({"tiny": True, "batch": 9}, "tiny=True, batch=9"),
        ({"resolution": 512, "frames": 16}, "resolution=512, frames=16"),
    ],
)
def test_profile_refuses_zoo_settings_a_module_or_callable_would_ignore(setting, named):
    # A module or callable ran as it was: "dtype=fp16, resolution 512" profiled an fp32 model at its inputs' size.
    import torch

    net = torch.nn.Linear(8, 8)
    for target in (net, lambda: net(torch.randn(2, 8))):
        with pytest.raises(ValueError, match=f"{re.escape(named)} with a .* target would be ignored"):
            profile(target, steps=1, warmup=0, **setting)


def test_profile_training_without_a_trainable_parameter_is_refused():
    # It profiled the forward only and labelled the run "training" (analyze(training=True) already refused it).
    import torch

    frozen = torch.nn.Linear(8, 8).requires_grad_(False).eval()
    with pytest.raises(ValueError, match="training=True: Linear has no parameter that requires a gradient"):
        profile(frozen, inputs=(torch.randn(2, 8),), steps=1, warmup=0, wait=0, training=True)
    assert not frozen.training


@pytest.mark.parametrize("dtype", ["tf32", "fp8", "int8", torch.float8_e4m3fn, torch.float64, torch.int8], ids=str)
def test_analyze_dtype_outside_the_table_names_the_supported_ones(dtype):
    # names and torch dtypes alike: the GPU table's other keys (tf32, fp8) are rates, not dtypes a model is built in
    with pytest.raises(ValueError, match=r"dtype=.*: the models are analysed in fp16, bf16, fp32"):
        analyze("dit", tiny=True, dtype=dtype)


@pytest.mark.parametrize("resolution", [(512,), "512", (512.0, 512.0), True])
def test_analyze_resolution_that_is_not_an_int_or_a_pair_of_ints_is_refused(resolution):
    with pytest.raises(ValueError, match=r"resolution must be an int or a \(height, width\) pair of ints, got"):
        analyze("sd15", tiny=True, resolution=resolution)


@pytest.mark.parametrize(
    ("command", "argv", "match"),
    [
        ("analyze", ["sd15", "--dtype", "tf32"], "fp16', 'bf16', 'fp32"),
        ("analyze", ["sd15", "--batch", "0"], "--batch: must be positive, got 0"),
        ("analyze", ["animatediff", "--frames", "8,0"], "--frames: .*must be positive, got 0"),
        ("profile", ["sd15", "--frames", "0"], "--frames: must be positive"),
        ("profile", ["sd15", "--steps", "0"], "--steps: must be positive, got 0"),
        ("profile", ["sd15", "--dtype", "fp8"], "fp16', 'bf16', 'fp32"),
        ("analyze", ["sd15", "--resolution", "512x"], "expected pixels as 512 or HxW .*got '512x'"),
        ("profile", ["sd15", "--resolution", "256,512"], "got '256,512'; ldmopt analyze sweeps a comma list"),
        # the API's refusal says "resolution must be positive" / points to register_gpu, not naming the flag
        ("analyze", ["sd15", "--resolution", "0"], "argument --resolution: pixels must be positive, got '0'"),
        ("analyze", ["sd15", "--resolution", "512,-8"], "argument --resolution: '512,-8': pixels must be positive"),
        ("profile", ["sd15", "--resolution", "64x0"], "argument --resolution: pixels must be positive, got '64x0'"),
        ("analyze", ["sd15", "--gpu", "V100"], "argument --gpu: unknown GPU 'V100'; expected one of A100, H100, H200"),
    ],
)
def test_cli_rejects_bad_values_while_parsing(command, argv, match, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _parse(command, argv)
    assert exit_info.value.code == 2
    assert re.search(match, capsys.readouterr().err)


def test_cli_refuses_frames_on_an_image_model_and_misaligned_resolution(capsys):
    assert _run("analyze", ["sdxl", "--tiny", "--frames", "8,16"]) == 2
    err = capsys.readouterr().err
    assert "sdxl" in err and "no frames" in err and "Traceback" not in err
    assert _run("analyze", ["flux", "--resolution", "1000"]) == 2
    assert "multiple of 16 px" in capsys.readouterr().err
    assert _run("profile", ["sd15", "--tiny", "--device", "cpu", "--frames", "4"]) == 2
    assert "no frames" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("command", "argv", "message"),
    [
        ("analyze", ["sd15", "--frames", "8,16"],
         "--frames 8,16: sd15 (Stable Diffusion 1.5 UNet) is an image model: it has no frames; drop --frames"),
        ("profile", ["sd15", "--frames", "4"], "--frames 4: sd15 (Stable Diffusion 1.5 UNet) is an image model"),
        ("tune", ["sd15", "--frames", "4"], "--frames 4: sd15 (Stable Diffusion 1.5 UNet) is an image model"),
        ("analyze", ["dit", "--resolution", "256,512x256"], "--resolution 512x256: dit (DiTTransformer2DModel) takes "
         "square images only; give one side (--resolution 512) or equal sides"),
        ("profile", ["dit", "--resolution", "64x128"], "--resolution 64x128: dit (DiTTransformer2DModel) takes square"),
        ("tune", ["dit", "--resolution", "64x128"], "--resolution 64x128: dit (DiTTransformer2DModel) takes square"),
        ("analyze", ["dit", "--patched", "--placement", "auto"], "--placement auto with --patched: the patched "),
        ("analyze", ["dit", "--patched", "--check-flops"], "--check-flops with --patched: "),
        ("tune", ["sd15", "--cuda-graph"], "--cuda-graph times CUDA graphs, which run on a GPU; the model would be on "
         "cpu: --device cuda"),
        ("profile", ["sd15", "--wandb", "proj"],
         "--wandb proj needs the 'wandb' package, which is not installed: pip install wandb"),
        ("profile", ["sd15", "--tensorboard", "tb"], "--tensorboard tb needs the 'tensorboard' package"),
    ],
)  # fmt: skip
def test_cli_names_its_flags_where_the_api_names_its_arguments(command, argv, message, capsys, monkeypatch):
    # "frames=8 would be ignored", "(resolution=512)", "placement='auto' with patched=True", "cuda_graph=True needs",
    # "(wandb=...)": the Python argument names, not what was typed; said before any work
    import ldmopt
    from ldmopt.cli import main
    from ldmopt.profiler import cost, measure

    for module, name in [(cost, "analyze"), (measure, "profile"), (measure, "_resolve_target"), (ldmopt, "tune")]:
        monkeypatch.setattr(module, name, lambda *a, **k: pytest.fail("ran before checking the flags"))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("wandb", "tensorboard")
                        else real(name, *a))  # fmt: skip
    device = ["--device", "cpu"] if command != "analyze" else []
    assert main([command, *argv[:1], "--tiny", *device, *argv[1:]]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ldmopt {command}: {message}"), err
    assert not re.search(r"\b(frames|resolution|placement|check_flops|patched|cuda_graph|wandb|tensorboard)=", err)


def test_cli_analyze_writes_json_and_plot_into_missing_folders(tmp_path, capsys):
    out_json = tmp_path / "new" / "deeper" / "a.json"
    argv = ["dit", "--tiny", "--json", str(out_json)]
    if importlib.util.find_spec("matplotlib") is not None:
        argv += ["--plot", str(tmp_path / "other" / "a.png")]
    assert _run("analyze", argv) == 0
    assert json.loads(out_json.read_text())["model"] == "dit"
    if "--plot" in argv:
        assert (tmp_path / "other" / "a.png").stat().st_size > 0
    capsys.readouterr()


@pytest.mark.parametrize("command", ["analyze", "profile"])
def test_cli_plot_that_cannot_be_written_fails_before_the_work(command, tmp_path, capsys, monkeypatch):
    # Both used to do the whole analysis or profile, then end in matplotlib's traceback.
    device = ["--device", "cpu"] if command == "profile" else []
    argv = ["sd15", "--tiny", *device, "--plot", str(tmp_path / "out.txt")]
    if importlib.util.find_spec("matplotlib") is not None:
        assert _run(command, argv) == 2
        assert "txt suffix; matplotlib writes" in capsys.readouterr().err
        for folder in ("folder.png", "plots"):
            (tmp_path / folder).mkdir()
            assert _run(command, [*argv[:-1], str(tmp_path / folder)]) == 2
            assert "is a folder" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as without matplotlib installed
    monkeypatch.setitem(sys.modules, "matplotlib.backend_bases", None)
    assert _run(command, [*argv[:-1], str(tmp_path / "out.png")]) == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err


def test_cli_output_folder_that_cannot_be_made_fails_before_the_work(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    assert _run("analyze", ["dit", "--tiny", "--json", str(blocker / "a.json")]) == 2
    assert "cannot create the folder" in capsys.readouterr().err


@pytest.mark.parametrize(("command", "option"), [("analyze", "--json"), ("profile", "--json"), ("profile", "--trace")])
def test_cli_json_or_trace_that_is_a_folder_fails_before_the_work(command, option, tmp_path, capsys, monkeypatch):
    # The whole analysis or profile ran and printed, then open() raised IsADirectoryError and the result was lost.
    from ldmopt.profiler import cost, measure

    monkeypatch.setattr(cost, "analyze", lambda *a, **k: pytest.fail("ran before checking the output path"))
    monkeypatch.setattr(measure, "profile", lambda *a, **k: pytest.fail("ran before checking the output path"))
    device = ["--device", "cpu"] if command == "profile" else []
    assert _run(command, ["dit", "--tiny", *device, option, str(tmp_path)]) == 2
    assert f"{option} {tmp_path} is a folder; give a file name such as" in capsys.readouterr().err
    if option == "--trace":  # profile() itself, before building the model
        with pytest.raises(ValueError, match=f"trace '{re.escape(str(tmp_path))}' is a folder"):
            profile("dit", tiny=True, device="cpu", trace=str(tmp_path))


@pytest.mark.filterwarnings("ignore:Profiler won't be using warmup")
def test_profile_trace_into_a_missing_folder_is_written(tmp_path, capsys):
    trace = tmp_path / "missing" / "t.json"
    argv = ["dit", "--tiny", "--device", "cpu", "--steps", "1", "--warmup", "0", "--trace", str(trace)]
    assert _run("profile", argv) == 0
    assert json.loads(trace.read_text())["traceEvents"]
    assert str(trace) in capsys.readouterr().out


@pytest.mark.filterwarnings("ignore:Profiler won't be using warmup")
def test_profile_patched_measures_the_fused_kernels(capsys):
    # one image: the patched UNet's kernels run in the interpreter under the profiler
    argv = ["sd15", "--tiny", "--device", "cpu", "--steps", "1", "--warmup", "0", "--patched", "--batch", "1"]
    assert _run("profile", argv) == 0
    out = capsys.readouterr().out
    assert "ldmopt.patch:" in out and "0 left on the stock path" in out
    fused = [line for line in out.splitlines() if line.startswith("ldmopt fused kernels")]
    assert fused and float(fused[0].split()[3]) > 0, out


def test_a_trace_the_profiler_did_not_write_is_an_error(tmp_path):
    class SilentProfiler:  # kineto logs a failure to open the file and returns normally
        def export_chrome_trace(self, path):
            pass

    with pytest.raises(OSError, match="did not write the Chrome trace"):
        _save_trace(SilentProfiler(), str(tmp_path / "t.json"))


def _captured_figure(monkeypatch):
    import matplotlib.figure

    figures = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda self, *a, **k: figures.append(self))
    return figures


@needs_matplotlib
def test_sweep_plot_over_resolution_and_frames_keeps_settings_apart(monkeypatch, tmp_path):
    from ldmopt.profiler.plots import plot_sweep

    figures = _captured_figure(monkeypatch)
    analyses = [analyze("animatediff", tiny=True, resolution=r, frames=f, batch=1) for r in (64, 128) for f in (2, 4)]
    plot_sweep(analyses, str(tmp_path / "s.png"))
    left, right = figures[0].axes
    series = [line for line in left.get_lines() if len(line.get_xdata())]
    assert series
    for line in series:  # one resolution per line: x strictly rises, no zig-zag back to the other resolution
        xs = list(line.get_xdata())
        assert xs == sorted(set(xs)) == [2, 4]
    labels = [t.get_text() for t in right.get_xticklabels()]
    assert labels == ["64x64 F2", "64x64 F4", "128x128 F2", "128x128 F4"]
    assert len(right.patches) == 4 * len(right.get_legend().get_texts())  # one bar per setting and category


@needs_matplotlib
def test_sweep_plot_over_one_dimension_is_sorted(monkeypatch, tmp_path):
    from ldmopt.profiler.plots import plot_sweep

    figures = _captured_figure(monkeypatch)
    plot_sweep([analyze("dit", tiny=True, resolution=r, batch=1) for r in (128, 64)], str(tmp_path / "s.png"))
    left, right = figures[0].axes
    assert all(list(line.get_xdata()) == [64, 128] for line in left.get_lines())
    assert [t.get_text() for t in right.get_xticklabels()] == ["64x64", "128x128"]


def test_studies_refuses_a_missing_out_folder_before_profiling(tmp_path, monkeypatch, capsys):
    # Outside a checkout the default docs/profiling.md has no folder: said at once, not after a minute of profiling.
    from ldmopt.profiler import studies

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(studies, "render", lambda measure: pytest.fail("profiled before checking --out"))
    with pytest.raises(SystemExit) as exit_info:
        studies.main(["--no-measure"])
    assert exit_info.value.code == 2
    assert "--out docs/profiling.md: folder" in capsys.readouterr().err
    monkeypatch.setattr(studies, "render", lambda measure: "text")
    assert studies.main(["--out", str(tmp_path / "p.md")]) == 0
    assert (tmp_path / "p.md").read_text() == "text"
