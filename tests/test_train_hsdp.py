"""hsdp plans (FSDP2 on a 2-D device mesh: shard inside a node, replicate across nodes) on the CPU: a plan for
2 nodes of 2 GPUs, launched as 4 real processes over gloo on this one machine (`--num_machines 1`: torchrun
numbers the ranks node by node, so ranks 0-1 are "node 0" and 2-3 "node 1", as on two machines), compared with
one process training the same global batch of the same samples; then an exact resume of the hsdp run.

gloo runs every collective FSDP2's HSDP issues on the CPU as it is, nothing emulated: the all-gather and the
reduce-scatter inside each shard group (`reduce_scatter_tensor`) and the all-reduce of the gradient shards
across the replicas.
"""

import json
from pathlib import Path

import pytest
import torch
from equivalence import layout_atol
from safetensors.torch import load_file
from test_train_e2e import run_in_process
from test_train_fsdp import LR, TINY, _assert_close, _dcp, _finish, _losses, _weights
from test_train_fsdp import _start as start_launch

from dit_accel.errors import UserError
from dit_accel.run import checkpoint as ckpt

NODES, GPUS_PER_NODE = 2, 2
CLUSTER = ["--nodes", str(NODES), "--gpus-per-node", str(GPUS_PER_NODE)]
STEPS = 4
QUIET = [
    "--num-workers",
    "0",
    "--no-progress-bar",
    "--log-every",
    "1",
    "--lr",
    str(LR),
    "--grad-clip",  # clipping on the 2-D mesh: the norm is reduced over both dimensions
    "0.5",
    "--no-tensorboard",
    "--max-steps",
    str(STEPS),
    "--checkpoint-every",
    "2",
    "--keep-last",
    "2",
]

# The trainer, launched through this, records after build_components (the model sharded and prepared) the
# device mesh and placements of one block parameter and one root-unit parameter, per rank.
MESH_PROBE = """
import json, os, sys
from pathlib import Path
import dit_accel.train.step as step
import dit_accel.train.loop as train
build_components = step.build_components

def build_and_record(*args, **kwargs):
    components = build_components(*args, **kwargs)
    params = dict(components.raw_model.named_parameters())
    record = {}
    for name in ("transformer_blocks.0.attn1.to_q.weight", "proj_out_2.weight"):
        param = params[name]
        record[name] = {"mesh": param.device_mesh.mesh.tolist(), "dims": list(param.device_mesh.mesh_dim_names),
                        "placements": [str(p) for p in param.placements], "local": list(param.to_local().shape),
                        "full": list(param.shape)}
    rank = os.environ.get("RANK", "0")
    Path(__file__).with_name(f"mesh_rank{rank}.json").write_text(json.dumps(record))
    return components

step.build_components = build_and_record  # train() imports it when it runs
sys.exit(train.main(sys.argv[1:]))
"""


def _plan(out: Path, sharding: str, cluster=CLUSTER) -> Path:
    from planner.cli import main as dit_plan

    args = [*TINY[: TINY.index("--gpus")], *cluster, *TINY[TINY.index("--vram") :]]
    assert dit_plan([*args, "--sharding", sharding, "--precision", "fp32", "--out", str(out)]) == 0
    return out


def _start(plan_dir: Path, images: Path, out: Path, *args, program=("-m", "dit_accel.train")):
    """`accelerate launch` with the plan's own config, its 2 machines run as 4 processes here."""
    return start_launch(
        plan_dir,
        images,
        out,
        *args,
        program=program,
        processes=NODES * GPUS_PER_NODE,
        launcher=("--num_machines", "1", "--main_process_ip", "127.0.0.1"),
        quiet=QUIET,
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The hsdp run (4 processes), and beside it the one-process reference in this process (the same global
    batch of the same samples: tests/test_train_e2e.py holds DDP over 2 processes equal to it); then hsdp
    resumed from step 2."""
    from dit_accel.data.demo import write_demo_data

    root = tmp_path_factory.mktemp("hsdp")
    images = root / "images"
    write_demo_data(images, classes=4, per_class=8, resolution=32, seed=0)
    plans = {
        "hsdp": _plan(root / "plan_hsdp", "hsdp"),
        "one": _plan(root / "plan_one", "ddp", ["--gpus", "1"]),
    }
    probe = root / "mesh_probe.py"
    probe.write_text(MESH_PROBE)
    started = _start(plans["hsdp"], images, root / "run_hsdp", program=(str(probe),))
    argv = ["--plan", plans["one"] / "plan.json", "--data-path", images, "--output-dir", root / "run_one"]
    assert run_in_process([*argv, *QUIET]) == 0
    out = {"one": root / "run_one", "hsdp": _finish(started)}
    out["hsdp_resumed"] = _finish(
        _start(
            plans["hsdp"],
            images,
            root / "run_hsdp_resumed",
            "--resume",
            out["hsdp"] / "checkpoints" / "step_00000002",
        )
    )
    out["plans"], out["root"] = plans, root
    return out


@pytest.mark.launched
def test_the_hsdp_run_shards_blocks_and_root_over_the_2d_mesh(runs):
    plan = json.loads((runs["plans"]["hsdp"] / "plan.json").read_text())
    assert plan["decision"]["sharding"] == "hsdp" and plan["cluster"]["nodes"] == NODES
    assert (
        "sharded hsdp (FSDP2, reshard after forward: True)"
        in (runs["hsdp"] / "logs" / "rank0.log").read_text()
    )
    for rank in range(NODES * GPUS_PER_NODE):
        record = json.loads((runs["root"] / f"mesh_rank{rank}.json").read_text())
        for name, layout in record.items():  # a block's unit and the root unit: the same 2-D mesh
            assert layout["mesh"] == [[0, 1], [2, 3]], (rank, name, layout)
            assert layout["dims"] == ["dp_replicate", "dp_shard_cp"], (rank, name, layout)
            assert layout["placements"] == ["R", "S(0)"], (rank, name, layout)  # replicated x sharded
            assert layout["local"][0] == -(-layout["full"][0] // GPUS_PER_NODE), (rank, name, layout)


@pytest.mark.launched
def test_the_hsdp_run_trains_and_equals_the_one_process_update(runs):
    one, hsdp = runs["one"], runs["hsdp"]
    plan = json.loads((runs["plans"]["one"] / "plan.json").read_text())
    assert plan["cluster"]["world_size"] == 1 and plan["global_batch"] == 8
    losses = _losses(hsdp)
    assert len(losses) == STEPS and losses[-1] < losses[0] - 0.03
    assert losses == pytest.approx(_losses(one), abs=1e-5)  # the same samples, noise and timesteps
    # 4 ranks sum the gradient in another order than one process does (tests/equivalence.py)
    final, atol = "checkpoints/step_00000004", layout_atol(LR, STEPS)
    _assert_close(_weights(hsdp / final), _weights(one / final), atol, "hsdp weights", layouts_differ=True)
    ema, one_ema = (load_file(str(run / final / ckpt.EMA_WEIGHTS)) for run in (hsdp, one))
    assert all(t.dtype == torch.float32 for t in ema.values())
    _assert_close(ema, one_ema, atol, "hsdp EMA", layouts_differ=True)
    assert (hsdp / final / ckpt.SHARDED_MODEL).is_dir() and not (hsdp / final / ckpt.MODEL_WEIGHTS).exists()


@pytest.mark.launched
def test_hsdp_resume_is_bit_identical(runs):
    straight, resumed = (runs[name] / "checkpoints" / "step_00000004" for name in ("hsdp", "hsdp_resumed"))
    assert "resumed from" in (runs["hsdp_resumed"] / "logs" / "rank0.log").read_text()
    for folder in (ckpt.SHARDED_MODEL, "optimizer_0"):
        a, b = _dcp(straight / folder), _dcp(resumed / folder)
        assert a.keys() == b.keys() and a
        differing = [
            k for k in a if not (torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k])
        ]
        assert not differing, f"{folder}: {differing[:3]}"
    a, b = load_file(str(straight / ckpt.EMA_WEIGHTS)), load_file(str(resumed / ckpt.EMA_WEIGHTS))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert ckpt.read_train_state(resumed)["step"] == STEPS


# --- in-process: the launch environment the hsdp YAML makes ------------------------------------------------


def test_the_hsdp_yaml_launches_the_planned_mesh(tmp_path, monkeypatch):
    """accelerate's launcher turns the YAML's parallelism_config into the variables its Accelerator builds a
    ParallelismConfig from; the trainer accepts them and builds its own from the plan, of the same sizes."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    from dit_accel.distributed.accelerator import fsdp_plugin_for, parallelism_config_for
    from planner.planfile import read_plan

    plan_dir = _plan(tmp_path / "hsdp", "hsdp")
    plan = read_plan(plan_dir / "plan.json")
    argv = ["--config_file", str(plan_dir / "accelerate_config.yaml"), "--main_process_ip", "10.0.0.1"]
    args, _, _ = _validate_launch_command(
        launch_command_parser().parse_args([*argv, "-m", "dit_accel.train"])
    )
    env = {
        **{
            k: v
            for k, v in prepare_multi_gpu_env(args).items()
            if k.startswith(("FSDP_", "ACCELERATE_", "PARAL"))
        },
        "WORLD_SIZE": "4",
    }
    assert env["ACCELERATE_USE_PARALLELISM_CONFIG"] == "true"
    assert (env["PARALLELISM_CONFIG_DP_REPLICATE_SIZE"], env["PARALLELISM_CONFIG_DP_SHARD_SIZE"]) == (
        "2",
        "2",
    )
    for name, value in env.items():  # the plugin reads the launcher's FSDP_* variables from os.environ
        monkeypatch.setenv(name, value)
    plugin = fsdp_plugin_for(plan, "plan.json")
    assert (
        plugin.fsdp_version == 2 and plugin.reshard_after_forward is True and plugin.auto_wrap_policy is None
    )
    config = parallelism_config_for(plan)
    assert (config.dp_replicate_size, config.dp_shard_size, config.total_size) == (2, 2, 4)
    assert config.fsdp_dim_names == ["dp_replicate", "dp_shard_cp"]
    assert parallelism_config_for(plan, empty=True).total_size == 1
    # a mesh of one shard group over the 4 ranks would be zero3: refused with the plan's sizes
    with pytest.raises(UserError, match="parallelism_config_dp_replicate_size is 1, the plan's hsdp needs 2"):
        fsdp_plugin_for(
            plan,
            "plan.json",
            {**env, "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "1", "PARALLELISM_CONFIG_DP_SHARD_SIZE": "4"},
        )


def test_a_plan_file_of_hsdp_on_one_node_is_refused(tmp_path):
    """plan.json read back: hsdp needs its mesh, several nodes of several GPUs; a hand-edited one-node plan
    stops in one line before anything starts."""
    from planner.errors import PlanError
    from planner.planfile import parse_plan

    plan = json.loads((_plan(tmp_path / "hsdp", "hsdp") / "plan.json").read_text())
    assert parse_plan(plan).sharding.within_node
    plan["cluster"].update(nodes=1, gpus_per_node=4)
    with pytest.raises(
        PlanError, match="decision.sharding hsdp needs several nodes of several GPUs"
    ) as error:
        parse_plan(plan)
    assert "\n" not in str(error.value)
