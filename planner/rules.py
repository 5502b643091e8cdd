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


def default_matmul(precision: str) -> str:
    """The matmul rate of a plan precision when nothing else is said: fp32 plans train with TF32 matmuls."""
    return "tf32" if precision == "fp32" else precision


# The training objectives a plan may name (dit-plan --objective); the trainer's --objective must agree.
OBJECTIVES = {
    "ddpm": "DiT's Gaussian diffusion: epsilon MSE plus the learned variance's bound term",
    "flow": "SiT's flow matching: linear interpolant between data and noise, velocity MSE",
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
    within_node: bool = False  # shards over one node's GPUs and replicates the shards across nodes (HSDP)

    @property
    def uses_fsdp(self) -> bool:
        return self.reshard_after_forward is not None

    def shard_degree(self, nodes: int, gpus_per_node: int) -> int:
        """How many GPUs share one copy of the sharded states: 1 (DDP), one node's GPUs (HSDP) or all."""
        if not self.uses_fsdp:
            return 1
        return gpus_per_node if self.within_node else nodes * gpus_per_node


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
    "hsdp": ShardingMode(
        "hsdp",
        "parameters, gradients, AdamW state, within each node (replicated across nodes)",
        True,
        "HYBRID_SHARD",
        "FSDP2 on a (node, GPU) mesh: zero3 inside each node, the gradient shards all-reduced across nodes",
        within_node=True,
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


PARALLEL_SIZES = ("dp_replicate", "dp_shard", "tp", "cp", "sp")  # ParallelismConfig's, in its mesh order


def _size(value) -> int | str:
    """A ParallelismConfig size as the launcher passes it on (an int); anything else as the string given."""
    try:
        return int(str(value).strip())
    except ValueError:
        return str(value)


def hsdp_mesh(nodes: int, world_size: int) -> dict:
    """The ParallelismConfig sizes of an hsdp plan: the nodes replicate, each node's GPUs shard."""
    return {"dp_replicate": nodes, "dp_shard": world_size // nodes, "tp": 1, "cp": 1, "sp": 1}


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
    # Accelerate's ParallelismConfig, the N-d device mesh of FSDP2 (HSDP: dp_replicate x dp_shard); when on,
    # every size by name (PARALLEL_SIZES), each an int or, unreadable, the string as given
    use_parallelism_config: bool = False
    parallel_sizes: tuple = ()

    @property
    def mesh_sizes(self) -> dict:
        """Every ParallelismConfig size (all 1 without a ParallelismConfig)."""
        return {**dict.fromkeys(PARALLEL_SIZES, 1), **dict(self.parallel_sizes)}

    @classmethod
    def from_yaml(cls, config: dict) -> LaunchSettings:
        """An Accelerate config file as loaded YAML; missing keys take the launcher's defaults."""
        fsdp = config.get("fsdp_config") or {}
        parallelism = config.get("parallelism_config") or {}  # the launcher: on when the section is not empty
        return cls._make(
            str(config.get("distributed_type", "NO")),
            str(config.get("mixed_precision", "no")),
            {key.removeprefix("fsdp_"): value for key, value in fsdp.items()},
            bool(parallelism),
            {
                name: parallelism[f"parallelism_config_{name}_size"]
                for name in PARALLEL_SIZES
                if f"parallelism_config_{name}_size" in parallelism
            },
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
        # the Accelerator builds a ParallelismConfig from these only when the switch is exactly "true"
        parallelism = str(env.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false")).lower() == "true"
        sizes = {
            name: env[f"PARALLELISM_CONFIG_{name.upper()}_SIZE"]
            for name in PARALLEL_SIZES
            if f"PARALLELISM_CONFIG_{name.upper()}_SIZE" in env
        }
        return cls._make(distributed_type, env.get("ACCELERATE_MIXED_PRECISION"), fsdp, parallelism, sizes)

    @classmethod
    def _make(
        cls,
        distributed_type: str,
        mixed_precision: str | None,
        fsdp: dict,
        use_parallelism_config: bool = False,
        parallel_sizes: dict | None = None,
    ) -> LaunchSettings:
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
            use_parallelism_config=use_parallelism_config,
            parallel_sizes=tuple(  # the launcher's default for a size left out is 1
                (name, _size((parallel_sizes or {}).get(name, 1))) for name in PARALLEL_SIZES
            )
            if use_parallelism_config
            else (),
        )


def _mesh_problems(mode: ShardingMode, launch: LaunchSettings, nodes: int, world_size: int) -> list[str]:
    """hsdp needs Accelerate's ParallelismConfig of exactly the plan's (nodes, GPUs per node) mesh, the
    other modes none: the model would be sharded over that mesh, a layout the plan did not count."""
    if not mode.within_node:
        if not launch.use_parallelism_config:
            return []
        return [
            f"parallelism_config is set, the plan's {mode.name} needs no device mesh: remove that section"
        ]
    wanted = hsdp_mesh(nodes, world_size)
    if not launch.use_parallelism_config:
        return [
            f"parallelism_config is not set, the plan's hsdp needs parallelism_config_dp_replicate_size "
            f"{wanted['dp_replicate']} and parallelism_config_dp_shard_size {wanted['dp_shard']}"
        ]
    return [
        f"parallelism_config_{name}_size is {size}, the plan's hsdp needs {wanted[name]}"
        + (" (its nodes)" if name == "dp_replicate" else " (GPUs per node)" if name == "dp_shard" else "")
        for name, size in launch.mesh_sizes.items()
        if size != wanted[name]
    ]


def launch_problems(
    sharding: str, precision_name: str, launch: LaunchSettings, world_size: int = 1, nodes: int = 1
) -> list[str]:
    """Why `launch` cannot run a plan of this sharding, precision, world size and node count; empty when it
    can. Each item names the setting (by its accelerate_config.yaml key) and the value the plan needs."""
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
        return problems + _mesh_problems(mode, launch, nodes, world_size)
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
    return problems + _mesh_problems(mode, launch, nodes, world_size)
