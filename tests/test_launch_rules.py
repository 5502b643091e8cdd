"""`dit-accel doctor` and `dit_accel.train` accept exactly the same launches, because one function decides
both (`planner.rules.launch_problems`): the doctor applies it to the Accelerate YAML, the trainer to the
environment `accelerate launch` exports from that YAML.

For every plan sharding and a set of hand-edited YAMLs, the doctor's verdict on the file is compared with the
trainer's verdict on the environment accelerate's own launcher code makes from the same file
(`_validate_launch_command`, then the launcher `launch_command` would pick and its `prepare_*_env`, then
torchrun's own config for the per-worker variables), without starting a process; a launched test holds that
translation equal to the environment a real `accelerate launch` hands its processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch.distributed.run as distrib_run
import yaml
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils.environment import str_to_bool
from accelerate.utils.launch import (
    _filter_args,
    prepare_deepspeed_cmd_env,
    prepare_multi_gpu_env,
    prepare_simple_launcher_cmd_env,
)
from ports import launch_port
from torch.distributed.fsdp import OffloadPolicy

from dit_accel.distributed.accelerator import check_launch, fsdp_plugin_for
from dit_accel.doctor.checks import Status
from dit_accel.doctor.environment import check_accelerate_config
from dit_accel.doctor.plan import load_plan
from dit_accel.errors import UserError
from planner.cli import main as dit_plan
from planner.planfile import read_plan
from planner.rules import PRECISIONS, SHARDING_MODES, LaunchSettings, launch_problems

# DiT-XL/2 at 256 px on 40 GB GPUs (bf16): each sharding on 2 GPUs, and DDP on one GPU (distributed_type NO)
BASE = ["--gpus", "2", "--vram", "40G", "--global-batch", "16"]
PLANS = {
    "ddp": [*BASE, "--sharding", "ddp"],
    "zero2": [*BASE, "--sharding", "zero2"],
    "zero3": [*BASE, "--sharding", "zero3"],
    "ddp-1gpu": ["--gpus", "1", "--vram", "40G", "--global-batch", "8", "--sharding", "ddp"],
    # hsdp: 2 nodes of 2 GPUs, the mesh (dp_replicate 2, dp_shard 2)
    "hsdp": [
        "--nodes",
        "2",
        "--gpus-per-node",
        "2",
        "--vram",
        "40G",
        "--global-batch",
        "16",
        "--sharding",
        "hsdp",
    ],
}
REPLICATED = ("ddp", "ddp-1gpu")
SHARDED = ("zero2", "zero3", "hsdp")
HSDP_BASE = PLANS["hsdp"][:-2]
LAUNCHER_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("launch_rules")
    for name, args in PLANS.items():
        assert dit_plan([*args, "--out", str(root / name)]) == 0
        decision = json.loads((root / name / "plan.json").read_text())["decision"]
        assert decision["sharding"] == name.split("-")[0] and decision["precision"] == "bf16"
    return {name: root / name / "plan.json" for name in PLANS}


@pytest.fixture(autouse=True)
def _no_launcher_environment(monkeypatch):
    """This test process was not launched: no variable a launcher sets may leak into the environments."""
    for name in list(os.environ):
        if name.startswith(("ACCELERATE_", "FSDP_")) or name in LAUNCHER_VARIABLES:
            monkeypatch.delenv(name)


# --- the launcher's translation: YAML -> the environment of rank 0 ----------------------------------------


def launch_argv(config_path: Path, script: str = "dit_accel.train") -> list[str]:
    return [
        "--config_file",
        str(config_path),
        "--main_process_port",
        launch_port(),
        "-m",
        script,
        "--plan",
        "plan.json",
    ]


def launched_environment(config_path: Path) -> dict[str, str]:
    """The environment `accelerate launch --config_file CONFIG -m dit_accel.train` gives rank 0, made by
    accelerate's code as `launch_command` runs it, stopping where it would start processes."""
    with mock.patch.dict(os.environ):  # the launcher and torchrun write defaults (OMP_NUM_THREADS) into it
        args = launch_command_parser().parse_args(launch_argv(config_path))
        args, defaults, mp_from_config = _validate_launch_command(args)
        if args.use_deepspeed and not args.cpu:  # deepspeed_launcher (it needs deepspeed installed to go on)
            fields = list(defaults.deepspeed_config) if defaults else []
            if mp_from_config:
                fields.append("mixed_precision")
            args.deepspeed_fields_from_accelerate_config = ",".join(fields)
            _, env = prepare_deepspeed_cmd_env(args)
        elif (args.use_fsdp or args.use_megatron_lm or args.multi_gpu) and not args.cpu:  # multi_gpu_launcher
            env = prepare_multi_gpu_env(args)
        else:  # simple_launcher: runs the script itself, one process, no torchrun
            _, env = prepare_simple_launcher_cmd_env(args)
            return env
        # both torchrun launchers hand these args to torch.distributed.run, which adds each worker's variables
        torchrun = _filter_args(
            args,
            distrib_run.get_args_parser(),
            ["--training_script", args.training_script, "--training_script_args", args.training_script_args],
        )
        config, _, _ = distrib_run.config_from_args(torchrun)
    return {
        **env,
        "WORLD_SIZE": str(config.nproc_per_node * config.max_nodes),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": str(config.nproc_per_node),
    }


# --- the two verdicts ---------------------------------------------------------------------------------------


def doctor_verdict(plan_path: Path, config_path: Path):
    return check_accelerate_config(load_plan(plan_path), config_path)


def trainer_verdict(plan_path: Path, env: dict[str, str]):
    """What dit_accel.train decides in a process launched with `env`, in its order: the process count
    (check_launch), then the launch settings (fsdp_plugin_for). The plugin reads os.environ, as it does there.
    Returns (problems or None, the FSDP plugin or None)."""
    plan = read_plan(plan_path)
    with mock.patch.dict(os.environ, env, clear=True):
        check_launch(plan, int(env.get("WORLD_SIZE", "1")), "plan.json")
        try:
            return None, fsdp_plugin_for(plan, "plan.json", env)
        except UserError as error:
            prefix = "the launch config does not match plan.json: "
            assert error.problem.startswith(prefix), error.problem
            assert "accelerate_config.yaml that dit-plan wrote" in error.fix
            return error.problem.removeprefix(prefix), None


def assert_plugin_runs_the_plan(plugin, sharding: str) -> None:
    """An accepted sharded launch gives the FSDP2 plugin the plan describes, as accelerate itself reads it."""
    if sharding in REPLICATED:
        assert plugin is None
        return
    assert plugin.fsdp_version == 2
    assert plugin.reshard_after_forward is SHARDING_MODES[sharding].reshard_after_forward
    assert plugin.state_dict_type.name == "SHARDED_STATE_DICT"
    assert type(plugin.cpu_offload) is OffloadPolicy  # not CPUOffloadPolicy
    assert not plugin.activation_checkpointing
    assert not plugin.cpu_ram_efficient_loading
    assert plugin.auto_wrap_policy is None


# --- the YAML variants --------------------------------------------------------------------------------------


def _fsdp(config: dict) -> dict:
    return config.setdefault("fsdp_config", {})


def fsdp_set(**values):
    return lambda config: _fsdp(config).update(values)


def fsdp_drop(key: str):
    return lambda config: _fsdp(config).pop(key, None)


def flip_reshard(config: dict) -> None:
    fsdp = _fsdp(config)
    fsdp["fsdp_reshard_after_forward"] = not fsdp.get("fsdp_reshard_after_forward", True)


def deepspeed(config: dict) -> None:
    config.pop("fsdp_config", None)
    config.update(
        distributed_type="DEEPSPEED",
        deepspeed_config={
            "zero_stage": 2,
            "offload_optimizer_device": "none",
            "offload_param_device": "none",
            "zero3_init_flag": False,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 1.0,
        },
    )


def mesh_one_node(config: dict) -> None:
    """An existing parallelism_config (hsdp's) turned into one shard group over every process."""
    if "parallelism_config" in config:
        config["parallelism_config"].update(
            parallelism_config_dp_replicate_size=1, parallelism_config_dp_shard_size=config["num_processes"]
        )


def mesh_added(config: dict) -> None:
    """An FSDP config given a one-dimensional ParallelismConfig (the launcher refuses one without FSDP2)."""
    if config.get("distributed_type") == "FSDP" and "parallelism_config" not in config:
        config["parallelism_config"] = {
            "parallelism_config_dp_replicate_size": 1,
            "parallelism_config_dp_shard_size": config["num_processes"],
        }


def as_strings(config: dict) -> None:
    """Every FSDP setting written as a string, as some hand-written YAMLs have them."""
    fsdp = _fsdp(config)
    for key, value in list(fsdp.items()):
        fsdp[key] = str(value).lower() if isinstance(value, bool) else str(value)


# name: (edit, the plans that still run with it)
VARIANTS = {
    "as written": (lambda config: None, list(PLANS)),
    "mixed_precision fp16": (lambda config: config.update(mixed_precision="fp16"), []),
    "mixed_precision no": (lambda config: config.update(mixed_precision="no"), []),
    "distributed_type FSDP": (lambda config: config.update(distributed_type="FSDP"), list(SHARDED)),
    "distributed_type MULTI_GPU": (
        lambda config: config.update(distributed_type="MULTI_GPU"),
        list(REPLICATED),
    ),
    "fsdp_version 1": (fsdp_set(fsdp_version=1), list(REPLICATED)),  # a DDP launch ignores fsdp_config
    "fsdp_reshard_after_forward flipped": (flip_reshard, list(REPLICATED)),
    "fsdp_state_dict_type FULL_STATE_DICT": (
        fsdp_set(fsdp_state_dict_type="FULL_STATE_DICT"),
        list(REPLICATED),
    ),
    "DEEPSPEED": (deepspeed, []),
    "fsdp_offload_params true": (fsdp_set(fsdp_offload_params=True), list(REPLICATED)),
    "fsdp_activation_checkpointing true": (fsdp_set(fsdp_activation_checkpointing=True), list(REPLICATED)),
    # the launcher's defaults: cpu_ram_efficient_loading true (refused), state dict SHARDED under FSDP2 (fine)
    "fsdp_cpu_ram_efficient_loading left out": (
        fsdp_drop("fsdp_cpu_ram_efficient_loading"),
        list(REPLICATED),
    ),
    "fsdp_state_dict_type left out": (fsdp_drop("fsdp_state_dict_type"), list(PLANS)),
    "fsdp settings as strings": (as_strings, list(PLANS)),
    # FSDP1's name for the layout in FSDP2's boolean switch: accelerate's FSDP2 plugin would stop on it with
    # a traceback ("invalid truth value"), so both refuse it in one line
    "fsdp_reshard_after_forward SHARD_GRAD_OP": (
        fsdp_set(fsdp_reshard_after_forward="SHARD_GRAD_OP"),
        list(REPLICATED),
    ),
    # hsdp's 2-D mesh: left out, flattened to one node, or a mesh given to a plan that shards over all GPUs
    "parallelism_config left out": (
        lambda config: config.pop("parallelism_config", None),
        [*REPLICATED, "zero2", "zero3"],
    ),
    "parallelism_config one node": (mesh_one_node, [*REPLICATED, "zero2", "zero3"]),
    "parallelism_config added": (mesh_added, [*REPLICATED, "hsdp"]),
}


def write_variant(plan_path: Path, folder: Path, variant: str) -> Path:
    config = yaml.safe_load((plan_path.parent / "accelerate_config.yaml").read_text())
    VARIANTS[variant][0](config)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "accelerate_config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


# A DeepSpeed launch of several machines goes through DeepSpeed's own multi-node launcher (pdsh), not torchrun,
# whose per-worker variables `launched_environment` does not model: hsdp (2 nodes) leaves that variant out.
CASES = [
    pytest.param(name, variant, id=f"{name}-{variant}")
    for name in PLANS
    for variant in VARIANTS
    if (name, variant) != ("hsdp", "DEEPSPEED")
]


@pytest.mark.parametrize("name, variant", CASES)
def test_doctor_and_trainer_accept_the_same_launches(plans, tmp_path, name, variant):
    plan_path = plans[name]
    config_path = write_variant(plan_path, tmp_path, variant)
    env = launched_environment(config_path)
    doctor = doctor_verdict(plan_path, config_path)
    problems, plugin = trainer_verdict(plan_path, env)

    assert doctor.status in (Status.PASS, Status.FAIL), doctor
    assert (doctor.status is Status.PASS) == (problems is None), (doctor.reason, problems)
    assert (problems is None) == (name in VARIANTS[variant][1]), (doctor.reason, problems)
    if problems is None:
        assert_plugin_runs_the_plan(plugin, name)
    else:
        assert problems and problems in doctor.reason, (doctor.reason, problems)
        assert "dit-plan" in doctor.fix
    # the file and the environment made from it are the same launch to the rules
    config = yaml.safe_load(config_path.read_text())
    from_yaml, from_env = LaunchSettings.from_yaml(config), LaunchSettings.from_environment(env)
    assert from_yaml.mixed_precision == from_env.mixed_precision
    if from_yaml.distributed_type in ("FSDP", "DEEPSPEED"):
        assert from_yaml == from_env


def test_each_refusal_names_the_setting_it_is_about(plans, tmp_path):
    """The matrix above could agree on refusing for the wrong reason: each variant's refusal names its key."""
    expected = {
        ("zero3", "mixed_precision fp16"): "mixed_precision is fp16, the plan's bf16 needs bf16",
        ("ddp", "distributed_type FSDP"): "distributed_type is FSDP, the plan replicates the model (ddp)",
        ("zero3", "distributed_type MULTI_GPU"): "distributed_type is MULTI_GPU, the plan's zero3 needs FSDP",
        ("zero2", "fsdp_version 1"): "fsdp_version is 1, dit-accel shards with FSDP2",
        (
            "zero2",
            "fsdp_reshard_after_forward flipped",
        ): "fsdp_reshard_after_forward is true, the plan's zero2 needs false",
        (
            "zero3",
            "fsdp_reshard_after_forward flipped",
        ): "fsdp_reshard_after_forward is false, the plan's zero3 needs true",
        ("zero3", "fsdp_state_dict_type FULL_STATE_DICT"): "fsdp_state_dict_type is FULL_STATE_DICT",
        ("ddp", "DEEPSPEED"): "distributed_type is DEEPSPEED",
        ("zero2", "DEEPSPEED"): "distributed_type is DEEPSPEED",
        ("zero3", "fsdp_offload_params true"): "fsdp_offload_params is true",
        ("zero2", "fsdp_activation_checkpointing true"): "fsdp_activation_checkpointing is true",
        ("zero3", "fsdp_cpu_ram_efficient_loading left out"): "fsdp_cpu_ram_efficient_loading is true",
        (
            "hsdp",
            "fsdp_reshard_after_forward flipped",
        ): "fsdp_reshard_after_forward is false, the plan's hsdp needs true",
        ("hsdp", "parallelism_config left out"): "parallelism_config is not set, the plan's hsdp needs "
        "parallelism_config_dp_replicate_size 2 and parallelism_config_dp_shard_size 2",
        ("hsdp", "parallelism_config one node"): "parallelism_config_dp_replicate_size is 1, the plan's hsdp "
        "needs 2 (its nodes); parallelism_config_dp_shard_size is 4, the plan's hsdp needs 2 (GPUs per node)",
        (
            "zero3",
            "parallelism_config added",
        ): "parallelism_config is set, the plan's zero3 needs no device mesh",
    }
    for (name, variant), text in expected.items():
        config_path = write_variant(plans[name], tmp_path / name / variant.replace(" ", "_"), variant)
        problems, _ = trainer_verdict(plans[name], launched_environment(config_path))
        assert problems is not None and text in problems, (name, variant, problems)
        assert text in doctor_verdict(plans[name], config_path).reason


@pytest.mark.parametrize("name", ["ddp", "zero2", "zero3"])
def test_a_one_process_launch_of_a_two_process_plan_is_refused_by_both(plans, tmp_path, name):
    """distributed_type NO: `accelerate launch` runs the script once, without torchrun (no WORLD_SIZE). The
    doctor refuses through launch_problems; the trainer first counts its processes (check_launch), so its
    line is the process count, and for a DDP plan its launch check alone would pass."""
    config_path = write_variant(plans[name], tmp_path, "as written")
    config = yaml.safe_load(config_path.read_text())
    config["distributed_type"] = "NO"
    config_path.write_text(yaml.safe_dump(config))
    env = launched_environment(config_path)
    assert "WORLD_SIZE" not in env and "ACCELERATE_USE_FSDP" not in env
    doctor = doctor_verdict(plans[name], config_path)
    assert doctor.status is Status.FAIL and "distributed_type is NO" in doctor.reason
    with pytest.raises(UserError, match="planned for 2 processes but 1 was launched"):
        trainer_verdict(plans[name], env)
    # the launch check alone (fsdp_plugin_for) counts the processes launched, here one: it refuses a sharded
    # plan with the doctor's words, and leaves the DDP plan to check_launch (its one-process rule needs
    # WORLD_SIZE above 1, which a NO launch never exports)
    plan = read_plan(plans[name])
    with mock.patch.dict(os.environ, env, clear=True):
        if name in SHARDED:
            with pytest.raises(UserError) as refused:
                fsdp_plugin_for(plan, "plan.json", env)
            assert refused.value.problem.split(": ", 1)[1] in doctor.reason
        else:
            assert fsdp_plugin_for(plan, "plan.json", env) is None


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("sharding", list(SHARDING_MODES))
def test_the_rule_tables_accept_what_the_planner_writes(tmp_path, sharding, precision):
    base = HSDP_BASE if SHARDING_MODES[sharding].within_node else BASE
    assert dit_plan([*base, "--sharding", sharding, "--precision", precision, "--out", str(tmp_path)]) == 0
    plan = read_plan(tmp_path / "plan.json")
    assert (plan.decision.sharding, plan.decision.precision) == (sharding, precision)
    config_path = tmp_path / "accelerate_config.yaml"
    config = yaml.safe_load(config_path.read_text())
    mode, wanted = SHARDING_MODES[sharding], PRECISIONS[precision]
    assert config["mixed_precision"] == wanted.accelerate_mixed_precision
    assert config["distributed_type"] == ("FSDP" if mode.uses_fsdp else "MULTI_GPU")
    if mode.uses_fsdp:
        assert config["fsdp_config"]["fsdp_version"] == 2
        assert config["fsdp_config"]["fsdp_reshard_after_forward"] is mode.reshard_after_forward
    else:
        assert "fsdp_config" not in config
    if mode.within_node:  # Accelerate's ParallelismConfig: (dp_replicate, dp_shard) = (nodes, GPUs per node)
        assert config["num_machines"] == plan.cluster.nodes == 2
        assert config["parallelism_config"]["parallelism_config_dp_replicate_size"] == 2
        assert config["parallelism_config"]["parallelism_config_dp_shard_size"] == 2
    else:
        assert "parallelism_config" not in config
    from_yaml = LaunchSettings.from_yaml(config)
    nodes = plan.cluster.nodes
    assert launch_problems(sharding, precision, from_yaml, plan.world_size, nodes) == []
    env = launched_environment(config_path)
    assert LaunchSettings.from_environment(env) == from_yaml
    assert (
        launch_problems(sharding, precision, LaunchSettings.from_environment(env), plan.world_size, nodes)
        == []
    )
    assert doctor_verdict(tmp_path / "plan.json", config_path).status is Status.PASS
    problems, plugin = trainer_verdict(tmp_path / "plan.json", env)
    assert problems is None
    assert_plugin_runs_the_plan(plugin, sharding)


# accelerate reads FSDP switches with str_to_bool (y, yes, t, true, on, 1 / n, no, f, false, off, 0); the
# rules must read each spelling the same way, or a zero2 plan launched with 'on' would pass and run as zero3.
ACCELERATE_TRUTH = ["y", "yes", "t", "true", "on", "1", "n", "no", "f", "false", "off", "0", "True", "FALSE"]


@pytest.mark.parametrize("spelling", ACCELERATE_TRUTH)
def test_the_rules_read_fsdp_switches_as_accelerate_does(spelling):
    truth = str_to_bool(spelling, to_bool=True)
    base = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "WORLD_SIZE": "2"}
    for variable, field in [
        ("FSDP_RESHARD_AFTER_FORWARD", "reshard_after_forward"),
        ("FSDP_OFFLOAD_PARAMS", "offload_params"),
        ("FSDP_ACTIVATION_CHECKPOINTING", "activation_checkpointing"),
        ("FSDP_CPU_RAM_EFFICIENT_LOADING", "cpu_ram_efficient_loading"),
    ]:
        settings = LaunchSettings.from_environment({**base, variable: spelling})
        assert getattr(settings, field) is truth, (variable, spelling)


# --- the translation checked against a real `accelerate launch` -------------------------------------------

DUMP = """
import json, os, sys
from pathlib import Path
Path(sys.argv[-1], "env%s.json" % os.environ.get("RANK", "0")).write_text(json.dumps(dict(os.environ)))
"""
REAL = [
    ("ddp", "as written"),
    ("ddp-1gpu", "as written"),
    ("zero2", "as written"),
    ("zero3", "as written"),
    ("zero3", "fsdp_reshard_after_forward flipped"),
    ("ddp", "distributed_type FSDP"),
]


def _rules_view(env: dict) -> dict:
    """The variables the rules and the FSDP plugin read, and the process layout."""
    return {
        key: value
        for key, value in env.items()
        if key.startswith(("FSDP_", "ACCELERATE_USE_", "ACCELERATE_MIXED_PRECISION"))
        or key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    }


@pytest.mark.launched
def test_the_translation_is_what_a_real_accelerate_launch_exports(plans, tmp_path):
    """Each config launched for real (CPU processes that dump their environment), side by side."""
    script = tmp_path / "dump_env.py"
    script.write_text(DUMP)
    running = []
    for index, (name, variant) in enumerate(REAL):
        folder = tmp_path / f"case{index}"
        config_path = write_variant(plans[name], folder, variant)
        argv = launch_argv(config_path)
        argv[argv.index("-m") :] = [str(script), str(folder)]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        running.append(
            (
                name,
                variant,
                folder,
                config_path,
                subprocess.Popen(
                    [sys.executable, "-m", "accelerate.commands.launch", *argv],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                ),
            )
        )
    for name, variant, folder, config_path, process in running:
        output, _ = process.communicate(timeout=300)
        assert process.returncode == 0, output
        real = json.loads((folder / "env0.json").read_text())
        processes = yaml.safe_load(config_path.read_text())["num_processes"]
        dumped = sorted(path.name for path in folder.glob("env*.json"))
        assert dumped == [f"env{rank}.json" for rank in range(processes)]
        made = launched_environment(config_path)
        assert _rules_view(made) == _rules_view(real), (name, variant)
        assert LaunchSettings.from_environment(made) == LaunchSettings.from_environment(real)
        assert trainer_verdict(plans[name], real)[0] == trainer_verdict(plans[name], made)[0]
