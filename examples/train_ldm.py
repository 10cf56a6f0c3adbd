#!/usr/bin/env python
"""Train a diffusion UNet or transformer, image or video, with ldmopt's fused layers: noise prediction, AdamW, EMA,
mixed precision, exact resume, sample grids, TensorBoard/W&B, a profiling window, and data-parallel training under
torchrun.

Single process (GPU if present, else CPU), procedural coloured shapes at 32x32 with the small built-in UNet::

    python examples/train_ldm.py --output-dir runs/shapes --max-steps 5000 --mixed-precision bf16

Eight GPUs (NCCL), an image folder, a zoo config (SD1.5-size UNet on 256px images, 32x32 latents)::

    torchrun --nproc_per_node 8 examples/train_ldm.py --model sd15 --data /path/to/images --resolution 256 \\
        --batch-size 256 --mixed-precision bf16 --gradient-checkpointing --report-to tensorboard

Any zoo denoiser (``--help`` lists them; ``--tiny`` for the tiny variants): SD1.5/2.1/XL, DiT,
PixArt-alpha/Sigma, SD3, Flux (image models on coloured shapes) and AnimateDiff, SVD/SVD-XT, ModelScope, Latte, Wan
2.1 (video models on clips of ``--frames`` frames in which the shapes move; sample grids show one clip per row)::

    python examples/train_ldm.py --model animatediff --frames 16 --resolution 256 --mixed-precision bf16

``--tune`` patches only the fused rules that made a training step faster on this machine (``ldmopt.tune(...,
training=True)``: a few dozen forward and backward passes on one micro-batch, timed before training, the model's
weights untouched); under torchrun every rank measures and rank 0's choice is applied on all of them. The choice is
saved to ``OUTPUT_DIR/tune_choice.json`` and in every checkpoint; ``--tune-choice PATH`` applies a saved one without
measuring, and a resumed run applies its checkpoint's (the same kernels, so an exact resume) unless ``--tune`` or
``--tune-choice`` is given again.

``--batch-size`` is the global batch (split over processes and ``--grad-accum`` micro-steps). Noise, timesteps and
label drops are drawn per sample from (seed, epoch, index), so a checkpoint resumes exactly on the same number of
processes and continues with the same loss (up to float summation order) on a different number.

Resuming (``--resume auto`` or ``--resume PATH``) continues the checkpoint's run: every argument not given on the
command line takes the value saved in the checkpoint, so ``--output-dir runs/shapes --resume auto`` alone is enough.
Arguments that define the model, the data or the diffusion (``RUN_DEFINING``: --model, --tiny, --frames, --resolution,
--latent-factor, --vae, --num-shapes, --seed, --num-train-timesteps, --beta-schedule, --prediction-type) cannot
change mid-run: giving another value is an error. The others (learning rate and schedule, batch size, mixed precision,
--max-steps, EMA, --fused, --channels-last, checkpoint/sample/log settings...) may be given to override the saved
value; rank 0 prints a note for each (--data too: a moved image folder; its classes must still match the
model's label embeddings). Never inherited (``NOT_INHERITED`` in _train_args.py): --resume, --output-dir (where an
auto-resume looks, so it is this command's), --device, --backend, --num-workers, --no-progress (this machine's) and
the --profile-* window (a diagnostic of this process). Checkpoints without saved arguments use the command line's.
The data position is kept in samples, so a run resumed with another --batch-size reads on from the same place in the
same epoch. Resuming from an earlier checkpoint into a folder that holds later ones forks the run: those later
checkpoints are moved to ``checkpoints/superseded-*`` so that rotation and ``--resume auto`` follow the new run.

An image folder (``--data``) is read recursively, following symlinked folders; its sub-folders are the classes (an
image directly beside them is left out). Files with an image suffix that are hidden or do not open as images are
left out too, and rank 0 lists what was left out; files without an image suffix (notes, captions) are not read.
16-bit, 32-bit int and float grey images are scaled to 8 bits by their range, not clipped.

``--save-final`` writes ``OUTPUT_DIR/final/``: the EMA weights of the diffusers model (``save_pretrained``: config.json
and diffusion_pytorch_model.safetensors), the wrapper's own EMA weights that the model needs for class-conditional
sampling (label tokens, pooled embeddings: ``conditioning.safetensors``), ``denoiser.json`` (model name, diffusers
class, number of classes, resolution, latent factor...) and the noise schedule (``scheduler_config.json``).
``_train_model.load_final(OUTPUT_DIR / "final")`` rebuilds the denoiser from them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _train_args import (
    RUN_DEFINING,
    check_args,
    explicit_args,
    frames_per_clip,
    parse_args,
    resume_args,
    tuning_choice,
    unused_flags,
)
from _train_data import (
    DiffusionSamples,
    EpochSampler,
    Framewise,
    ImageFolderDataset,
    ShapesDataset,
    VaeLatents,
    VideoShapesDataset,
    latent_codec,
    save_grid,
)
from _train_families import channels_last_, to_layout
from _train_model import EMA, build_denoiser, is_video_model, sample, save_final
from _train_utils import (
    DistInfo,
    MetricLogger,
    checkpoint_path,
    describe_first_step,
    gather_objects,
    init_distributed,
    latest_checkpoint,
    load_checkpoint,
    mean_over_ranks,
    parameter_digest,
    profile_window,
    restore_optimization,
    rng_state,
    save_checkpoint,
    seed_everything,
    set_aside_newer_checkpoints,
    set_rng_state,
    tune_patch,
)


def _listed(names, limit: int = 6) -> str:
    shown = ", ".join(repr(n) for n in list(names)[:limit])
    return f"[{shown}{', ...' if len(names) > limit else ''}] ({len(names)})"


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None  # strict JSON has no NaN (tune of a model without sites)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv, description=__doc__.split("\n\n")[0])
    given = explicit_args(argv)
    info = init_distributed(args.device)
    owns_group = info.world_size > 1
    try:
        if args.backend == "auto":
            result = train(args, info, given)
        else:
            import ldmopt

            try:
                with ldmopt.use_backend(args.backend):
                    result = train(args, info, given)
            except ldmopt.BackendUnavailableError as exc:  # e.g. triton on a CPU without TRITON_INTERPRET=1
                raise SystemExit(f"--backend {args.backend}: {exc}") from None
        if owns_group:
            dist.barrier()  # no rank tears its process group down while another still has collectives under way
        return result
    finally:
        if owns_group and dist.is_initialized():
            dist.destroy_process_group()


def train(args: argparse.Namespace, info: DistInfo, given: set[str] | None = None) -> dict:
    """``given``: the arguments given on the command line (explicit_args); None counts all of them as given."""
    device, is_main = info.device, info.is_main
    out_dir = Path(args.output_dir)
    # Every rank loads the checkpoint, first: its arguments decide the model, the data and the rest of the setup.
    resume_path = latest_checkpoint(out_dir) if args.resume == "auto" else args.resume
    if resume_path and Path(resume_path).is_dir():  # a run's output folder, or its checkpoints folder
        folder = Path(resume_path)
        resume_path = latest_checkpoint(folder) or latest_checkpoint(folder, sub="")
        if resume_path is None:
            raise SystemExit(f"--resume {folder}: the folder holds no checkpoint (step-*.pt, or checkpoints/step-*.pt)")
    if resume_path and not Path(resume_path).is_file():
        raise SystemExit(f"--resume {resume_path}: no such checkpoint file (or 'auto': the newest in --output-dir)")
    state = load_checkpoint(Path(resume_path)) if resume_path else None
    if state is not None:
        args = resume_args(args, state.get("args"), given, is_main, resume_path)
    choice = tuning_choice(args, state, given, is_main)
    if is_main:
        for note in unused_flags(args, given):
            print(f"note: {note}", flush=True)
    micro = check_args(args, info)
    channels_last = args.channels_last
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 matmuls and convs outside autocast use TF32 cores
        torch.backends.cudnn.allow_tf32 = True
    seed_everything(args.seed)  # same initial weights on every rank (DDP also broadcasts rank 0's)

    # ---------------------------------------------------------------------------------------- data and model
    video = is_video_model(args.model)
    frames = frames_per_clip(args, video)
    if video and args.data:
        raise SystemExit(f"--model {args.model} is a video model; --data image folders are for image models (video "
                         "models train on the procedural moving shapes)")  # fmt: skip
    if video:
        base = VideoShapesDataset(args.resolution, frames, args.num_shapes, seed=args.seed)
    elif args.data:
        try:
            base = ImageFolderDataset(args.data, args.resolution, hflip=args.hflip, seed=args.seed)
        except FileNotFoundError as exc:  # says which folder and why
            raise SystemExit(str(exc)) from None
        if base.skipped and is_main:
            listed = "".join(f"\n  {line}" for line in base.skipped[:20])
            more = f"\n  ... and {len(base.skipped) - 20} more" if len(base.skipped) > 20 else ""
            print(f"note: --data: {len(base.skipped)} files left out:{listed}{more}", flush=True)
    else:
        base = ShapesDataset(args.resolution, args.num_shapes, seed=args.seed)
    vae = VaeLatents(args.vae, tiny=args.tiny) if args.vae else None
    denoiser, factor, in_channels = build_denoiser(
        args.model, base.num_classes, args.resolution, vae.factor if vae else args.latent_factor, args.tiny, frames
    )
    if args.resolution % factor:
        raise SystemExit(f"--resolution {args.resolution} is not a multiple of the latent factor {factor}")
    codec = latent_codec(args, factor, in_channels, vae).to(device)
    latent_shape = (in_channels, args.resolution // factor, args.resolution // factor)
    if video:  # (F, C, h, w): the codec runs per frame; each family permutes to its own order
        codec, latent_shape = Framewise(codec), (frames, *latent_shape)
    from diffusers import DDPMScheduler
    from diffusers.optimization import get_scheduler

    noise_scheduler = DDPMScheduler(
        num_train_timesteps=args.num_train_timesteps,
        beta_schedule=args.beta_schedule,
        prediction_type=args.prediction_type,
        clip_sample=factor == 1,  # pixels live in [-1, 1]; latents (a VAE's, the patch codec's) do not
    )
    if state is not None:
        saved_classes = state.get("class_names")
        names = getattr(base, "class_names", None)
        if saved_classes is not None and names is not None and list(saved_classes) != list(names):
            raise SystemExit(
                f"--resume {resume_path}: the checkpoint trained on the classes {_listed(saved_classes)}; --data "
                f"holds {_listed(names)}. Resume with the same classes (the label embeddings are per class)"
            )
        try:
            denoiser.load_state_dict(state["model"])
        except RuntimeError as exc:  # another number of classes (an older checkpoint), another model
            raise SystemExit(f"--resume {resume_path}: the checkpoint's weights do not fit this model ({exc})") from exc
    report = None
    tuned = args.fused and (args.tune or choice is not None)  # patched below, on the device, before DDP
    if args.fused and not tuned:
        import ldmopt

        # With --channels-last every weight goes channels-last below: the report says so for the fused convs' now.
        report = ldmopt.patch(denoiser.model, training=True, channels_last_weights=channels_last or None)
        if is_main:
            print(report, flush=True)
    denoiser.to(device)
    if channels_last:
        channels_last_(denoiser)
    if args.gradient_checkpointing:
        if not denoiser.model._supports_gradient_checkpointing:
            raise SystemExit(f"--gradient-checkpointing: diffusers' {denoiser.kind} does not support it")
        denoiser.model.enable_gradient_checkpointing()
    denoiser.train()
    ema = EMA(denoiser, args.ema_decay) if args.ema_decay > 0 else None
    params = [p for p in denoiser.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params, lr=args.lr, weight_decay=args.weight_decay, fused=device.type == "cuda" or None
    )
    lr_scheduler = get_scheduler(
        args.lr_scheduler, optimizer, num_warmup_steps=args.warmup_steps, num_training_steps=args.max_steps
    )
    scaler = torch.amp.GradScaler(device.type, enabled=args.mixed_precision == "fp16")
    amp_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(args.mixed_precision)

    def autocast():
        if amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=amp_dtype)

    model: torch.nn.Module = denoiser  # DDP-wrapped and compiled below, once the model is patched
    step = 0
    data_epoch, seen_in_epoch = 0, 0  # the epoch being read, and how many of its samples (all ranks) were trained on
    if state is not None:
        restore_optimization(state, args, given, is_main, optimizer, lr_scheduler, scaler, ema, resume_path)
        step = state["step"]
        # Counted in samples, not steps: resumed with another --batch-size or process count, the run reads on from
        # the same place in the same epoch's order. (Checkpoints from before kept whole batches of their batch size.)
        data_epoch = state["epoch"]
        seen_in_epoch = state.get("samples_into_epoch", state["batches_into_epoch"] * state["batch_size"])
        if state["world_size"] == info.world_size:
            set_rng_state(state["rng"][info.rank], device)
        if is_main:
            print(f"resumed from {resume_path} at step {step} (epoch {state['epoch']})", flush=True)
            if step >= args.max_steps:
                print(f"note: the run is already at step {step}, --max-steps {args.max_steps}: nothing to train; "
                      "give a larger --max-steps to train on (the output folder is left as it is)",
                      flush=True)  # fmt: skip
            if state.get("args") is None and state["batch_size"] != args.batch_size:  # else resume_args noted it
                print(f"note: --batch-size {args.batch_size} differs from the checkpoint's {state['batch_size']}")
        if step >= args.max_steps:
            # Every rank alike. Going on would set later checkpoints aside, cut metrics.jsonl back and write final/
            # and summary.json again: from an earlier checkpoint, over a later run's results.
            return {"step": step, "world_size": info.world_size, "history": [], "trained_steps": 0}

    samples = DiffusionSamples(base, latent_shape, args.num_train_timesteps, args.cond_drop, args.seed)
    sampler = EpochSampler(samples, info.world_size, info.rank, seed=args.seed)
    workers = args.num_workers if args.num_workers is not None else (4 if device.type == "cuda" else 0)
    loader = DataLoader(
        samples, batch_size=micro, sampler=sampler, num_workers=workers, pin_memory=device.type == "cuda",
        drop_last=True, persistent_workers=False,
        # Its own generator: each iter() draws the workers' base seed from it, not from torch's global RNG, whose
        # state a resume restores at a point where the uninterrupted run drew nothing (dropout masks would differ).
        generator=torch.Generator().manual_seed(args.seed),
    )  # fmt: skip
    per_rank_step = micro * args.grad_accum  # samples each process reads per optimizer step
    if len(sampler.inner) < per_rank_step:
        raise SystemExit(f"the dataset has {len(base)} images, fewer than one global batch of {args.batch_size}")

    # ---------------------------------------------------------------------------------------- helpers
    run_name = args.run_name or f"{args.model}-{'fused' if args.fused else 'stock'}"
    logger = MetricLogger(args.report_to, out_dir, vars(args), is_main, run_name, step if state is not None else None)

    def compute_loss(batch: dict, net: torch.nn.Module | None = None) -> torch.Tensor:
        images = batch["image"].to(device, non_blocking=True)
        noise = batch["noise"].to(device, non_blocking=True)
        t = batch["timestep"].to(device, non_blocking=True)
        labels = batch["label"].to(device, non_blocking=True)
        with torch.no_grad():
            x0 = codec.encode(images, batch["posterior_noise"].to(device, non_blocking=True))
        x_t = to_layout(noise_scheduler.add_noise(x0, noise, t), channels_last)
        target = noise if args.prediction_type == "epsilon" else noise_scheduler.get_velocity(x0, noise, t)
        first = x0[:, 0] if denoiser.needs_first_frame else None
        with autocast():
            pred = (net or model)(x_t, t, labels, first)
        return F.mse_loss(pred.float(), target.float())

    def make_samples(at_step: int) -> None:
        labels = torch.arange(args.num_sample_images, device=device) % base.num_classes
        first = None
        if denoiser.needs_first_frame:  # image-to-video: condition on the first frame of fresh clips of each label
            clips = torch.stack([base.clip(int(label), i) for i, label in enumerate(labels)]).to(device)
            first = codec.encode(clips[:, :1])[:, 0]
        denoiser.eval()
        with ema.applied() if ema is not None else contextlib.nullcontext():
            z = sample(
                denoiser, noise_scheduler.config, labels, latent_shape, sampler=args.sampler,
                steps=args.sample_steps, guidance=args.guidance_scale, seed=args.seed, autocast=autocast,
                channels_last=channels_last, first_frame=first,
            )  # fmt: skip
        denoiser.train()
        images = codec.decode(z)
        if video:  # one clip per row, its frames left to right
            images = images.flatten(0, 1)
        path = save_grid(images, out_dir / "samples" / f"step-{at_step:08d}.png", nrow=frames if video else None)
        logger.image(at_step, "samples", path)

    def save(at_step: int) -> None:
        rng = gather_objects(rng_state(device), info)  # collective: every rank calls it
        # The log window's loss so far, each rank's own sum (collective too): a resumed run on as many ranks logs the
        # same means to the bit (the ranks' mean instead rounds the later mean over ranks differently).
        window = (gather_objects(float(window_loss), info), window_steps)
        if not is_main:
            return
        ckpt = {
            "model": denoiser.state_dict(), "ema": ema.state_dict() if ema else None,
            "optimizer": optimizer.state_dict(), "lr_scheduler": lr_scheduler.state_dict(),
            "scaler": scaler.state_dict(), "step": at_step, "epoch": data_epoch,
            "samples_into_epoch": seen_in_epoch, "batches_into_epoch": seen_in_epoch // args.batch_size,
            "world_size": info.world_size, "batch_size": args.batch_size, "rng": rng, "args": vars(args),
            "tune_choice": choice, "class_names": getattr(base, "class_names", None), "log_window": window,
        }  # fmt: skip
        save_checkpoint(checkpoint_path(out_dir, at_step), ckpt, args.keep_last)

    if tuned:  # the model alone (no DDP hooks, not compiled), with a real micro-batch, the step's settings
        from torch.utils.data import default_collate

        tune_batch = default_collate([samples[(0, i)] for i in range(micro)])

        def tune_step() -> None:
            compute_loss(tune_batch, denoiser).backward()
            denoiser.zero_grad(set_to_none=True)

        report, choice = tune_patch(denoiser.model, tune_step, info, choice, out_dir / "tune_choice.json")
        if is_main:
            print(report, flush=True)
    ddp = None
    if info.world_size > 1:
        # Every parameter gets a gradient on the fused path too (ldmopt ties the ones its shortcuts skip to the graph
        # with zero gradients), so DDP needs no find_unused_parameters.
        ids = [device.index] if device.type == "cuda" else None
        ddp = DistributedDataParallel(denoiser, device_ids=ids)
        model = ddp
    if args.compile:
        model = torch.compile(model)

    # Once every check that can still end the run has passed: checkpoints past the resumed step belong to the run this
    # one forks off, and --resume auto must not pick them up again.
    forked = state is not None and is_main and args.save_every > 0
    if forked and (aside := set_aside_newer_checkpoints(out_dir, step)) is not None:
        print(f"note: {out_dir / 'checkpoints'} held checkpoints past step {step} from the run this one forks off; "
              f"moved to {aside}", flush=True)  # fmt: skip

    # ---------------------------------------------------------------------------------------- loop
    from tqdm.auto import tqdm

    bar = tqdm(total=args.max_steps, initial=step, disable=not is_main or args.no_progress, dynamic_ncols=True)
    history: list[dict] = []
    data_iter = None
    window_start, window_images = time.perf_counter(), 0
    # The logged loss is the mean over the steps since the last log (on the device: no synchronisation per step)
    window_loss, window_steps = torch.zeros((), device=device), 0
    if state is not None and state.get("log_window") is not None:  # saved between two logs: the window goes on
        sums, window_steps = state["log_window"]
        if isinstance(sums, float):  # a checkpoint of an older script: the ranks' mean
            sums = [sums]
        # on as many ranks, each its own sum; on another number, each the mean (the window's logged mean is kept)
        window_loss.fill_(sums[info.rank] if len(sums) == info.world_size else sum(sums) / len(sums))
    start_step = step

    unprimed = args.fused

    def prime(batch: dict) -> None:
        """A patched model's first call learns which statistics each fused block hands to the norm after it
        (ldmopt/nn/stats_handover.py) and computes them once the other way, equal only to rounding. One unrecorded
        call on the run's first micro-batch, drawing none of the step's random numbers, so that an uninterrupted run
        and a resumed one both start their first step on the learned path: resume stays exact to the bit."""
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
            compute_loss(batch, denoiser)

    def run_step() -> None:
        """One optimizer step (all micro-batches), then logging, checkpointing and sampling when due."""
        nonlocal step, data_iter, data_epoch, seen_in_epoch, window_start, window_images, window_loss, window_steps
        nonlocal unprimed
        if seen_in_epoch // info.world_size + per_rank_step > len(sampler.inner):  # no full step left in this epoch
            data_epoch, seen_in_epoch, data_iter = data_epoch + 1, 0, None
        epoch = data_epoch
        if data_iter is None:
            sampler.set_epoch(epoch, skip=seen_in_epoch // info.world_size)
            data_iter = iter(loader)
        loss_sum = torch.zeros((), device=device)
        for i in range(args.grad_accum):
            batch = next(data_iter)
            if unprimed:
                prime(batch)
                unprimed = False
            last = i == args.grad_accum - 1
            with ddp.no_sync() if ddp is not None and not last else contextlib.nullcontext():
                loss = compute_loss(batch) / args.grad_accum
                scaler.scale(loss).backward()
            loss_sum += loss.detach()
        if args.max_grad_norm > 0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
        scale = scaler.get_scale() if scaler.is_enabled() else None  # fp16 only: a synchronisation
        scaler.step(optimizer)
        scaler.update()
        # A step the GradScaler skipped (inf/NaN gradients: its scale backs off) changed no weight: the schedule
        # stays where it was, as accelerate's does.
        if scale is None or scaler.get_scale() >= scale:
            lr_scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if ema is not None:
            ema.update(step)
        step += 1
        seen_in_epoch += args.batch_size
        window_images += args.batch_size
        window_loss += loss_sum
        window_steps += 1
        if step == start_step + 1 and report is not None and is_main:
            describe_first_step(report, device)
        bar.update(1)
        if step % args.log_every == 0 or step == args.max_steps:
            loss_value = mean_over_ranks(window_loss / window_steps, info)
            if not math.isfinite(loss_value):  # a non-finite loss at any step of the window is caught here
                raise FloatingPointError(f"loss is {loss_value} in the {window_steps} steps up to step {step}")
            now = time.perf_counter()
            metrics = {
                "loss": loss_value, "lr": lr_scheduler.get_last_lr()[0], "epoch": epoch,
                "images_per_s": window_images / (now - window_start),
            }  # fmt: skip
            if scaler.is_enabled():
                metrics["loss_scale"] = scaler.get_scale()
            window_start, window_images, window_loss, window_steps = now, 0, torch.zeros_like(window_loss), 0
            history.append({"step": step, **metrics})
            logger.log(step, metrics)
            bar.set_postfix(loss=f"{loss_value:.4f}", lr=f"{metrics['lr']:.2e}", ips=f"{metrics['images_per_s']:.1f}")
        if args.save_every > 0 and (step % args.save_every == 0 or step == args.max_steps):
            save(step)
        if is_main and args.sample_every > 0 and (step % args.sample_every == 0 or step == args.max_steps):
            make_samples(step)

    if args.profile_active > 0:
        # The window's steps are real training steps: skipped (wait), warm-up, then recorded (active).
        active = min(args.profile_active, args.max_steps - step - args.profile_wait - args.profile_warmup)
        if active > 0:
            shares = profile_window(
                run_step, args.profile_wait, args.profile_warmup, active, out_dir / "profile", denoiser.model, is_main
            )
            logger.log(step, shares)
        elif is_main:
            print("profiling window skipped: fewer steps left than --profile-wait + --profile-warmup + 1")
    while step < args.max_steps:
        run_step()
    bar.close()

    # ---------------------------------------------------------------------------------------- wrap up
    digests = gather_objects(parameter_digest(denoiser), info)
    patched = gather_objects(sorted(f"{r.name}:{r.rule}" for r in report.replaced) if report else [], info)
    summary = {
        "step": step, "world_size": info.world_size, "history": history, "param_digests": digests,
        "ranks_in_sync": len(set(digests)) == 1, "fused": args.fused,
        "patched_in_sync": all(p == patched[0] for p in patched),
        "patch": None if report is None else {
            "patched": report.total, "backends": report.backends(), "fallbacks": report.fallbacks(),
            "layout_copies": report.layout_copies(),
            "modules": patched[0],
            "tuning": None if report.tuning is None else {
                "kept": [s.where for s in report.tuning.kept], "sites": len(report.tuning.sites),
                "stock_ms": _finite(report.tuning.stock_ms), "tuned_ms": _finite(report.tuning.tuned_ms),
            },
        },
    }  # fmt: skip
    if is_main:
        if args.save_final:
            meta = {name: getattr(args, name) for name in sorted(RUN_DEFINING - {"num_shapes"})}
            meta.update(frames=frames, latent_factor=factor, latent_channels=in_channels, step=step,
                        class_names=getattr(base, "class_names", None))  # fmt: skip
            with ema.applied() if ema is not None else contextlib.nullcontext():
                save_final(denoiser, out_dir / "final", meta)
            noise_scheduler.save_config(out_dir / "final")
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        if not summary["ranks_in_sync"]:
            print(f"warning: ranks ended with different parameters: {digests}", file=sys.stderr)
    logger.close()
    return summary


if __name__ == "__main__":
    main()
