"""One table per rule: the precisions and sharding modes a plan may name, and which launches run them.

The planner, the trainer and `dit-accel doctor` all read these tables, so a name means one thing everywhere
and the doctor accepts exactly the launches the trainer accepts: both call `launch_problems`, the doctor with
the Accelerate YAML (`LaunchSettings.from_yaml`), the trainer with the environment `accelerate launch` made
from it (`LaunchSettings.from_environment`). Pure Python: the planner never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.errors import PlanError


@dataclass(frozen=True)
class Precision:
    """How a plan's `decision.precision` computes."""

    name: str
    torch_dtype: (
        str | None
    )  # the autocast / FSDP2 compute dtype (a torch attribute name); None: fp32 throughout
    accelerate_mixed_precision: str  # Accelerate's `mixed_precision` for it
    grad_scaler: bool  # needs dynamic loss scaling
    description: str


PRECISIONS = {
    "bf16": Precision("bf16", "bfloat16", "bf16", False, "bf16 autocast over fp32 master weights"),
    "fp16": Precision(
        "fp16", "float16", "fp16", True, "fp16 autocast over fp32 master weights, loss scaling"
    ),
    "fp32": Precision("fp32", None, "no", False, "fp32 (TF32 matmuls on CUDA)"),
}


@dataclass(frozen=True)
class ShardingMode:
    """How a plan's `decision.sharding` spreads the training state over the GPUs."""

    name: str
    sharded: str  # what each rank holds 1/N of
    reshard_after_forward: bool | None  # FSDP2's switch; None: no FSDP (DDP)
    fsdp1_strategy: (
        str | None
    )  # the FSDP1 / DeepSpeed-style name of the same layout, for people who know those
    description: str

    @property
    def uses_fsdp(self) -> bool:
        return self.reshard_after_forward is not None


SHARDING_MODES = {
    "ddp": ShardingMode("ddp", "nothing", None, None, "replicated weights, gradients all-reduced (DDP)"),
    "zero2": ShardingMode(
        "zero2",
        "gradients, AdamW state, fp32 master weights",
        False,
        "SHARD_GRAD_OP",
        "FSDP2, parameters gathered once per step and kept until the end of backward",
    ),
    "zero3": ShardingMode(
        "zero3",
        "parameters, gradients, AdamW state",
        True,
        "FULL_SHARD",
        "FSDP2, parameters gathered per block in forward and again in backward",
    ),
}


def precision(name: str) -> Precision:
    if name not in PRECISIONS:
        raise PlanError(
            f"unknown precision {name!r}: expected {', '.join(PRECISIONS)}", "re-plan with dit-plan"
        )
    return PRECISIONS[name]


def sharding_mode(name: str) -> ShardingMode:
    if name not in SHARDING_MODES:
        raise PlanError(
            f"unknown sharding {name!r}: expected {', '.join(SHARDING_MODES)}", "re-plan with dit-plan"
        )
    return SHARDING_MODES[name]


# --- the launch ----------------------------------------------------------------------------------------------


_TRUE, _FALSE = ("y", "yes", "t", "true", "on", "1"), ("n", "no", "f", "false", "off", "0")  # accelerate's


def _flag(value, default: bool) -> bool | str:
    """A YAML or environment boolean, read as accelerate's `str_to_bool` reads it ("on", "1", True, ...);
    a value it cannot read (e.g. an FSDP1 strategy name) is returned as a string for `launch_problems` to
    refuse, since accelerate would stop on it with a traceback."""
    if value is None:
        return default
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    return True if text in _TRUE else False if text in _FALSE else text


@dataclass(frozen=True)
class LaunchSettings:
    """What a launch decides that the plan also decides, with `accelerate launch`'s defaults filled in."""

    distributed_type: str  # NO | MULTI_GPU | MULTI_CPU | FSDP | DEEPSPEED | ...
    mixed_precision: str | None  # None: not set by the launch (a plain `python -m`)
    fsdp_version: int = 1
    reshard_after_forward: bool | str = True  # a string: a value accelerate cannot read as a boolean
    state_dict_type: str = "FULL_STATE_DICT"
    offload_params: bool | str = False
    activation_checkpointing: bool | str = False
    cpu_ram_efficient_loading: bool | str = False

    @classmethod
    def from_yaml(cls, config: dict) -> LaunchSettings:
        """An Accelerate config file as loaded YAML; missing keys take the launcher's defaults."""
        fsdp = config.get("fsdp_config") or {}
        return cls._make(
            str(config.get("distributed_type", "NO")),
            str(config.get("mixed_precision", "no")),
            {key.removeprefix("fsdp_"): value for key, value in fsdp.items()},
        )

    @classmethod
    def from_environment(cls, env: dict) -> LaunchSettings:
        """The variables `accelerate launch` exports to each process from that file and its flags."""
        if _flag(env.get("ACCELERATE_USE_DEEPSPEED"), False):
            distributed_type = "DEEPSPEED"
        elif _flag(env.get("ACCELERATE_USE_FSDP"), False):
            distributed_type = "FSDP"
        else:
            distributed_type = "MULTI_GPU" if int(env.get("WORLD_SIZE", "1") or 1) > 1 else "NO"
        fsdp = {
            key.removeprefix("FSDP_").lower(): value for key, value in env.items() if key.startswith("FSDP_")
        }
        return cls._make(distributed_type, env.get("ACCELERATE_MIXED_PRECISION"), fsdp)

    @classmethod
    def _make(cls, distributed_type: str, mixed_precision: str | None, fsdp: dict) -> LaunchSettings:
        version = int(str(fsdp.get("version", 1)))
        state_dict_type = fsdp.get("state_dict_type") or (
            "SHARDED_STATE_DICT" if version == 2 else "FULL_STATE_DICT"
        )
        return cls(
            distributed_type=distributed_type,
            mixed_precision=None if mixed_precision is None else str(mixed_precision).lower(),
            fsdp_version=version,
            reshard_after_forward=_flag(fsdp.get("reshard_after_forward"), True),
            state_dict_type=str(state_dict_type).rsplit(".", 1)[-1].upper(),
            offload_params=_flag(fsdp.get("offload_params"), False),
            activation_checkpointing=_flag(fsdp.get("activation_checkpointing"), False),
            cpu_ram_efficient_loading=_flag(fsdp.get("cpu_ram_efficient_loading"), True),
        )


def launch_problems(
    sharding: str, precision_name: str, launch: LaunchSettings, world_size: int = 1
) -> list[str]:
    """Why `launch` cannot run a plan of this sharding, precision and world size; empty when it can. Each item
    names the setting (by its accelerate_config.yaml key) and the value the plan needs."""
    mode, wanted = sharding_mode(sharding), precision(precision_name)
    problems = []
    if launch.mixed_precision is not None and launch.mixed_precision != wanted.accelerate_mixed_precision:
        problems.append(
            f"mixed_precision is {launch.mixed_precision}, the plan's {wanted.name} needs "
            f"{wanted.accelerate_mixed_precision}"
        )
    if launch.distributed_type == "DEEPSPEED":
        return problems + [
            "distributed_type is DEEPSPEED, dit-accel shards with FSDP2 (distributed_type: FSDP) "
            "and replicates with DDP"
        ]
    if not mode.uses_fsdp:
        if launch.distributed_type == "FSDP":
            problems.append(
                f"distributed_type is FSDP, the plan replicates the model ({mode.name}): "
                f"MULTI_GPU (or NO for one process)"
            )
        elif launch.distributed_type == "NO" and world_size > 1:
            problems.append(
                f"distributed_type is NO (one process), the plan's {world_size} processes need MULTI_GPU"
            )
        return problems
    if launch.distributed_type != "FSDP":
        return problems + [
            f"distributed_type is {launch.distributed_type}, the plan's {mode.name} needs FSDP"
        ]
    if launch.fsdp_version != 2:  # the rest are FSDP2's settings
        return problems + [
            f"fsdp_version is {launch.fsdp_version}, dit-accel shards with FSDP2 (fsdp_version: 2)"
        ]
    unreadable = {
        key: value
        for key, value in (
            ("fsdp_reshard_after_forward", launch.reshard_after_forward),
            ("fsdp_offload_params", launch.offload_params),
            ("fsdp_activation_checkpointing", launch.activation_checkpointing),
            ("fsdp_cpu_ram_efficient_loading", launch.cpu_ram_efficient_loading),
        )
        if isinstance(value, str)
    }
    if unreadable:
        return problems + [
            f"{key} is {value!r}, FSDP2 reads only true or false"
            + (
                f" (the plan's {mode.name} needs {str(mode.reshard_after_forward).lower()})"
                if key == "fsdp_reshard_after_forward"
                else ""
            )
            for key, value in unreadable.items()
        ]
    if launch.reshard_after_forward != mode.reshard_after_forward:
        problems.append(
            f"fsdp_reshard_after_forward is {str(launch.reshard_after_forward).lower()}, the plan's "
            f"{mode.name} needs {str(mode.reshard_after_forward).lower()}"
        )
    if launch.state_dict_type != "SHARDED_STATE_DICT":
        problems.append(
            f"fsdp_state_dict_type is {launch.state_dict_type}, checkpoints are written sharded "
            f"(SHARDED_STATE_DICT)"
        )
    if launch.offload_params:
        problems.append("fsdp_offload_params is true, the plan keeps parameters on the GPU")
    if launch.activation_checkpointing:
        problems.append(
            "fsdp_activation_checkpointing is true (it checkpoints every block; the trainer "
            "checkpoints the plan's blocks itself)"
        )
    if launch.cpu_ram_efficient_loading:
        problems.append(
            "fsdp_cpu_ram_efficient_loading is true (every rank builds the same weights from the "
            "seed instead)"
        )
    return problems
