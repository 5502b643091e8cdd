"""`dit-plan`: plan GPU memory for DiT training and write the Accelerate config, plan.json and plan.md.

    dit-plan --gpus 8 --vram 40G --global-batch 256
    dit-plan --gpu a100-40g,a100-80g,h100-80g --gpus 8,16 --global-batch 256     # a sweep: one row each
    dit-plan --config configs/clusters/h100-80g-2x8-ib.yaml --global-batch 512   # a preset, a flag overrides it

--gpus is the total: more than a node holds (8) is split into nodes of 8; with --nodes K it is split into K
equal nodes (--gpus 8 --nodes 2 is 2 x 4); --gpus-per-node G --nodes K gives the shape directly.

Bad input prints one line naming the flag and the fix and exits 2, without a traceback or any file.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import shlex
import sys

from planner.calibration import load_calibration
from planner.clusterfile import SHAPE_KEYS, preset_rows, read_cluster_file
from planner.errors import PlanError, with_flag_suggestions
from planner.hardware import Assumptions, assumption_names, assumption_types, gpu_presets
from planner.host import DATA_SOURCES
from planner.outputs import (
    MEMORY_CHART,
    check_file_path,
    check_out_dir,
    package_version,
    write_file_atomically,
    write_plan_dir,
)
from planner.plan import EVAL_DEFAULTS, make_plan
from planner.report import FORMATS, render, render_sweep
from planner.report.tables import sweep_row
from planner.rules import OBJECTIVES
from planner.units import UNIT_RULE, format_bytes, parse_bytes

PROG = "dit-plan"
SWEEPABLE = ("gpus", "vram", "gpu", "global_batch", "model", "resolution")
NODE_SIZE = 8  # GPUs one node holds, unless a preset's gpus_per_node says otherwise


class _Parser(argparse.ArgumentParser):
    """argparse, but its errors become one PlanError line (no usage block)."""

    def error(self, message):
        message = with_flag_suggestions(message, self._option_string_actions)
        raise PlanError(f"{message} (see dit-plan --help)")


def build_parser() -> argparse.ArgumentParser:
    """dit-plan's flags. Every help line says what happens when the flag is not given."""
    p = _Parser(
        prog=PROG,
        description=__doc__.split("\n\n")[0],
        epilog=f"Sizes: {UNIT_RULE}. Comma-separated --gpus/--vram/--gpu/--global-batch/--model/--resolution "
        "make a sweep: one table row per combination, no files written.",
    )
    p.add_argument("--version", action="store_true", help="print dit-accel's version and exit")
    p.add_argument(
        "--config",
        metavar="NAME|FILE",
        help="a cluster preset: a shipped name such as h100-80g-8x (--list-configs), or a YAML file of "
        "flag: value lines; flags given here override it (default: none)",
    )
    p.add_argument("--list-configs", action="store_true", help="print the shipped cluster presets and exit")
    hw = p.add_argument_group("cluster")
    hw.add_argument(
        "--gpus",
        metavar="N",
        help="total GPUs (comma list sweeps): more than one node holds (8) is split into nodes of 8, with "
        "--nodes K into K equal nodes (required, unless --gpus-per-node gives the shape)",
    )
    hw.add_argument(
        "--gpus-per-node",
        metavar="G",
        help="GPUs in each node, with --nodes (e.g. --gpus-per-node 4 --nodes 2) (default: from --gpus)",
    )
    hw.add_argument("--nodes", metavar="K", help="nodes (default: 1, or --gpus split into nodes of 8)")
    hw.add_argument(
        "--vram",
        metavar="SIZE",
        help="memory per GPU with a unit: 40GB, 40GiB, 80000MiB (comma list sweeps) (default: the --gpu "
        "preset's; one of the two is required)",
    )
    hw.add_argument(
        "--gpu",
        metavar="NAME",
        help="GPU preset (comma list sweeps): its memory, bf16 support and peak rates; --list-gpus names "
        "them all (default: none, plan by --vram with A100-class rates)",
    )
    hw.add_argument(
        "--list-gpus", action="store_true", help="print every GPU preset with its memory and exit"
    )
    hw.add_argument(
        "--host-ram",
        metavar="SIZE",
        help="host RAM per node (e.g. 512GiB): warn before the OOM killer's exitcode -9 (default: not checked)",
    )
    hw.add_argument(
        "--main-process-ip",
        metavar="ADDRESS",
        help="multi-node: address of the first node (default: launch.slurm takes the allocation's first)",
    )
    hw.add_argument(
        "--main-process-port", metavar="PORT", help="multi-node: rendezvous port (default: 29500)"
    )
    tr = p.add_argument_group("training")
    tr.add_argument(
        "--global-batch",
        default="256",
        metavar="B",
        help="images per optimizer step (comma list sweeps) (default: %(default)s, the DiT recipe)",
    )
    tr.add_argument(
        "--round-global-batch",
        action="store_true",
        help="use the nearest global batch the GPUs divide (default: refuse one they do not divide)",
    )
    tr.add_argument(
        "--model",
        default="DiT-XL/2",
        help="DiT-{S,B,L,XL}/{2,4,8}, or LightningDiT-{B,L,XL}/{1,2} on VA-VAE latents (comma list sweeps) "
        "(default: %(default)s)",
    )
    tr.add_argument(
        "--resolution",
        default="256",
        metavar="PX",
        help="image side in pixels, a multiple of the tokenizer's downsampling x patch (8 x patch for DiT's SD VAE, "
        "16 x patch for LightningDiT's VA-VAE) (comma list sweeps) (default: %(default)s)",
    )
    tr.add_argument(
        "--precision",
        default="auto",
        choices=["auto", "bf16", "fp16", "tf32", "fp32"],
        help="auto: bf16 where the GPU has it, else fp16 with loss scaling; tf32: fp32 weights, TF32 "
        "matmuls (the trainer's default for fp32); fp32: IEEE fp32 (--no-tf32) (default: %(default)s)",
    )
    tr.add_argument(
        "--latents",
        default="precomputed",
        choices=["precomputed", "online", "pixel"],
        help="precomputed: a latent cache (dit-accel extract-latents), no VAE during training; online: "
        "images encoded by the VAE every step (its weights, working set and compute count); pixel: a "
        "DiT on the pixels themselves, no VAE (default: %(default)s)",
    )
    tr.add_argument(
        "--ema",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep an fp32 EMA copy of the weights (default: on)",
    )
    tr.add_argument(
        "--adamw",
        default="fused",
        choices=["fused", "foreach"],
        help="AdamW implementation: fused (no temporary) or foreach (+4 B/param at the step) "
        "(default: %(default)s)",
    )
    tr.add_argument(
        "--gradient-as-bucket-view",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="DDP gradients live in its all-reduce buckets; off costs 4 B/param (default: on)",
    )
    tr.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="torch.compile each transformer block on the GPUs; the trainer follows it (default: on)",
    )
    tr.add_argument(
        "--objective",
        choices=tuple(OBJECTIVES),
        default=None,
        help="the training objective, recorded in plan.json for the trainer to follow: ddpm (DiT's) or flow "
        "(SiT's, REPA's and LightningDiT's flow matching; the same network, memory and FLOPs) (default: the "
        "model's: ddpm for DiT, flow for LightningDiT)",
    )
    tr.add_argument(
        "--repa",
        default="",
        metavar="ENCODER",
        help="REPA: align an early block to this frozen encoder, one of dinov2-s, dinov2-b (REPA's), dinov2-l, "
        "dinov2-g, each also '-reg' (4 registers); counts its weights, forward and the projector "
        "(default: no REPA)",
    )
    tr.add_argument(
        "--repa-projector-dim",
        default=2048,
        type=int,
        metavar="N",
        help="REPA projector's width (default: %(default)s, the paper's)",
    )
    tr.add_argument(
        "--data-source",
        choices=tuple(DATA_SOURCES),
        default="folder",
        help="where an online or pixel run reads its images (the trainer's --data-path): an image folder, or a "
        "Hugging Face dataset (save_to_disk, parquet), for the host-RAM estimate (default: %(default)s)",
    )
    tt = p.add_argument_group("time to train")
    tt.add_argument(
        "--steps",
        metavar="N",
        help="optimizer steps of the run: prints wall-clock time and GPU-hours (default: not shown)",
    )
    tt.add_argument(
        "--epochs",
        metavar="E",
        help="passes over the data, with --dataset-size: steps = ceil(E x S / B) (default: not shown)",
    )
    tt.add_argument(
        "--dataset-size", metavar="S", help="images in the training set, with --epochs (default: none)"
    )
    tt.add_argument(
        "--gpu-hour-cost",
        metavar="USD",
        help="price of one GPU-hour for the run's cost, with --steps or --epochs (default: not shown)",
    )
    tt.add_argument(
        "--recipe",
        nargs="?",
        const="auto",
        metavar="NAME",
        help="add what these hours buy: the recipe's published FID-50K milestones (DiT, SiT, REPA, LightningDiT, "
        "or a shipped recipe's name; alone: the one the plan's flags imply) at this plan's steps, hours and "
        "cost (default: not shown)",
    )
    tt.add_argument(
        "--target-fid",
        metavar="FID",
        help="the cheapest published milestone this network reached at or under FID (guided unless "
        "--target-guidance unguided), in this plan's hours; a sweep ranks by it (default: none)",
    )
    tt.add_argument(
        "--target-guidance",
        choices=["guided", "unguided"],
        default="guided",
        help="which published FID --target-fid is held to (default: %(default)s)",
    )
    tt.add_argument(
        "--eval-every",
        metavar="N",
        help="the trainer's --eval-every: add the sampling time of an FID evaluation every N steps to the time "
        "to train, with --steps (default: none)",
    )
    tt.add_argument(
        "--eval-samples",
        metavar="M",
        default=EVAL_DEFAULTS["samples"],
        help="images each evaluation samples (default: %(default)s, the trainer's)",
    )
    tt.add_argument(
        "--eval-steps",
        metavar="S",
        default=EVAL_DEFAULTS["steps"],
        help="sampling steps of an evaluation: DDPM's, or a flow model's Heun steps, 2 model calls each "
        "(default: %(default)s, the trainer's)",
    )
    tt.add_argument(
        "--eval-cfg-scale",
        metavar="SCALE",
        default=EVAL_DEFAULTS["cfg_scale"],
        help="guidance of the evaluation's samples; other than 1, every call is two forwards (default: "
        "%(default)s, the trainer's: none)",
    )
    ch = p.add_argument_group("the choice")
    ch.add_argument(
        "--sharding",
        default="auto",
        choices=["auto", "ddp", "zero2", "zero3", "hsdp"],
        help="ddp: every GPU holds all the weights, gradients and AdamW state; zero2: FSDP2 shards the "
        "gradients, AdamW state and fp32 weights (parameters gathered once per step); zero3: FSDP2 shards "
        "the parameters too (gathered per block, in forward and again in backward); hsdp: zero3 inside "
        "each node, replicated across nodes; auto: the search chooses it with the micro-batch and the "
        "checkpointing (default: %(default)s)",
    )
    ch.add_argument(
        "--checkpointing",
        default="auto",
        metavar="auto|none|all|N",
        help="activation checkpointing: none, all blocks, N blocks, or auto, as many as the search needs "
        "to fit (default: %(default)s)",
    )
    ch.add_argument(
        "--headroom",
        default="5%",
        metavar="SHARE|SIZE",
        help="VRAM kept free: a share (5%%) or a size (2GiB) (default: %(default)s)",
    )
    ch.add_argument(
        "--max-micro-batch",
        metavar="N",
        help="largest micro-batch to consider (default: no limit but the global batch)",
    )
    cu = p.add_argument_group("custom model sizes (research variants, tiny test networks)")
    for flag in ("depth", "hidden", "heads", "patch", "num-classes"):
        cu.add_argument(
            f"--{flag}",
            metavar="N",
            help=f"override the --model's {flag.replace('-', ' ')} (default: the model's own)",
        )
    cu.add_argument(
        "--qk-norm",
        action="store_true",
        help="LightningDiT: RMSNorm of q and k per head (their suggested fix for NaNs late in long runs; "
        "default off, as released)",
    )
    out = p.add_argument_group("output")
    out.add_argument(
        "--out",
        metavar="DIR",
        help="directory for accelerate_config.yaml, plan.json, plan.md and memory.png (default: ./plan with "
        "--format table; the document formats write files only when --out is given)",
    )
    out.add_argument(
        "--format",
        default="table",
        choices=FORMATS,
        help="table: for the terminal; markdown, github, latex (a whole document) and json print only the "
        "document on stdout (default: %(default)s)",
    )
    out.add_argument(
        "--wide",
        action="store_true",
        help="print every table column unwrapped (default: fit 100 columns)",
    )
    out.add_argument(
        "--no-chart", action="store_true", help="skip plan/memory.png (default: draw it with the plan)"
    )
    out.add_argument(
        "--plot",
        metavar="FILE",
        help="also draw peak memory and est. img/s (.png/.svg/.pdf): across a sweep, or against micro-batch "
        "(default: none)",
    )
    out.add_argument(
        "--assume",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="override an assumed constant (repeatable); --list-assumptions shows them (default: none)",
    )
    out.add_argument("--list-assumptions", action="store_true", help="print the assumed constants and exit")
    out.add_argument(
        "--calibration",
        metavar="FILE",
        help="use the figures `dit-accel calibrate` measured on the GPU (context, fragmentation, MFU) "
        "in place of the assumed ones (default: none, every figure assumed)",
    )
    return p


def _int(text: str, flag: str) -> int:
    try:
        value = int(str(text).strip())
    except ValueError:
        raise PlanError(f"{flag} {text!r} is not a whole number: e.g. {flag} 8") from None
    if value <= 0:
        raise PlanError(f"{flag} must be positive, got {value}")
    return value


def _list(text: str | None) -> list[str | None]:
    if text is None:
        return [None]
    items = [item.strip() for item in str(text).split(",")]
    if any(not item for item in items):
        raise PlanError(f"empty item in {text!r}: separate values with single commas, e.g. 8,16")
    return items


def parse_assumptions(pairs: list[str]) -> dict:
    """--assume NAME=VALUE pairs, typed like the Assumptions field; byte fields take sizes (1GiB)."""
    types, out = assumption_types(), {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        name = name.strip()
        if not sep or name not in types:
            raise PlanError(
                f"--assume {pair!r}: write NAME=VALUE with NAME one of {', '.join(assumption_names())}"
            )
        kind = types[name]
        try:
            if kind is int and name.endswith("_bytes"):
                out[name] = int(value) if value.strip().isdigit() else parse_bytes(value, f"--assume {name}")
            elif kind is int:
                out[name] = int(value)
            elif kind is float:
                out[name] = float(value)
            else:
                out[name] = value.strip()
        except ValueError:
            raise PlanError(f"--assume {name}={value!r} is not a {kind.__name__}") from None
    Assumptions().replace(**out)  # validate now, once
    return out


def split_into_nodes(total: int, per_node: int | None, nodes: int | None, node_size: int) -> tuple[int, int]:
    """(nodes, GPUs per node) of --gpus TOTAL with the optional --gpus-per-node and --nodes."""
    if per_node is not None and nodes is not None:
        if per_node * nodes != total:
            raise PlanError(
                f"--gpus {total} contradicts --nodes {nodes} x --gpus-per-node {per_node} = {nodes * per_node}",
                "give --gpus alone, or --gpus-per-node with --nodes",
            )
        return nodes, per_node
    if per_node is not None:
        if total % per_node:
            raise PlanError(
                f"--gpus {total} is not a whole number of nodes of --gpus-per-node {per_node}",
                f"give a multiple of {per_node}, or --nodes",
            )
        return total // per_node, per_node
    if nodes is not None:  # Accelerate's num_processes is the total too: --gpus 8 --nodes 2 is 2 x 4
        if total % nodes:
            raise PlanError(
                f"--gpus {total} (the total) does not divide into --nodes {nodes} equal nodes",
                f"give a multiple of {nodes}, e.g. --gpus {nodes * node_size} for {nodes} x {node_size}",
            )
        return nodes, total // nodes
    if total <= node_size:
        return 1, total
    if total % node_size:
        raise PlanError(
            f"--gpus {total} is more than one node of {node_size} holds and does not split into nodes of {node_size}",
            f"give a multiple of {node_size}, or --gpus-per-node G --nodes K",
        )
    return total // node_size, node_size


def cluster_shapes(args, node_size: int = NODE_SIZE) -> list[tuple[int, int]]:
    """(nodes, GPUs per node) for each --gpus value (one without --gpus)."""
    per_node = _int(args.gpus_per_node, "--gpus-per-node") if args.gpus_per_node is not None else None
    nodes = _int(args.nodes, "--nodes") if args.nodes is not None else None
    if args.gpus is None:
        if per_node is None:
            raise PlanError(
                "give --gpus N, the total number of GPUs (e.g. --gpus 8)",
                "or --gpus-per-node G --nodes K" if nodes is not None else None,
            )
        return [(nodes or 1, per_node)]
    totals = [_int(v, "--gpus") for v in _list(args.gpus)]
    return [split_into_nodes(total, per_node, nodes, node_size) for total in totals]


def combinations(args, node_size: int = NODE_SIZE) -> list[dict]:
    """Every combination of the sweepable flags, as make_plan keyword arguments (`gpus` per node)."""
    shapes = cluster_shapes(args, node_size)
    if args.vram is None and args.gpu is None:
        raise PlanError("give the GPU memory: --vram 40GB (or 40GiB), or a preset with --gpu a100-40g")
    if args.vram is not None and args.gpu is not None and ("," in args.vram or "," in args.gpu):
        raise PlanError("sweep either --vram or --gpu, not both: with --gpu the memory is the preset's")
    grid = {
        "shape": shapes,
        "vram": _list(args.vram),
        "gpu": _list(args.gpu),
        "global_batch": [_int(v, "--global-batch") for v in _list(args.global_batch)],
        "model": _list(args.model),
        "resolution": [_int(v, "--resolution") for v in _list(args.resolution)],
    }
    for vram in grid["vram"]:  # fail on a bad size before planning anything
        if vram is not None:
            parse_bytes(vram, "--vram")
    combos = []
    for values in itertools.product(*grid.values()):
        combo = dict(zip(grid, values))
        combo["nodes"], combo["gpus"] = combo.pop("shape")
        combos.append(combo)
    return combos


def common_kwargs(args) -> dict:
    checkpointing = args.checkpointing.strip().lower()
    if checkpointing not in ("auto", "none", "all"):
        try:
            checkpointing = int(checkpointing)
        except ValueError:
            raise PlanError(
                f"--checkpointing must be auto, none, all or a number of blocks, got {args.checkpointing!r}"
            ) from None
        if checkpointing < 0:
            raise PlanError(f"--checkpointing {checkpointing}: a block count is 0 or more")
    custom = {
        name: _int(getattr(args, name), f"--{name.replace('_', '-')}")
        for name in ("depth", "hidden", "heads", "patch", "num_classes")
        if getattr(args, name) is not None
    }
    return dict(
        precision=args.precision,
        latents=args.latents,
        ema=args.ema,
        sharding=args.sharding,
        checkpointing=checkpointing,
        headroom=args.headroom,
        max_micro_batch=_int(args.max_micro_batch, "--max-micro-batch") if args.max_micro_batch else None,
        host_ram=args.host_ram,
        round_global_batch=args.round_global_batch,
        adamw=args.adamw,
        gradient_as_bucket_view=args.gradient_as_bucket_view,
        compile=args.compile,
        main_process_ip=args.main_process_ip,
        main_process_port=_int(args.main_process_port, "--main-process-port")
        if args.main_process_port
        else None,
        assumptions=parse_assumptions(args.assume) or None,
        calibration=args.calibration,
        steps=args.steps,
        epochs=args.epochs,
        dataset_size=args.dataset_size,
        gpu_hour_cost=args.gpu_hour_cost,
        repa=args.repa,
        repa_projector_dim=args.repa_projector_dim,
        objective=args.objective,
        data_source=args.data_source,
        eval_every=args.eval_every,
        eval_samples=args.eval_samples,
        eval_steps=args.eval_steps,
        eval_cfg_scale=args.eval_cfg_scale,
        model_options={"qk_norm": True} if args.qk_norm else None,
        recipe=args.recipe,
        target_fid=args.target_fid,
        target_guidance=args.target_guidance,
        **custom,
    )


def _listing(headers: list[str], rows: list[list], fmt: str) -> str:
    """A --list-* table in the --format asked for (json: one object per row)."""
    from tabulate import tabulate

    from planner.report.tables import TABLEFMT

    if fmt == "json":
        import json

        return json.dumps([dict(zip(headers, row)) for row in rows], indent=2) + "\n"
    return tabulate(rows, headers=headers, tablefmt=TABLEFMT[fmt], disable_numparse=True) + "\n"


def list_assumptions(fmt: str) -> str:
    rows = [[f.name, getattr(Assumptions(), f.name)] for f in dataclasses.fields(Assumptions)]
    if fmt == "json":
        import json

        return json.dumps(dict(rows), indent=2) + "\n"
    return _listing(["assumption", "default"], rows, fmt)


def list_gpus(fmt: str) -> str:
    """Every --gpu preset with its memory (as nvidia-smi counts it, and in GB), bf16 and what it is."""
    rows = [
        [
            name,
            format_bytes(gpu.memory_bytes, "GiB"),
            format_bytes(gpu.memory_bytes, "GB"),
            "yes" if gpu.bf16 else "no",
            gpu.description,
        ]
        for name, gpu in gpu_presets().items()
    ]
    return _listing(["--gpu", "memory", "(GB)", "bf16", "what"], rows, fmt)


def list_configs(fmt: str) -> str:
    """The shipped cluster presets: `--config NAME` plans one."""
    return _listing(["--config", "cluster", "gpu", "batch @ res", "what"], preset_rows(), fmt)


def parse(argv: list[str]) -> tuple[argparse.Namespace, int]:
    """The flags, with a --config preset's values under the command line's, and the GPUs one node holds."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.config is None:
        return args, NODE_SIZE
    actions = {action.dest: action for action in parser._actions}
    flags, shape, _ = read_cluster_file(args.config, actions)
    try:
        alone = parser.parse_args(flags)  # the file's values alone, so that an error names the file
        common_kwargs(alone)
        for size in _list(alone.vram) if alone.vram is not None else []:
            parse_bytes(size, "--vram")
        node_size = _int(shape["gpus_per_node"], "gpus_per_node") if "gpus_per_node" in shape else NODE_SIZE
        if "gpus" in shape or "gpus_per_node" in shape:
            cluster_shapes(argparse.Namespace(**{k: shape.get(k) for k in SHAPE_KEYS}), node_size)
    except PlanError as error:
        raise PlanError(f"--config {args.config}: {error}") from None
    args = parser.parse_args(flags + argv)
    if all(getattr(args, key) is None for key in SHAPE_KEYS):  # the command line's shape replaces the file's
        for key, value in shape.items():
            setattr(args, key, value)
    return args, node_size


def plan_arguments(argv: list[str]) -> tuple[argparse.Namespace, list[dict], dict]:
    """(the flags, make_plan's keywords of each combination, the keywords they share) of a command line."""
    args, node_size = parse(argv)
    return args, combinations(args, node_size), common_kwargs(args)


def command_line(argv: list[str]) -> str:
    return shlex.join([PROG, *argv])


def run(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args, node_size = parse(argv)
    if args.version:
        print(f"{PROG} (dit-accel) {package_version()}")
        return 0
    if args.list_assumptions:
        sys.stdout.write(list_assumptions(args.format))
        return 0
    if args.list_gpus or args.list_configs:
        sys.stdout.write(list_gpus(args.format) if args.list_gpus else list_configs(args.format))
        return 0
    combos, kwargs = combinations(args, node_size), common_kwargs(args)
    if args.plot is not None:
        from planner.plot import chart_format

        plot_format = chart_format(args.plot)
        check_file_path(args.plot)
    if args.calibration is not None:
        load_calibration(args.calibration)  # a bad file is one error, not one per sweep row
    status = (
        sys.stdout if args.format == "table" else sys.stderr
    )  # other formats: only the document on stdout
    if len(combos) > 1:
        if args.out is not None:
            raise PlanError(
                "a sweep prints one table and writes no files: drop --out, or plan one combination",
                "--plot FILE draws it",
            )
        rows = []
        for combo in combos:
            try:
                rows.append(sweep_row(combo, make_plan(**combo, **kwargs), None))
            except PlanError as error:
                rows.append(sweep_row(combo, None, str(error)))
        if args.target_fid is not None:  # ranked by the hours to the target's milestone, the fastest first
            rows.sort(key=lambda row: row.get("target_hours", float("inf")))
        chart = None
        if args.plot is not None and any("micro_batch" in row for row in rows):
            from planner.plot import sweep_chart

            chart = sweep_chart(rows, plot_format)
        sys.stdout.write(render_sweep(rows, args.format, args.wide))
        if all("micro_batch" not in row for row in rows):
            raise PlanError("no combination of the sweep can be planned: see the notes above")
        if chart is not None:
            print(f"wrote {write_file_atomically(args.plot, chart)}", file=status)
        return 0
    # the terminal view writes ./plan by default; a document format is the document alone unless --out says
    out = check_out_dir(args.out or "plan") if args.out is not None or args.format == "table" else None
    plan = make_plan(**combos[0], **kwargs)
    chart = None
    if args.plot is not None:
        from planner.plot import candidates_chart

        chart = candidates_chart(plan, plot_format)
    written = [] if out is None else write_plan_dir(plan, out, command_line(argv), chart=not args.no_chart)
    if chart is not None:
        written.append(write_file_atomically(args.plot, chart))
    memory_chart = (out / MEMORY_CHART).as_posix() if out is not None and not args.no_chart else None
    sys.stdout.write(render(plan, args.format, args.wide, chart=memory_chart))
    if written:
        print("wrote " + ", ".join(str(path) for path in written), file=status)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Console entry point: PlanError -> one line on stderr and exit code 2."""
    try:
        return run(argv)
    except PlanError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
