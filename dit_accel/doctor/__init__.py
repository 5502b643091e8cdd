"""`dit-accel doctor`: the preflight to run on every node before a launch, and the reader of a failed
run's log.

    dit-accel doctor --plan plan/plan.json --data-path /data/train --output-dir runs/xl2
    dit-accel doctor --log runs/xl2/launch.log [--plan plan/plan.json]

Each check is a row (PASS, WARN or FAIL, the reason, the fix). Exit code: 0 when nothing failed
(warnings allowed), 1 on warnings with --strict, 2 on a failure or on bad flags / an unreadable plan.
The facts about this machine come from `Probes`, which tests replace to build any failing situation.

Imports: everything the trainer checks, from the trainer's own rules (`train.config`, `train.data`),
`data`, `repa`, `run` and `distributed`; nothing imports the doctor but the CLI.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dit_accel.cli_args import OneLineParser, nonnegative_int, port, positive_int
from dit_accel.data.latents_args import add_dataset_flags
from dit_accel.data.source_kind import DatasetOptions
from dit_accel.doctor.checks import Check, exit_code, warned
from dit_accel.doctor.data import check_data
from dit_accel.doctor.decode_rate import decode_budget
from dit_accel.doctor.distributed import CONNECT_TIMEOUT_S, check_distributed, read_rendezvous
from dit_accel.doctor.environment import EnvironmentFacts, check_environment, probe_environment
from dit_accel.doctor.host import HostFacts, check_host, loader_facts, read_host
from dit_accel.doctor.logs import diagnose
from dit_accel.doctor.output import check_output
from dit_accel.doctor.plan import PlanFacts, load_plan
from dit_accel.doctor.repa import check_repa
from dit_accel.doctor.report import render
from dit_accel.errors import UserError, exits_cleanly
from dit_accel.train.config import DEFAULT_NUM_WORKERS, TrainConfig, check_data_sources, loader_workers

PROG = "dit-accel doctor"


@dataclass
class Probes:
    """Where the facts about this machine come from; a test passes its own."""

    environment: Callable[[], EnvironmentFacts] = probe_environment
    host: Callable[[], HostFacts] = read_host
    disk_usage: Callable[[str], tuple] = shutil.disk_usage
    connect_timeout_s: float = CONNECT_TIMEOUT_S


class _Parser(OneLineParser):
    def error(self, message):  # one line and exit 2, like every dit-accel error
        raise UserError(f"{self.suggested(message)} (see `{PROG} --help`)")


def build_parser() -> argparse.ArgumentParser:
    defaults = TrainConfig()
    parser = _Parser(
        prog=PROG,
        description=__doc__.split("\n\n")[0],
        epilog="Exit codes: 0 ready (warnings allowed), 1 warnings with --strict, 2 a failure or bad input. "
        "With --log: 0 no failure found, 2 a failure explained, 1 with --strict when unrecognised.",
    )
    parser.add_argument("--plan", help="plan.json written by dit-plan (required, except with --log)")
    parser.add_argument(
        "--data-path",
        "--data_path",
        dest="data_path",
        type=Path,
        help="image folder (DIR/<class>/<image>) or a Hugging Face dataset (save_to_disk, parquet, webdataset); "
        "beside --latents with REPA, where the cache's source images are now (default: none: give it or --latents)",
    )
    add_dataset_flags(parser)
    parser.add_argument(
        "--latents",
        type=Path,
        help="latent cache written by `dit-accel extract-latents` (default: none: give it or --data-path)",
    )
    parser.add_argument(
        "--repa-encoder",
        "--repa_encoder",
        dest="repa_encoder",
        help="the run's --repa-encoder (a REPA plan's DINOv2 weights: loaded and checked against the plan) "
        "(default: none: a REPA plan then fails its row)",
    )
    parser.add_argument(
        "--repa-projector-dim",
        "--repa_projector_dim",
        dest="repa_projector_dim",
        type=positive_int,
        default=defaults.repa_projector_dim,
        help=f"the run's --repa-projector-dim (the trainer's default: {defaults.repa_projector_dim}; must be the "
        "plan's)",
    )
    parser.add_argument(
        "--vae",
        help="the run's --vae (checked against the latent cache and the plan's latent mode) (default: none)",
    )
    parser.add_argument(
        "--output-dir",
        "--output_dir",
        dest="output_dir",
        type=Path,
        help="the run folder, e.g. runs/xl2 (default: none: its disk and lock are not checked)",
    )
    parser.add_argument(
        "--accelerate-config",
        "--accelerate_config",
        dest="accelerate_config",
        type=Path,
        help="the Accelerate YAML of the launch (default: accelerate_config.yaml next to the plan)",
    )
    parser.add_argument(
        "--num-workers",
        "--num_workers",
        dest="num_workers",
        type=nonnegative_int,
        default=None,
        help=f"the run's --num-workers, data-loader workers per rank (default: as the trainer picks them, "
        f"{DEFAULT_NUM_WORKERS} or fewer where the node's CPUs cannot run that many)",
    )
    parser.add_argument(
        "--keep-last",
        "--keep_last",
        dest="keep_last",
        type=positive_int,
        default=defaults.keep_last,
        help=f"the run's checkpoints kept (the trainer's default: {defaults.keep_last})",
    )
    parser.add_argument(
        "--main-process-ip",
        "--main_process_ip",
        dest="main_process_ip",
        help="as given to `dit-accel train` / accelerate launch (default: the Accelerate config's)",
    )
    parser.add_argument(
        "--main-process-port",
        "--main_process_port",
        dest="main_process_port",
        type=port,
        help="as given to `dit-accel train` / accelerate launch (default: the Accelerate config's, else 29500)",
    )
    parser.add_argument(
        "--full",
        action="store_true",
        help="decode every image (not one per class); with --latents, check every shard's sha256 (and, for REPA, "
        "read every source image)",
    )
    parser.add_argument("--strict", action="store_true", help="exit 1 on warnings")
    parser.add_argument(
        "--format", choices=("table", "json"), default="table", help="a table for people, JSON for scripts"
    )
    parser.add_argument(
        "--log",
        type=Path,
        help="read a failed run's log instead of checking this node (default: none: check this node)",
    )
    return parser


def preflight(plan: PlanFacts, args: argparse.Namespace, probes: Probes) -> list[Check]:
    config_path = args.accelerate_config or plan.path.parent / "accelerate_config.yaml"
    environment = probes.environment()
    checks = check_environment(plan, environment, config_path)
    host = probes.host()
    workers = loader_workers(args.num_workers, plan.gpus_per_node, host.cpu_count)  # the trainer's own rule
    checks += check_host(plan, host, loader_facts(plan, workers))
    options = DatasetOptions(args.split, args.image_column, args.label_column)
    # the plan's images/s are its GPUs': a CPU run (the demo) trains far slower than its workers decode
    budget = decode_budget(plan, host.cpu_count, workers) if environment.cuda_available else None
    checks += check_data(plan, args.data_path, args.latents, args.vae, args.full, options, budget)
    checks += check_repa(
        plan,
        args.repa_encoder,
        args.repa_projector_dim,
        args.latents,
        args.data_path,
        options,
        budget,
        args.full,
    )
    if args.output_dir is None:
        checks.append(
            warned(
                "output",
                "output folder",
                "not checked: no --output-dir given",
                "pass --output-dir runs/NAME to check disk space and write permission",
            )
        )
    else:
        checks += check_output(plan, args.output_dir, args.keep_last, probes.disk_usage)
    rendezvous = read_rendezvous(config_path, plan, args.main_process_ip, args.main_process_port)
    checks += check_distributed(plan, rendezvous, probes.connect_timeout_s)
    return checks


RANK_LOG_TAIL_BYTES = 256 * 1024  # the end of each rank's log holds its last steps; the start is history


def read_log(args: argparse.Namespace) -> list[Check]:
    """The launcher's output, preceded by the tail of every per-rank log of the run when --output-dir is given."""
    try:
        text = args.log.read_text(errors="replace")
    except OSError as error:
        raise UserError(
            f"cannot read --log {args.log}: {error.strerror or error}",
            "pass the file the launcher's output went to",
        ) from None
    rank_logs = sorted((args.output_dir / "logs").glob("rank*.log")) if args.output_dir else []
    tails = []
    for path in rank_logs:
        with open(path, "rb") as stream:
            stream.seek(max(0, path.stat().st_size - RANK_LOG_TAIL_BYTES))
            tails.append(stream.read().decode(errors="replace"))
    plan = load_plan(args.plan) if args.plan else None
    return diagnose("\n".join(tails + [text]), plan, args.output_dir)


def run(argv: list[str] | None = None, probes: Probes | None = None) -> int:
    """The doctor with injectable probes; `main` is this with the real machine."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as done:  # --help
        return int(done.code or 0)
    if args.log is not None:
        checks = read_log(args)
    else:
        if not args.plan:
            raise UserError(
                "--plan is required: pass the plan.json written by `dit-plan --out DIR` "
                "(or --log FILE to read a failed run's log)"
            )
        if args.data_path is None and args.latents is None:
            raise UserError(
                "pass --data-path DIR (an image folder) or --latents DIR (a latent cache): the data to check"
            )
        check_data_sources(args.data_path, args.latents, args.repa_encoder)  # as the trainer takes them
        checks = preflight(load_plan(args.plan), args, probes or Probes())
    print(render(checks, args.format, args.strict, mode="log" if args.log is not None else "preflight"))
    return exit_code(checks, args.strict)


@exits_cleanly(PROG)
def main(argv: list[str] | None = None) -> int:
    return run(sys.argv[1:] if argv is None else argv)
