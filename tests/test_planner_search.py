"""The choice: exact global batch, a budget that is respected, and a rule that is monotone in memory."""

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.decision import Cluster, Decision
from planner.errors import PlanError
from planner.hardware import Assumptions
from planner.memory import step_memory
from planner.plan import make_plan
from planner.search import (
    SearchSpace,
    choose,
    comm_bytes_per_gpu,
    comm_time_s,
    divisors,
    estimate_throughput,
    hsdp_comm_bytes_per_gpu,
    image_step_flops,
    leanest,
    search_path,
    sharding_levels,
    small_batch_efficiency,
)
from planner.spec import model_spec

GB = 10**9
SHARDING_ORDER = {"zero3": 0, "hsdp": 1, "zero2": 2, "ddp": 3}  # the search path's order (sharding_levels)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    gpus=st.integers(1, 16),
    nodes=st.integers(1, 4),
    global_batch=st.integers(1, 1024),
    vram_gb=st.integers(12, 160),
    model=st.sampled_from(["DiT-S/2", "DiT-B/4", "DiT-L/2", "DiT-XL/2"]),
    round_batch=st.booleans(),
)
def test_global_batch_is_exact_or_refused(gpus, nodes, global_batch, vram_gb, model, round_batch):
    world = gpus * nodes
    try:
        plan = make_plan(
            gpus=gpus,
            nodes=nodes,
            global_batch=global_batch,
            vram=f"{vram_gb}G",
            model=model,
            round_global_batch=round_batch,
        )
    except PlanError as error:
        message = str(error)
        if global_batch % world and not round_batch:
            assert "does not divide" in message
        else:
            assert "needs at least" in message  # the only other refusal: nothing fits
        return
    d = plan["decision"]
    assert d["micro_batch"] * d["grad_accum"] * plan["cluster"]["world_size"] == plan["global_batch"]
    assert plan["global_batch"] % world == 0
    if not round_batch:
        assert plan["global_batch"] == global_batch
    elif global_batch >= world:
        assert abs(plan["global_batch"] - global_batch) <= world // 2  # the nearest multiple
    else:
        assert plan["global_batch"] == world  # nothing below: the smallest valid batch
    # what must fit is the least the step runs in (the allocator releasing its cache), never above the peak
    assert plan["memory"]["needed_bytes"] <= min(plan["memory"]["peak_bytes"], plan["memory"]["budget_bytes"])
    for alternative in plan["alternatives"]:
        assert alternative["micro_batch"] * alternative["grad_accum"] * world == plan["global_batch"]
        assert alternative["needed_bytes"] <= min(alternative["peak_bytes"], plan["memory"]["budget_bytes"])


def test_non_divisible_global_batch_names_the_nearest_valid_ones():
    with pytest.raises(
        PlanError, match=r"does not divide by the 7 GPUs.*use 252 or 259, or pass --round-global-batch"
    ):
        make_plan(gpus=7, vram="80G", global_batch=256)
    plan = make_plan(gpus=7, vram="80G", global_batch=256, round_global_batch=True)
    assert plan["global_batch"] == 259 and any("rounded to 259" in w for w in plan["warnings"])
    with pytest.raises(PlanError, match="use 8, or pass"):
        make_plan(gpus=8, vram="80G", global_batch=5)


CASES = [
    dict(model="DiT-XL/2", resolution=256, gpus=8, global_batch=256),
    dict(model="DiT-XL/2", resolution=512, gpus=8, global_batch=256),
    dict(model="DiT-XL/2", resolution=256, gpus=1, global_batch=256),
    dict(model="DiT-B/2", resolution=256, gpus=2, global_batch=512),
    dict(model="DiT-L/4", resolution=512, gpus=4, global_batch=96, latents="online"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['model']}@{c['resolution']}x{c['gpus']}")
def test_more_vram_never_a_smaller_micro_batch_more_checkpointing_or_more_sharding(case):
    previous = None
    for vram_gb in range(6, 161, 2):
        try:
            plan = make_plan(vram=f"{vram_gb}G", **case)
        except PlanError as error:
            assert previous is None, f"{vram_gb} GB fails after a smaller budget fitted: {error}"
            continue
        d = plan["decision"]
        if previous is not None:
            assert d["micro_batch"] >= previous["micro_batch"], vram_gb
            assert d["checkpointed_blocks"] <= previous["checkpointed_blocks"], vram_gb
            assert SHARDING_ORDER[d["sharding"]] >= SHARDING_ORDER[previous["sharding"]], vram_gb
        previous = d
    assert previous is not None


def test_more_gpus_never_more_memory_per_gpu_for_the_same_step():
    """Sharded states shrink with the world; a DDP replica's do not grow (its buckets and NCCL arrive with
    the second GPU: the one step up, documented)."""
    spec, assumptions = model_spec("DiT-XL/2", 256), Assumptions()
    for sharding in ("ddp", "zero2", "zero3"):
        peaks = []
        for world in (2, 4, 8, 16, 32):
            decision = Decision(
                micro_batch=8,
                grad_accum=2,
                checkpointed_blocks=10,
                precision="bf16",
                sharding=sharding,
                latents="precomputed",
            )
            peaks.append(step_memory(spec, decision, Cluster(1, world, 80 * GB), assumptions).peak_bytes)
        assert peaks == sorted(peaks, reverse=True), sharding
        assert (peaks[0] > peaks[-1]) == (sharding != "ddp")


def test_more_gpus_never_raise_the_least_memory_needed():
    spec, assumptions = model_spec("DiT-XL/2", 512), Assumptions()
    space = SearchSpace(global_batch=256, precision="bf16", latents="precomputed", ema=True)
    needs = [
        leanest(spec, space, Cluster(1, world, 80 * GB), assumptions, 80 * GB).memory.peak_bytes
        for world in (2, 4, 8, 16, 32, 64)
    ]
    assert needs == sorted(needs, reverse=True) and needs[0] > needs[-1]
    # and a plan that fits on 8 GPUs still fits on 16
    small = make_plan(gpus=8, vram="16G", global_batch=256, resolution=512)
    large = make_plan(gpus=16, vram="16G", global_batch=256, resolution=512)
    assert large["memory"]["needed_bytes"] <= large["memory"]["budget_bytes"] and small


def test_the_decision_is_the_furthest_fitting_point_of_a_budget_free_path():
    spec, assumptions = model_spec("DiT-XL/2", 256), Assumptions()
    space = SearchSpace(global_batch=256, precision="bf16", latents="precomputed", ema=True)
    cluster = Cluster(1, 8, 40 * GB)
    path = search_path(spec, space, cluster, assumptions, 10 * GB)
    assert [c.decision for c in path] == [
        c.decision for c in search_path(spec, space, cluster, assumptions, 30 * GB)
    ]
    assert path[0].decision.sharding == "zero3" and path[0].decision.micro_batch == 1
    assert path[0].decision.checkpointed_blocks == spec.depth
    assert path[-1].decision.sharding == "ddp" and path[-1].decision.checkpointed_blocks == 0
    # a move may lower the peak (a larger micro-batch ends accumulation, so no grads live through the forward),
    # which is why the rule takes the furthest fitting point rather than the first that does not fit
    assert path[-1].memory.peak_bytes > path[0].memory.peak_bytes
    best, _ = choose(spec, space, cluster, assumptions, 20 * GB)
    fitting = [c for c in path if c.memory.peak_bytes <= 20 * GB]
    assert best.decision == fitting[-1].decision


def test_flags_pin_the_search():
    plan = make_plan(
        gpus=8, vram="80G", global_batch=256, checkpointing=5, sharding="zero2", max_micro_batch=8
    )
    d = plan["decision"]
    assert d["checkpointed_blocks"] == 5 and d["sharding"] == "zero2" and d["micro_batch"] <= 8
    assert (
        make_plan(gpus=8, vram="80G", global_batch=256, checkpointing="all")["decision"][
            "checkpointed_blocks"
        ]
        == 28
    )
    assert (
        make_plan(gpus=8, vram="80G", global_batch=256, precision="fp32")["decision"]["precision"] == "fp32"
    )
    assert make_plan(gpus=1, vram="80G", global_batch=64)["decision"]["sharding"] == "ddp"
    assert (
        make_plan(gpus=8, gpu="v100-32g", global_batch=256)["decision"]["precision"] == "fp16"
    )  # auto, no bf16


def test_nothing_fits_says_the_minimum_and_what_would():
    with pytest.raises(PlanError) as info:
        make_plan(gpus=1, vram="12G", global_batch=256, resolution=512)
    message = str(info.value)
    assert "needs at least" in message and "budget is" in message
    assert "--gpus 2" in message and "--gpu " in message and "--model DiT-L/2" in message
    assert "\n" not in message
    with pytest.raises(PlanError, match="relax them"):
        make_plan(gpus=8, vram="16G", global_batch=256, checkpointing="none", sharding="ddp", resolution=512)


def test_throughput_model_follows_its_documented_rule():
    spec, assumptions = model_spec("DiT-XL/2", 256), Assumptions()
    base = Decision(
        micro_batch=32,
        grad_accum=1,
        checkpointed_blocks=0,
        precision="bf16",
        sharding="ddp",
        latents="precomputed",
    )
    assert image_step_flops(spec, base) == 3 * spec.fwd_flops_per_image
    every = dataclasses.replace(base, checkpointed_blocks=spec.depth)
    assert image_step_flops(spec, every) / image_step_flops(spec, base) == pytest.approx(4 / 3, rel=0.01)
    assert small_batch_efficiency(spec, 2, assumptions) == pytest.approx(0.5)  # 512 tokens: half
    cluster = Cluster(1, 1, 80 * GB)
    one = estimate_throughput(spec, base, cluster, assumptions)
    assert one.exposed_comm_time_s == 0
    # the measured A100 bf16 MFU (presets/mfu.yaml) x small-batch efficiency, plus the fixed per-step cost:
    # 40 B per parameter (AdamW + EMA) over the A100 40GB's 1.555 TB/s and a 3 ms constant
    compute = 32 * 3 * spec.fwd_flops_per_image / (312e12 * 0.337 * (8192 / 8704))
    fixed = 0.003 + 40 * spec.params_trainable / 1.555e12
    assert one.fixed_time_s == pytest.approx(fixed, rel=1e-9)
    assert one.images_per_s == pytest.approx(32 / (compute + fixed), rel=1e-6)
    # fast-DiT's README: 0.84 steps/s (107 img/s) on one A100 at batch 128, every block checkpointed, fp16
    fast = dataclasses.replace(every, micro_batch=128, precision="fp16")
    assert estimate_throughput(spec, fast, cluster, assumptions).images_per_s == pytest.approx(107, rel=0.05)


def test_divisors():
    assert divisors(36) == [1, 2, 3, 4, 6, 9, 12, 18, 36]
    assert divisors(1) == [1]


# --- hsdp: zero3 inside each node, replicated across nodes ------------------------------------------------


def _decision(sharding: str, **changes) -> Decision:
    fields = dict(
        micro_batch=8,
        grad_accum=2,
        checkpointed_blocks=10,
        precision="bf16",
        sharding=sharding,
        latents="precomputed",
    )
    return Decision(**{**fields, **changes})


def test_hsdp_memory_is_zero3_over_one_nodes_gpus():
    """hsdp's states are sharded over the GPUs of one node, not the world: on 4 nodes of 8 each GPU holds what
    zero3 on one node of 8 holds (the same per-GPU step), and more than zero3 over all 32."""
    spec, assumptions = model_spec("DiT-XL/2", 256), Assumptions()
    hsdp = step_memory(spec, _decision("hsdp"), Cluster(4, 8, 80 * GB), assumptions)
    one_node = step_memory(spec, _decision("zero3"), Cluster(1, 8, 80 * GB), assumptions)
    world = step_memory(spec, _decision("zero3"), Cluster(4, 8, 80 * GB), assumptions)
    assert hsdp.phases == one_node.phases and hsdp.peak_bytes == one_node.peak_bytes
    for state in ("weights", "grads", "optimizer", "ema"):
        assert hsdp.phases["optimizer_step"][state] > world.phases["optimizer_step"][state], state
    assert (
        hsdp.phases["optimizer_step"]["optimizer"] == 8 * spec.params_trainable // 8
    )  # AdamW: 8 B/param, 1/8


def test_hsdp_communication_splits_inside_and_across_nodes():
    spec = model_spec("DiT-XL/2", 256)
    params, cluster = spec.params_trainable, Cluster(4, 8, 80 * GB)
    inside, across = hsdp_comm_bytes_per_gpu(spec, _decision("hsdp", grad_accum=1), cluster)
    # bf16: zero3's 3 collectives over the node's 8 GPUs; an all-reduce of the 1/8 shard over the 4 nodes
    assert inside == pytest.approx(3 * 7 / 8 * 2 * params)
    assert across == pytest.approx(2 * 3 / 4 * 2 * params / 8)
    assert comm_bytes_per_gpu(spec, _decision("hsdp", grad_accum=1), cluster) == pytest.approx(
        inside + across
    )
    # every micro-step (sync_each_batch)
    assert hsdp_comm_bytes_per_gpu(spec, _decision("hsdp", grad_accum=3), cluster) == pytest.approx(
        (3 * inside, 3 * across)
    )
    # each part at the bandwidth of the links it crosses; with both links equally fast hsdp is still faster
    # than zero3 over all GPUs (the same collectives, fewer bytes across the nodes)
    slow = Assumptions(inter_node_busbw_bytes_per_s=25e9, intra_node_busbw_bytes_per_s=200e9)
    assert comm_time_s(spec, _decision("hsdp"), cluster, slow) == pytest.approx(
        2 * (inside / 200e9 + across / 25e9)
    )
    flat = Assumptions(inter_node_busbw_bytes_per_s=200e9, intra_node_busbw_bytes_per_s=200e9)
    for assumptions in (slow, flat):
        assert comm_time_s(spec, _decision("hsdp"), cluster, assumptions) < comm_time_s(
            spec, _decision("zero3"), cluster, assumptions
        )


def test_hsdp_is_a_level_only_on_several_nodes_of_several_gpus():
    space = SearchSpace(global_batch=256, precision="bf16", latents="precomputed", ema=True)
    assert sharding_levels(space, Cluster(2, 8, 80 * GB)) == ["zero3", "hsdp", "zero2", "ddp"]
    assert sharding_levels(space, Cluster(1, 8, 80 * GB)) == ["zero3", "zero2", "ddp"]
    assert sharding_levels(space, Cluster(4, 1, 80 * GB)) == ["zero3", "zero2", "ddp"]  # nothing in a node
    pinned = dataclasses.replace(space, sharding="hsdp")
    assert sharding_levels(pinned, Cluster(2, 8, 80 * GB)) == ["hsdp"]
    for cluster in (Cluster(1, 8, 80 * GB), Cluster(4, 1, 80 * GB)):
        with pytest.raises(PlanError, match="--sharding hsdp shards inside a node") as error:
            sharding_levels(pinned, cluster)
        assert "\n" not in str(error.value) and "--sharding zero3" in str(error.value)


def test_the_comm_model_picks_hsdp_across_slow_links_only():
    """DiT-XL/2 on 2 nodes of 8 A100 40GB: across 200 Gb/s links (25 GB/s per GPU, the default) hsdp beats
    zero2/zero3 (their collectives cross the nodes every micro-step) and DDP (its fp32 all-reduce crosses them
    whole); with fast links zero2 sends fewer bytes and wins; one node never plans hsdp."""
    slow = make_plan(gpus=8, nodes=2, gpu="a100-40g", global_batch=256)
    assert slow["decision"]["sharding"] == "hsdp"
    fast = make_plan(
        gpus=8, nodes=2, gpu="a100-40g", global_batch=256, assumptions={"inter_node_busbw_bytes_per_s": 400e9}
    )
    assert fast["decision"]["sharding"] in ("zero2", "ddp")
    assert fast["throughput"]["est_images_per_s"] > slow["throughput"]["est_images_per_s"]
    one_node = make_plan(
        gpus=8, gpu="a100-40g", global_batch=256, assumptions={"inter_node_busbw_bytes_per_s": 1e9}
    )
    assert one_node["decision"]["sharding"] != "hsdp"
    assert all(a["sharding"] != "hsdp" for a in one_node["alternatives"])
