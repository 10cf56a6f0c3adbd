"""Ahead-of-time compile specs of the implicit-GEMM convolution (kernels/gn_conv2d.py): each autotune tile of both
families (loader prologue and plain) with the epilogues that weigh most on registers, as Triton specialises them at
run time for Stable Diffusion shapes."""

from __future__ import annotations

from ._common import ACTIVATIONS, fp32_archs
from .gn_conv2d import (
    CONV_TILES_FP32,
    CONV_TILES_LOADER,
    CONV_TILES_LOADER_DOWN,
    CONV_TILES_PLAIN,
    RESAMPLE,
    _gn_conv2d_fwd_kernel,
)

_FP32_PTRS = ("out_mean_ptr", "out_rstd_ptr", "mean_ptr", "rstd_ptr", "gate_ptr")


def _signature(fn, constexprs: dict, dtype: str) -> dict:
    """Triton types of a conv kernel's arguments: the statistics workspace fp64, its counters int32, the statistics
    and the gate fp32, other pointers ``dtype``, eps and scale fp32, other scalars int32."""
    sig = {}
    for arg in fn.arg_names:
        if arg in constexprs:
            sig[arg] = "constexpr"
        elif arg == "ws_ptr":
            sig[arg] = "*fp64"
        elif arg == "counter_ptr":
            sig[arg] = "*i32"
        elif arg.endswith("_ptr"):
            sig[arg] = "*fp32" if arg in _FP32_PTRS else f"*{dtype}"
        else:
            sig[arg] = "fp32" if arg in ("out_eps", "inv_scale") else "i32"
    return sig


def _aot_spec(
    name,
    dtype,
    cfg,
    *,
    kh=3,
    kw=None,
    stride=1,
    resample="none",
    normalize=True,
    temb=False,
    res=False,
    res_resample="none",
    sc=False,
    sc_resample="none",
    out_stats=False,
    row_stats=False,
    temb_rows=False,
    gate=False,
    x_two_part=False,
    sc_two_part=False,
    dot_precision="tf32",
) -> dict:
    bm, bn, bk, warps, stages = cfg
    kw = kh if kw is None else kw
    # Channels-last activations and weights (model.to(memory_format=torch.channels_last)): unit channel strides.
    constexprs = {"sxc": 1, "sx2c": 1, "swi": 1, "syc": 1, "src": 1, "ssc": 1, "ss2c": 1, "swsi": 1}
    constexprs.update(
        KH=kh, KW=kw, STRIDE=stride, PAD_H=kh // 2, PAD_W=kw // 2, RESAMPLE=RESAMPLE[resample], NORMALIZE=normalize,
        ACTIVATION=ACTIVATIONS["silu"][0], HAS_GAMMA=True, HAS_BETA=True, HAS_BIAS=True, HAS_TEMB=temb,
        TEMB_ROWS=temb_rows, HAS_GATE=gate, HAS_RES=res, RES_RESAMPLE=RESAMPLE[res_resample], HAS_SC=sc,
        SC_RESAMPLE=RESAMPLE[sc_resample], HAS_BIAS2=sc,
        OUT_STATS=out_stats, STATS_BLOCK_G=16, STATS_BLOCK_CPG=64, OUT_ROW_STATS=row_stats,
        DOT_PRECISION=dot_precision, IDX64=False,
        X_TWO_PART=x_two_part, SC_TWO_PART=sc_two_part, BM=bm, BN=bn, BK=bk,
    )  # fmt: skip
    fn = _gn_conv2d_fwd_kernel.fn
    sig = _signature(fn, constexprs, dtype)
    # What Triton's launcher specialises at run time for SD shapes: 16-byte aligned pointers, ints that are multiples
    # of 16 (channels, strides, 64x64 / 32x32 spatial sizes); the autotune keys are not.
    div16 = [k for k, v in sig.items() if v != "constexpr" and k not in ("out_eps", "inv_scale") and "KEY" not in k]
    attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k in div16}
    return dict(name=name, fn=fn, signature=sig, constexprs=constexprs, attrs=attrs, num_warps=warps, num_stages=stages)


def conv_aot_specs() -> list[dict]:
    """Compile configurations for the ahead-of-time gate: the resnet-block convs at the tiles autotuning picks from.

    Each spec carries ``attrs`` (the divisibility Triton specialises at run time); a gate that ignores them compiles
    the unspecialised, unpipelined variant instead.
    """
    # Every autotune tile appears at least once (loader, down-sampling loader and plain families). 128x256x32 was
    # dropped from the configs: with the temb + statistics epilogue it spilled 32-64 bytes per thread on sm_80 and
    # sm_90.
    big, narrow, tall, small = CONV_TILES_LOADER
    plain_big, plain_narrow, plain_tall, plain_small = CONV_TILES_PLAIN
    return [
        _aot_spec("gn_conv2d[fp16,3x3,conv1:temb+stats]", "fp16", big, temb=True, out_stats=True),
        _aot_spec("gn_conv2d[fp16,3x3,conv2:shortcut+stats]", "fp16", big, sc=True, out_stats=True),
        _aot_spec("gn_conv2d[bf16,3x3,conv1:temb+stats]", "bf16", big, temb=True, out_stats=True),
        _aot_spec("gn_conv2d[fp16,3x3,conv1:temb+stats,64x64x64]", "fp16", small, temb=True, out_stats=True),
        _aot_spec("gn_conv2d[fp16,3x3,conv2:residual]", "fp16", narrow, res=True),
        # UNet up blocks: conv1 reads cat([hidden, skip]) in two parts, conv2's shortcut likewise
        _aot_spec(
            "gn_conv2d[fp16,3x3,conv1:skip parts+temb+stats]", "fp16", big, temb=True, out_stats=True, x_two_part=True
        ),
        _aot_spec(
            "gn_conv2d[fp16,3x3,conv2:shortcut parts+stats]", "fp16", big, sc=True, out_stats=True, sc_two_part=True
        ),
        _aot_spec(
            "gn_conv2d[bf16,3x3,conv1:skip parts,64x64x64]", "bf16", small, temb=True, out_stats=True, x_two_part=True
        ),
        _aot_spec("gn_conv2d[fp16,3x3,up]", "fp16", narrow, resample="up", temb=True, out_stats=True),
        # A downsampling resnet (ResnetDownsampleBlock2D): conv1 averages 2x2 normalised taps in its loads (its own
        # tiles), conv2 adds the averaged input through the 1x1 shortcut, or as the identity residual
        *[
            _aot_spec(
                f"gn_conv2d[fp16,3x3,down conv1:temb+stats,{bm}x{bn}x{bk}w{w}]",
                "fp16",
                (bm, bn, bk, w, s),
                resample="down",
                temb=True,
                out_stats=True,
            )
            for bm, bn, bk, w, s in CONV_TILES_LOADER_DOWN
        ],
        _aot_spec(
            "gn_conv2d[fp16,3x3,conv2:down shortcut+stats]", "fp16", narrow, sc=True, sc_resample="down", out_stats=True
        ),
        _aot_spec(
            "gn_conv2d[fp16,3x3,conv2:down residual+stats]", "fp16", tall, res=True, res_resample="down", out_stats=True
        ),
        _aot_spec("gn_conv2d[fp16,3x3,stride2,plain]", "fp16", plain_big, stride=2, normalize=False),
        # Upsample2D: nearest 2x in the loads of a plain conv (the VAE decoder's upsamplers)
        _aot_spec("gn_conv2d[fp16,3x3,upsampler]", "fp16", plain_big, resample="up", normalize=False),
        _aot_spec("gn_conv2d[bf16,3x3,upsampler,128x64x64]", "bf16", plain_narrow, resample="up", normalize=False),
        # GroupNorm + SiLU staged before the conv (ldmopt/ops/gn_conv2d_prologue.py): the resnet convs as plain convs
        _aot_spec(
            "gn_conv2d[fp16,3x3,staged conv1:temb+stats]", "fp16", plain_big, temb=True, out_stats=True, normalize=False
        ),
        _aot_spec(
            "gn_conv2d[bf16,3x3,staged conv1:temb+stats]", "bf16", plain_big, temb=True, out_stats=True, normalize=False
        ),
        _aot_spec(
            "gn_conv2d[fp16,3x3,staged conv1:temb+stats,64x64x64]",
            "fp16",
            plain_small,
            temb=True,
            out_stats=True,
            normalize=False,
        ),
        _aot_spec(
            "gn_conv2d[fp16,3x3,staged conv2:shortcut parts+stats,64x128x64]",
            "fp16",
            plain_tall,
            sc=True,
            out_stats=True,
            sc_two_part=True,
            normalize=False,
        ),
        _aot_spec(
            "gn_conv2d[fp16,3x3,staged conv2:residual,128x64x64]", "fp16", plain_narrow, res=True, normalize=False
        ),
        _aot_spec(
            "gn_conv2d[fp16,3x1,staged temporal conv2:residual+gate]",
            "fp16",
            plain_big,
            kw=1,
            res=True,
            gate=True,
            normalize=False,
        ),
        _aot_spec("gn_conv2d[fp16,1x1,gn]", "fp16", big, kh=1),
        # A transformer's proj_in handing its first block's norm1 the LayerNorm statistics of its pixels: GroupNorm in
        # the loader, or staged before the plain conv (what GPUs pick for C_out >= 384)
        _aot_spec("gn_conv2d[fp16,1x1,proj_in:gn+row stats]", "fp16", big, kh=1, row_stats=True),
        _aot_spec("gn_conv2d[bf16,1x1,proj_in:gn+row stats,64x64x64]", "bf16", small, kh=1, row_stats=True),
        _aot_spec(
            "gn_conv2d[fp16,1x1,staged proj_in:row stats]", "fp16", plain_big, kh=1, normalize=False, row_stats=True
        ),
        # A transformer's proj_out + residual as a plain 1x1 conv summing its output's statistics (and channel sums)
        # for the GroupNorm after it (ldmopt/nn/proj_out.py); an upsampler's likewise
        _aot_spec(
            "gn_conv2d[fp16,1x1,proj_out:residual+stats]",
            "fp16",
            plain_big,
            kh=1,
            normalize=False,
            res=True,
            out_stats=True,
        ),
        _aot_spec(
            "gn_conv2d[bf16,1x1,proj_out:residual+stats,64x128x64]",
            "bf16",
            plain_tall,
            kh=1,
            normalize=False,
            res=True,
            out_stats=True,
        ),
        _aot_spec(
            "gn_conv2d[fp16,3x3,upsampler+stats]", "fp16", plain_big, resample="up", normalize=False, out_stats=True
        ),
        # fp32 operands: each fp32 tile, its heaviest epilogues, at each (precision, arch) it is claimed clean for
        *[
            {
                **_aot_spec(
                    f"gn_conv2d[fp32 {precision},3x3,{label},{bm}x{bn}x{bk}w{w}]",
                    "fp32",
                    (bm, bn, bk, w, s),
                    dot_precision=precision,
                    **extra,
                ),
                "archs": fp32_archs(clean, precision),
            }
            for bm, bn, bk, w, s, clean in CONV_TILES_FP32
            for precision in ("ieee", "tf32")
            for label, extra in (
                ("conv2:shortcut parts+stats", dict(sc=True, out_stats=True, x_two_part=True, sc_two_part=True)),
                ("up+temb+stats", dict(resample="up", temb=True, out_stats=True)),
            )
        ],
        # SVD's temporal resnet (3x1 over frames): per-frame temb + statistics, then residual + per-frame blend gate
        _aot_spec("gn_conv2d[fp16,3x1,temporal conv1]", "fp16", big, kw=1, temb=True, temb_rows=True, out_stats=True),
        _aot_spec("gn_conv2d[fp16,3x1,temporal conv2]", "fp16", big, kw=1, res=True, gate=True),
        _aot_spec("gn_conv2d[bf16,3x1,temporal conv2,64x128]", "bf16", tall, kw=1, res=True, gate=True),
    ]


def _epilogue_spec(name, dtype, c, *, temb=False, temb_rows=False, gate=False, sc=False, res=False, out_stats=False,
                   row_stats=False, write=True) -> dict:  # fmt: skip
    from .conv_epilogue import _conv_epilogue_kernel, _tile

    bm, bn, warps = _tile(c)
    constexprs = {"syc": 1, "szc": 1, "sscc": 1, "src": 1}  # channels-last: unit channel strides
    constexprs.update(
        HAS_TEMB=temb, TEMB_ROWS=temb_rows, HAS_GATE=gate, HAS_SC=sc, HAS_RES=res, RES_RESAMPLE=0, WRITE=write,
        OUT_STATS=out_stats, STATS_BLOCK_G=16, STATS_BLOCK_CPG=64, OUT_ROW_STATS=row_stats, IDX64=False, BM=bm, BN=bn,
    )  # fmt: skip
    fn = _conv_epilogue_kernel  # a plain @triton.jit function (no autotuner around it)
    sig = _signature(fn, constexprs, dtype)
    div16 = [k for k, v in sig.items() if v != "constexpr" and k not in ("out_eps", "inv_scale")]
    attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k in div16}
    return dict(name=name, fn=fn, signature=sig, constexprs=constexprs, attrs=attrs, num_warps=warps, num_stages=1)


def conv_epilogue_aot_specs() -> list[dict]:
    """The epilogue after a cuDNN conv (kernels/conv_epilogue.py) at SD channel counts: what the resnet convs, a
    temporal conv and a projection hand it."""
    return [
        _epilogue_spec("conv_epilogue[fp16,conv1:temb+stats,C=320]", "fp16", 320, temb=True, out_stats=True),
        _epilogue_spec("conv_epilogue[bf16,conv1:temb+stats,C=1280]", "bf16", 1280, temb=True, out_stats=True),
        _epilogue_spec(
            "conv_epilogue[fp16,conv2:shortcut+residual+sums,C=640]", "fp16", 640, sc=True, res=True, out_stats=True
        ),
        _epilogue_spec(
            "conv_epilogue[fp16,temporal conv2:temb rows+gate+residual,C=320]",
            "fp16",
            320,
            temb=True,
            temb_rows=True,
            gate=True,
            res=True,
        ),
        _epilogue_spec("conv_epilogue[fp16,sums only,C=320]", "fp16", 320, out_stats=True, write=False),
        _epilogue_spec("conv_epilogue[fp16,proj_in:row stats,C=640]", "fp16", 640, row_stats=True, write=False),
        _epilogue_spec("conv_epilogue[fp32,conv1:temb+stats,C=320]", "fp32", 320, temb=True, out_stats=True),
        _epilogue_spec("conv_epilogue[fp32,proj_in:row stats,C=640]", "fp32", 640, row_stats=True, write=False),
    ]
