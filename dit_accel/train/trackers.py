"""`--report-to`: the experiment trackers a run logs to, through Accelerate's own (`log_with`,
`init_trackers`, `accelerator.log`, `end_training`).

TensorBoard is the default and a dependency of the package; Weights & Biases is the `wandb` extra
(`pip install 'dit-accel[wandb]'`). A tracker asked for by name whose package is missing is one line
before anything starts; `all` means every tracker here whose package is installed, `none` none.
"""

from __future__ import annotations

import importlib.util

from dit_accel.errors import UserError

TRACKERS = ("tensorboard", "wandb")
REPORT_TO = (*TRACKERS, "all", "none")
INSTALL = {"tensorboard": "pip install tensorboard", "wandb": "pip install 'dit-accel[wandb]'"}
PROJECT = "dit-accel"  # Accelerate's project name: RUN/tensorboard/dit-accel/, and the wandb project


def installed(name: str) -> bool:
    if name == "tensorboard":  # Accelerate's TensorBoard tracker writes with either package
        return any(importlib.util.find_spec(package) for package in ("tensorboard", "tensorboardX"))
    return importlib.util.find_spec(name) is not None


def parse_report_to(text: str) -> list[str]:
    """`tensorboard`, `wandb`, `tensorboard,wandb`, `all` or `none`, checked for spelling only."""
    names = [part.strip().lower() for part in str(text).split(",") if part.strip()]
    bad = [name for name in names if name not in REPORT_TO]
    if not names or bad:
        raise UserError(
            f"--report-to {text!r}: {', '.join(bad) or 'empty'} is not a tracker",
            f"pass one of {', '.join(REPORT_TO)} (or several trackers, comma-separated)",
        )
    if ("all" in names or "none" in names) and len(names) > 1:
        raise UserError(f"--report-to {text!r}: 'all' and 'none' stand alone", "pass one of them alone")
    return names


def chosen_trackers(report_to: str, tensorboard: bool = True) -> list[str]:
    """The trackers to start; `tensorboard=False` (the older `--no-tensorboard`) drops TensorBoard. A tracker
    named explicitly whose package is missing is refused in one line, naming the install command."""
    names = parse_report_to(report_to)
    if names == ["none"]:
        return []
    if names == ["all"]:
        names = [name for name in TRACKERS if installed(name)]
    names = [name for name in names if tensorboard or name != "tensorboard"]  # off: never looked for
    for name in names:
        if not installed(name):
            raise UserError(
                f"--report-to {name}: the {name} package is not installed",
                f"{INSTALL[name]}, or pass --report-to none",
            )
    return names


def start_trackers(
    accelerator, names: list[str], hparams: dict, run_name: str, run_dir, first_step: int = 1
) -> None:
    """Replace the trackers the accelerator was made with by `names`, and start them (the main process
    writes; Accelerate makes the call a no-op elsewhere). TensorBoard hides the events an earlier launch wrote
    at `first_step` and after (its purge_step): after a rollback it shows the one timeline this run continues."""
    from accelerate.tracking import filter_trackers

    accelerator.log_with = filter_trackers(names, accelerator.logging_dir) if names else []
    if accelerator.log_with:
        accelerator.init_trackers(
            PROJECT,
            init_kwargs={
                "wandb": {"name": run_name, "dir": str(run_dir)},
                "tensorboard": {"purge_step": first_step},
            },
        )
        for tracker in accelerator.trackers if accelerator.is_main_process else ():
            if tracker.name == "tensorboard":
                write_tensorboard_hparams(tracker.writer, hparams)
            else:
                tracker.store_init_configuration(hparams)


def write_tensorboard_hparams(writer, hparams: dict) -> None:
    """The run's settings into its own event file, so TensorBoard shows ONE run with its hparams: Accelerate's
    `store_init_configuration` calls SummaryWriter.add_hparams, which writes them into a new subfolder named
    by the time, and TensorBoard lists each such folder as another, empty run."""
    try:
        from torch.utils.tensorboard.summary import hparams as hparams_summaries
    except ImportError:  # Accelerate's tracker writes with tensorboardX when torch's writer is missing
        from tensorboardX.summary import hparams as hparams_summaries

    for summary in hparams_summaries(hparams, {}):  # experiment, session start, session end
        writer.file_writer.add_summary(summary)
    writer.flush()


def log_image(accelerator, key: str, image, step: int) -> None:
    """One (H, W, 3) uint8 picture to every tracker that takes images."""
    for tracker in getattr(accelerator, "trackers", []):
        if not hasattr(tracker, "log_images"):
            continue
        extra = {"dataformats": "NHWC"} if tracker.name == "tensorboard" else {}
        tracker.log_images({key: image[None]}, step=step, **extra)
