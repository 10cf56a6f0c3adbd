"""Command line of examples/train_ldm.py: its flags, the merge of a resumed checkpoint's saved arguments with the ones
given, and the checks that refuse nonsensical values or note flags a run has no use for."""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
from pathlib import Path

from _train_model import SMALL_MODELS, is_video_model, model_names
from _train_utils import DistInfo

# Resume: arguments that define the run (a checkpoint cannot continue with other values) and arguments that belong to
# this invocation or machine (never taken from the checkpoint). See the docstring of examples/train_ldm.py.
RUN_DEFINING = frozenset({
    "model", "tiny", "frames", "resolution", "latent_factor", "vae", "num_shapes", "seed",
    "num_train_timesteps", "beta_schedule", "prediction_type",
})  # fmt: skip
#: Frames per clip of video models when --frames is not given.
DEFAULT_FRAMES = 8
NOT_INHERITED = frozenset({
    "resume", "output_dir", "device", "backend", "num_workers", "no_progress", "profile_wait", "profile_warmup",
    "profile_active",
})  # fmt: skip


def _parser(description: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawTextHelpFormatter)
    g = p.add_argument_group("model")
    image = ", ".join(n for n in model_names() if not is_video_model(n))
    video = ", ".join(n for n in model_names() if is_video_model(n))
    g.add_argument("--model", default="unet-small",
                   help=f"built-in or zoo (ldmopt.configs) denoiser. Image: {image}. Video: {video}")  # fmt: skip
    g.add_argument("--tiny", action="store_true",
                   help="zoo models (and a zoo --vae): the tiny variant (ldmopt.configs.tiny_config)")  # fmt: skip
    g.add_argument("--fused", action=argparse.BooleanOptionalAction, default=True,
                   help="ldmopt.patch(model, training=True) (default: on)")  # fmt: skip
    g.add_argument("--tune", action=argparse.BooleanOptionalAction, default=False,
                   help="with --fused: patch only the rules whose fused layers made a training step faster on\n"
                        "this machine (ldmopt.tune(training=True): a few dozen steps timed before training;\n"
                        "under torchrun rank 0's choice is applied on every rank); saved to\n"
                        "OUTPUT_DIR/tune_choice.json")  # fmt: skip
    g.add_argument("--tune-choice", default=None, metavar="PATH",
                   help="with --fused: patch as a saved training choice says, without measuring (tune_choice.json\n"
                        "of a --tune run, `ldmopt tune MODEL --training --save-choice PATH`, or\n"
                        "report.tuning.save() after ldmopt.tune(..., training=True))")  # fmt: skip
    g.add_argument("--backend", default="auto", choices=["auto", "cuda", "triton", "torch"],
                   help="force one ldmopt backend for the fused ops (default: automatic choice)")  # fmt: skip
    g.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                   help="torch.compile the (patched) model")  # fmt: skip
    g.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=False)
    g.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=True,
                   help="NHWC activations and weights, video latents (B, F, h, w, C) in memory (default: on; fused "
                        "ResnetBlock2D and the token-order temporal layers need it)")  # fmt: skip
    g = p.add_argument_group("data")
    g.add_argument("--data", default=None,
                   help="image folder (sub-folders = classes; image models); default: procedural shapes")  # fmt: skip
    g.add_argument("--frames", type=int, default=None,
                   help=f"video models: frames per clip (default: {DEFAULT_FRAMES})")  # fmt: skip
    g.add_argument("--num-shapes", type=int, default=50_000, help="size of the procedural dataset")
    g.add_argument("--resolution", type=int, default=32, help="image size in pixels")
    g.add_argument("--hflip", action=argparse.BooleanOptionalAction, default=False,
                   help="image folder: random horizontal flips")  # fmt: skip
    g.add_argument("--vae", default=None, help="local diffusers AutoencoderKL folder (zoo models; sets the factor), "
                   "or a zoo VAE name (sd15-vae, sdxl-vae: random weights)")  # fmt: skip
    g.add_argument("--latent-factor", type=int, default=8, help="pixels per latent for zoo models without --vae")
    g.add_argument("--num-workers", type=int, default=None, help="DataLoader workers (default: 4 on CUDA, else 0)")
    g = p.add_argument_group("diffusion")
    g.add_argument("--num-train-timesteps", type=int, default=1000)
    g.add_argument("--beta-schedule", default="linear", choices=["linear", "scaled_linear", "squaredcos_cap_v2"])
    g.add_argument("--prediction-type", default="epsilon", choices=["epsilon", "v_prediction"])
    g.add_argument("--cond-drop", type=float, default=0.1, help="probability of the null label (for CFG)")
    g = p.add_argument_group("optimisation")
    g.add_argument("--max-steps", type=int, default=5000)
    g.add_argument("--batch-size", type=int, default=64, help="global batch size")
    g.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step")
    g.add_argument("--lr", type=float, default=2e-4)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--lr-scheduler", default="constant_with_warmup",
                   choices=["constant", "constant_with_warmup", "linear", "cosine"])  # fmt: skip
    g.add_argument("--warmup-steps", type=int, default=200)
    g.add_argument("--max-grad-norm", type=float, default=1.0, help="0 disables clipping")
    g.add_argument("--ema-decay", type=float, default=0.9999, help="0 disables the EMA")
    g.add_argument("--mixed-precision", default="no", choices=["no", "fp16", "bf16"])
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    g = p.add_argument_group("checkpoints, samples, logging")
    g.add_argument("--output-dir", default="runs/train_ldm")
    g.add_argument("--resume", default=None,
                   help="checkpoint file, a run's folder (its newest checkpoint), or 'auto' for the newest in\n"
                        "--output-dir (none: a fresh start). Arguments not given take the checkpoint's values;\n"
                        "model/data/diffusion ones must not change;\n"
                        "--output-dir, --device, --backend, --num-workers, --no-progress, --profile-* are never\n"
                        "inherited (see the docstring)")  # fmt: skip
    g.add_argument("--save-every", type=int, default=1000)
    g.add_argument("--keep-last", type=int, default=3, help="checkpoints kept (0 keeps all)")
    g.add_argument("--save-final", action=argparse.BooleanOptionalAction, default=True,
                   help="save the EMA model with save_pretrained, its label embeddings and denoiser.json to\n"
                        "OUTPUT_DIR/final at the end (default: on)")  # fmt: skip
    g.add_argument("--sample-every", type=int, default=1000, help="0 disables sampling")
    g.add_argument("--num-sample-images", type=int, default=16)
    g.add_argument("--sampler", default="ddim", choices=["ddim", "ddpm"])
    g.add_argument("--sample-steps", type=int, default=50)
    g.add_argument("--guidance-scale", type=float, default=3.0)
    g.add_argument("--log-every", type=int, default=10,
                   help="steps between logged metrics; the loss logged is their mean (default: 10)")  # fmt: skip
    g.add_argument("--report-to", default="none", choices=["none", "tensorboard", "wandb"])
    g.add_argument("--run-name", default=None)
    g.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    g = p.add_argument_group("profiling (torch.profiler schedule; off unless --profile-active > 0)")
    g.add_argument("--profile-wait", type=int, default=5)
    g.add_argument("--profile-warmup", type=int, default=2)
    g.add_argument("--profile-active", type=int, default=0)
    return p


def parse_args(argv: list[str] | None = None, description: str | None = None) -> argparse.Namespace:
    return _parser(description).parse_args(argv)


def explicit_args(argv: list[str] | None = None) -> set[str]:
    """The destinations given on the command line (even with their default value)."""
    p = _parser()
    unset = object()
    # argparse fills in defaults only for names the namespace lacks: a namespace pre-filled with a marker keeps the
    # marker exactly where nothing was given.
    ns = argparse.Namespace(**dict.fromkeys(vars(p.parse_args([])), unset))
    p.parse_args(argv, namespace=ns)
    return {name for name, value in vars(ns).items() if value is not unset}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _shown(name: str, value) -> str:
    """The flag as typed: --fused / --no-fused for booleans, --lr 0.001 otherwise."""
    if isinstance(value, bool):
        return _flag(name) if value else "--no-" + _flag(name)[2:]
    return f"{_flag(name)} {value}"


def _same(name: str, saved, given) -> bool:
    if name == "frames":  # unset is the default 8 frames (video models)
        saved, given = (DEFAULT_FRAMES if v is None else v for v in (saved, given))
    return saved == given


def resume_args(
    args: argparse.Namespace, saved: dict | None, given: set[str] | None, is_main: bool, source
) -> argparse.Namespace:
    """``args`` with the checkpoint's ``saved`` values for every argument not in ``given`` (all of them are given when
    ``given`` is None); SystemExit when a given value changes a RUN_DEFINING one; a note for each other override."""
    if saved is None:
        if is_main:
            print(f"note: {source} has no saved arguments (older checkpoint); using the command line's", flush=True)
        return args
    given = set(vars(args)) if given is None else given
    merged = vars(args).copy()
    for name, value in vars(args).items():
        if name in NOT_INHERITED or name not in saved:  # a flag newer than the checkpoint keeps its value
            continue
        old = saved[name]
        if name not in given:
            merged[name] = old
        elif not _same(name, old, value):
            if name in RUN_DEFINING:
                raise SystemExit(
                    f"{_flag(name)}: the checkpoint has {old!r}, the command line {value!r}; {source} cannot continue "
                    f"with another {_flag(name)} (leave it out to resume, or start a new run in another --output-dir)"
                )
            if is_main:
                saved_text = _shown(name, old) if isinstance(old, bool) else old
                print(f"note: {_shown(name, value)} overrides the checkpoint's {saved_text}", flush=True)
    return argparse.Namespace(**merged)


def check_args(args: argparse.Namespace, info: DistInfo) -> int:
    """Refuse nonsensical values up front (naming the flag and the value); return the per-process micro-batch."""
    # `not x >= 0` also refuses NaN.
    positive = ["batch_size", "grad_accum", "max_steps", "log_every", "resolution", "num_shapes", "latent_factor",
                "num_train_timesteps"]  # fmt: skip
    if args.sample_every > 0:
        positive += ["num_sample_images", "sample_steps"]
    for name in positive:
        if not getattr(args, name) >= 1:
            raise SystemExit(f"{_flag(name)} must be positive, got {getattr(args, name)}")
    for name in ("save_every", "sample_every", "keep_last", "warmup_steps", "lr", "weight_decay", "max_grad_norm",
                 "num_workers", "profile_wait", "profile_warmup", "profile_active"):  # fmt: skip
        value = getattr(args, name)
        if value is not None and not value >= 0:
            raise SystemExit(f"{_flag(name)} must be >= 0, got {value}")
    if (args.tune or args.tune_choice) and not args.fused:
        raise SystemExit(f"{'--tune' if args.tune else '--tune-choice'} chooses what --fused patches; it needs --fused")
    if args.tune and args.tune_choice:
        raise SystemExit("--tune measures a choice and --tune-choice applies a saved one: give one of them")
    if args.seed < 0:
        raise SystemExit(f"--seed must be >= 0, got {args.seed}")
    if not math.isfinite(args.guidance_scale):
        raise SystemExit(f"--guidance-scale must be finite, got {args.guidance_scale}")
    if not 0 <= args.ema_decay < 1:
        raise SystemExit(f"--ema-decay must be in [0, 1), got {args.ema_decay} (0 disables the EMA)")
    if not 0 <= args.cond_drop <= 1:
        raise SystemExit(f"--cond-drop must be in [0, 1], got {args.cond_drop}")
    if args.sample_every > 0 and args.sample_steps > args.num_train_timesteps:
        raise SystemExit(f"--sample-steps {args.sample_steps} exceeds --num-train-timesteps {args.num_train_timesteps}")
    _check_output_dir(args.output_dir)
    if args.report_to == "wandb" and importlib.util.find_spec("wandb") is None:
        raise SystemExit("--report-to wandb needs the wandb package: pip install wandb (or --report-to tensorboard)")
    per_step = info.world_size * args.grad_accum
    if args.batch_size % per_step:
        raise SystemExit(
            f"--batch-size {args.batch_size} must be divisible by processes x --grad-accum = "
            f"{info.world_size} x {args.grad_accum}"
        )
    return args.batch_size // per_step


def _check_output_dir(path: str) -> None:
    """--output-dir must be a folder this process can create or write, checked before the model is built."""
    out = Path(path)
    existing = next((p for p in (out, *out.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise SystemExit(f"--output-dir {path!r}: {existing} exists and is not a folder")
    if existing is not None and not os.access(existing, os.W_OK | os.X_OK):
        raise SystemExit(f"--output-dir {path!r}: {existing} is not writable")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SystemExit(f"--output-dir {path!r} cannot be created: {exc.strerror or exc}") from exc


def unused_flags(args: argparse.Namespace, given: set[str] | None) -> list[str]:
    """Flags given that this run has no use for (said, not refused: a launcher's fixed flag list should still run)."""
    given = set(vars(args)) if given is None else given
    notes = []
    if args.hflip and "hflip" in given and args.data is None:
        notes.append("--hflip flips the images of an image folder (--data); the procedural shapes are used as drawn")
    if args.model in SMALL_MODELS:
        for name in ("tiny", "latent_factor"):
            if name in given and getattr(args, name) not in (None, False):
                notes.append(f"{_flag(name)} is for zoo models; the built-in {args.model} is used as defined")
    return notes


def tuning_choice(args: argparse.Namespace, state: dict | None, given: set[str] | None, is_main: bool):
    """What --tune-choice or a resumed checkpoint says to patch (a path or a choice dict), or None: measure (--tune)
    or patch everything. A checkpoint of a tuned run keeps the choice it trained with, and resuming applies it again
    (the same kernels: an exact resume) unless --tune (measure again) or --tune-choice is given anew."""
    given = set(vars(args)) if given is None else given
    if not args.fused:  # what a checkpoint's run tuned with does not apply to an unfused resume
        args.tune = args.tune if "tune" in given else False
        args.tune_choice = args.tune_choice if "tune_choice" in given else None
        return None  # a --tune or --tune-choice given now is refused in check_args
    if "tune_choice" not in given and (args.tune or "tune" in given):
        args.tune_choice = None  # a path inherited from the checkpoint's run: --tune (measure) or --no-tune given wins
    if args.tune_choice and "tune_choice" in given:
        if "tune" not in given:
            args.tune = False  # a choice given now wins over an inherited --tune (both given: refused)
        return args.tune_choice
    saved = state.get("tune_choice") if state is not None else None
    if saved is not None and "tune" not in given:
        if is_main:
            print("note: resuming with the tuning choice the checkpoint trained with (--tune measures again)",
                  flush=True)  # fmt: skip
        args.tune = False
        return saved
    return args.tune_choice or None


def frames_per_clip(args: argparse.Namespace, video: bool) -> int | None:
    if not video:
        if args.frames is not None:
            raise SystemExit(f"--frames is for video models; --model {args.model} is an image model")
        return None
    frames = DEFAULT_FRAMES if args.frames is None else args.frames
    if frames < 1:
        raise SystemExit(f"--frames must be positive, got {frames}")
    return frames
