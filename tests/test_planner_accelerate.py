"""The Accelerate YAMLs load with accelerate's own loader and pass `accelerate launch` validation (without
starting processes); the SLURM script really starts one `accelerate launch` per node with its rank."""

import os
import stat
import subprocess
import textwrap
from pathlib import Path

import pytest
import yaml
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils.launch import prepare_multi_gpu_env

from planner.outputs import write_plan_dir
from planner.plan import make_plan

CASES = {
    "single-gpu": dict(gpus=1, vram="80G", global_batch=64),
    "ddp": dict(gpus=8, vram="80G", global_batch=256),
    "zero2": dict(gpus=8, vram="40G", global_batch=256, sharding="zero2"),
    "zero3": dict(gpus=8, vram="40G", global_batch=256, sharding="zero3"),
    "multi-node": dict(
        gpus=8,
        nodes=2,
        vram="80G",
        global_batch=256,
        main_process_ip="10.1.2.3",
        main_process_port=29555,
        sharding="ddp",  # left to itself the planner shards here: DDP's fp32 all-reduce is slower
    ),
    "multi-node-zero3": dict(gpus=4, nodes=4, vram="24G", global_batch=256, sharding="zero3", resolution=512),
    "multi-node-hsdp": dict(gpus=4, nodes=2, vram="40G", global_batch=256, sharding="hsdp"),
}
EXPECTED_TYPE = {
    "single-gpu": "NO",
    "ddp": "MULTI_GPU",
    "zero2": "FSDP",
    "zero3": "FSDP",
    "multi-node": "MULTI_GPU",
    "multi-node-zero3": "FSDP",
    "multi-node-hsdp": "FSDP",
}


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    root = tmp_path_factory.mktemp("plans")
    out = {}
    for name, kwargs in CASES.items():
        plan = make_plan(**kwargs)
        write_plan_dir(plan, root / name)
        out[name] = (plan, root / name)
    return out


def validated(config_path, *extra):
    args = launch_command_parser().parse_args(
        ["--config_file", str(config_path), *extra, "-m", "dit_accel.train", "--plan", "plan.json"]
    )
    args, defaults, _ = _validate_launch_command(args)
    return args, defaults


@pytest.mark.parametrize("name", list(CASES))
def test_yaml_loads_with_accelerates_loader_and_passes_launch_validation(plans, name):
    plan, folder = plans[name]
    config = load_config_from_file(str(folder / "accelerate_config.yaml"))
    assert config.distributed_type == EXPECTED_TYPE[name]
    assert config.num_processes == plan["cluster"]["world_size"]
    assert config.num_machines == plan["cluster"]["nodes"]
    assert config.mixed_precision == plan["decision"]["mixed_precision"]
    args, _ = validated(folder / "accelerate_config.yaml")
    assert args.num_processes == plan["cluster"]["world_size"]
    assert args.module and args.training_script == "dit_accel.train"
    assert args.mixed_precision == plan["decision"]["mixed_precision"]
    assert args.multi_gpu == (EXPECTED_TYPE[name] == "MULTI_GPU")
    assert args.use_fsdp == (EXPECTED_TYPE[name] == "FSDP")


@pytest.mark.parametrize(
    "name, reshard",
    [("zero2", "false"), ("zero3", "true"), ("multi-node-zero3", "true"), ("multi-node-hsdp", "true")],
)
def test_fsdp_sharding_reaches_the_processes(plans, name, reshard):
    """FSDP2; the launcher's default reshard_after_forward is true (zero3), so the YAML writes it explicitly."""
    plan, folder = plans[name]
    args, _ = validated(folder / "accelerate_config.yaml", "--main_process_port", "0")
    env = prepare_multi_gpu_env(args)
    assert env["ACCELERATE_USE_FSDP"] == "true" and env["FSDP_VERSION"] == "2"
    assert env["FSDP_RESHARD_AFTER_FORWARD"] == reshard and env["FSDP_AUTO_WRAP_POLICY"] == "NO_WRAP"


@pytest.mark.parametrize("name", list(CASES))
def test_only_hsdp_launches_a_two_dimensional_mesh(plans, name):
    """hsdp's mesh is Accelerate's ParallelismConfig: the launcher exports it to every process (the Accelerator
    builds its device mesh from these), (dp_replicate, dp_shard) = (nodes, GPUs per node); no other plan has one."""
    plan, folder = plans[name]
    args, _ = validated(folder / "accelerate_config.yaml", "--main_process_port", "0")
    env = prepare_multi_gpu_env(args) if args.use_fsdp or args.multi_gpu else {}
    if plan["decision"]["sharding"] != "hsdp":
        assert not args.use_parallelism_config and "ACCELERATE_USE_PARALLELISM_CONFIG" not in env
        return
    assert args.use_parallelism_config and env["ACCELERATE_USE_PARALLELISM_CONFIG"] == "true"
    prefix = (
        "PARALLELISM_CONFIG_"  # the launcher's env copies the caller's, which may hold other *_SIZE names
    )
    sizes = {
        key.removeprefix(prefix): env[key] for key in env if key.startswith(prefix) and key.endswith("_SIZE")
    }
    assert sizes == {
        "DP_REPLICATE_SIZE": "2",
        "DP_SHARD_SIZE": "4",
        "TP_SIZE": "1",
        "CP_SIZE": "1",
        "SP_SIZE": "1",
    }
    assert (plan["cluster"]["nodes"], plan["cluster"]["gpus_per_node"]) == (2, 4)


def test_multi_node_config_carries_the_rendezvous(plans):
    plan, folder = plans["multi-node"]
    raw = yaml.safe_load((folder / "accelerate_config.yaml").read_text())
    assert raw["main_process_ip"] == "10.1.2.3" and raw["main_process_port"] == 29555
    args, _ = validated(folder / "accelerate_config.yaml", "--machine_rank", "1")
    env = prepare_multi_gpu_env(args)
    assert args.nnodes == "2" and args.node_rank == 1 and args.nproc_per_node == "8"
    # the launcher's own same_network default (False) overrides the YAML's: the address travels as the
    # rendezvous endpoint (the SLURM script passes --same_network explicitly)
    assert args.rdzv_endpoint == "10.1.2.3:29555" and args.rdzv_backend == "static"
    assert env["ACCELERATE_MIXED_PRECISION"] == "bf16"


def test_only_keys_accelerate_knows(plans):
    from accelerate.commands.config.config_args import ClusterConfig

    known = set(ClusterConfig.__dataclass_fields__)
    for _, folder in plans.values():
        assert set(yaml.safe_load((folder / "accelerate_config.yaml").read_text())) <= known


def _fake(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text("#!/bin/bash\n" + textwrap.dedent(body))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.mark.parametrize("name", ["multi-node", "multi-node-zero3"])
def test_slurm_script_launches_one_accelerate_per_node_with_its_rank(plans, tmp_path, name):
    plan, folder = plans[name]
    script = folder / "launch.slurm"
    assert os.access(script, os.X_OK)
    nodes = plan["cluster"]["nodes"]
    bin_dir, record = tmp_path / "bin", tmp_path / "record"
    bin_dir.mkdir()
    record.mkdir()
    # srun: run the task once per node with SLURM_NODEID set; scontrol: the allocation's host names;
    # accelerate: record its argv, one file per node.
    _fake(
        bin_dir,
        "srun",
        """
        while [[ "$1" == --* ]]; do
          case "$1" in --ntasks=*) n="${1#--ntasks=}";; esac; shift
        done
        for ((i = 0; i < n; i++)); do SLURM_NODEID=$i SLURM_PROCID=$i "$@" || exit 1; done
    """,
    )
    _fake(bin_dir, "scontrol", 'for i in $(seq 0 20); do echo "gpu-node-$i"; done\n')
    _fake(bin_dir, "accelerate", 'printf "%s\\0" "$@" > "$RECORD/node_$SLURM_NODEID"\n')
    env = dict(
        os.environ,
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        RECORD=str(record),
        SLURM_SUBMIT_DIR=str(folder),
        SLURM_JOB_NODELIST="gpu-node-[0-20]",
    )
    result = subprocess.run(
        ["bash", str(script), "--data-path", "/data/train", "--output-dir", "runs/x"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    expected_ip = plan["cluster"]["main_process_ip"] or "gpu-node-0"
    for rank in range(nodes):
        argv = (record / f"node_{rank}").read_text().split("\0")[:-1]
        assert argv[0] == "launch"
        args, _, _ = _validate_launch_command(launch_command_parser().parse_args(argv[1:]))
        assert args.machine_rank == rank
        assert args.num_machines == nodes and args.num_processes == plan["cluster"]["world_size"]
        assert args.main_process_ip == expected_ip
        assert args.main_process_port == plan["cluster"]["main_process_port"]
        assert Path(args.config_file) == folder / "accelerate_config.yaml"
        assert args.training_script == "dit_accel.train" and args.module
        assert args.training_script_args == [
            "--plan",
            str(folder / "plan.json"),
            "--resume",
            "auto",  # a requeued job continues (planner/slurm.py)
            "--data-path",
            "/data/train",
            "--output-dir",
            "runs/x",
        ]
    assert not (record / f"node_{nodes}").exists()
