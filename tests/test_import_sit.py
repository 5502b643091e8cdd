"""import-sit and import-repa: an imported network computes what the network in its original layout computes
(the plain-torch DiT of tests/test_model.py, on a random state dict saved here), in dit-accel's flow time."""

from __future__ import annotations

import pytest
import torch
from test_model import original_state_dict, reference_dit_forward

from dit_accel.convert.export import main as export_main
from dit_accel.convert.imports import import_repa_main, import_sit_main
from dit_accel.models.dit import as_model_fn
from dit_accel.models.original_sit import time_reversal_matrix
from dit_accel.run.weights import load_for_inference, recorded_objective
from dit_accel.sample.generate import sampler_for

X = torch.randn(3, 4, 8, 8, generator=torch.Generator().manual_seed(3))
T = torch.tensor([0.05, 0.5, 0.93])  # dit-accel's time: 0 data, 1 noise
Y = torch.tensor([1, 7, 10])  # 10: the null class


def imported(tmp_path, command, checkpoint) -> tuple[torch.nn.Module, str]:
    torch.save(checkpoint, tmp_path / "original.pt")
    run = tmp_path / "run"
    assert command(["--checkpoint", str(tmp_path / "original.pt"), "--out", str(run), "--heads", "4"]) == 0
    model, _spec, _info = load_for_inference(run)
    return model, run


def test_the_time_reversal_matrix_maps_the_features_of_t_to_those_of_1_minus_t():
    from test_model import original_timestep_features

    t = torch.tensor([0.0, 0.25, 0.8, 1.0], dtype=torch.float64)
    reversed_features = original_timestep_features(1 - t).double()
    torch.testing.assert_close(
        original_timestep_features(t).double() @ time_reversal_matrix().T,
        reversed_features,
        atol=1e-6,
        rtol=0,
    )


def test_an_imported_sit_network_is_sits_network_in_dit_accel_time(tmp_path, capsys):
    sd = original_state_dict(out_channels=8)  # SiT keeps DiT's learned-sigma half (and drops it in forward)
    model, run = imported(tmp_path, import_sit_main, sd)
    assert "time reversed" in capsys.readouterr().out
    with torch.no_grad():
        ours = as_model_fn(model)(X, T, Y)
        sit = reference_dit_forward(sd, X, 1 - T, Y, heads=4)  # SiT's time runs from noise (0) to data (1)
    torch.testing.assert_close(ours[:, :4], -sit[:, :4], atol=1e-4, rtol=1e-4)  # SiT's velocity is d/dt_SiT
    torch.testing.assert_close(ours[:, 4:], sit[:, 4:], atol=1e-4, rtol=1e-4)  # the unused half, unchanged
    assert recorded_objective(run / "checkpoints" / "step_00000000")["name"] == "flow"
    import json  # the run's placeholder plan says flow too, so fine-tuning plans from it agree

    for plan in (run / "plan.json", run / "checkpoints" / "step_00000000" / "plan.json"):
        assert json.loads(plan.read_text())["objective"] == "flow"
    _a_ddpm_run_refuses_to_start_from_it(run)
    assert sampler_for(recorded_objective(run), None) == "ode"
    assert (
        export_main(["--checkpoint", str(run), "--out", str(tmp_path / "pipe")]) == 2
    )  # no DiTPipeline form
    assert "flow model" in capsys.readouterr().err and not (tmp_path / "pipe").exists()


def test_an_imported_repa_network_is_repas_network_with_a_zero_sigma_half(tmp_path, capsys):
    g = torch.Generator().manual_seed(5)
    ema = original_state_dict(out_channels=4, seed=1)  # REPA's SiT outputs C channels
    ema.update({f"projectors.0.{i}.weight": torch.randn(16, 16, generator=g) for i in (0, 2, 4)})
    raw = original_state_dict(out_channels=4, seed=2)
    model, run = imported(tmp_path, import_repa_main, {"model": raw, "ema": ema})  # REPA's last.pt holds both
    out = capsys.readouterr().out
    assert "projector (3 tensors) left out" in out and "zero learned-sigma half" in out
    with torch.no_grad():
        ours = as_model_fn(model)(X, T, Y)
        repa = reference_dit_forward(ema, X, T, Y, heads=4)  # REPA's time is dit-accel's
    torch.testing.assert_close(ours[:, :4], repa, atol=1e-4, rtol=1e-4)
    assert torch.count_nonzero(ours[:, 4:]) == 0
    assert recorded_objective(run)["name"] == "flow"


def _a_ddpm_run_refuses_to_start_from_it(run):
    """--init-from a flow model into a ddpm plan: its output is a velocity, not a noise; refused in one line."""
    import dataclasses

    from dit_accel.errors import UserError
    from dit_accel.train.config import TrainConfig
    from dit_accel.train.resume import read_init_weights
    from dit_accel.train.step import build_components
    from planner.planfile import read_plan

    plan = read_plan(run / "plan.json")
    init = read_init_weights(str(run), plan.spec(), use_ema=True)
    assert init.objective == "flow"
    config = TrainConfig(plan="p", output_dir="o", latents="l")
    with pytest.raises(
        UserError, match="holds a flow model but this run trains ddpm.*dit-plan --objective flow"
    ):
        build_components(dataclasses.replace(plan, objective="ddpm"), config, device="cpu", init=init)
    build_components(plan, TrainConfig(plan="p", output_dir="o", latents="l"), device="cpu", init=init)


@pytest.mark.parametrize(("command", "repository"), [(import_sit_main, "SiT"), (import_repa_main, "REPA")])
def test_a_partial_sit_or_repa_state_dict_is_one_line_naming_its_repository(
    command, repository, tmp_path, capsys
):
    """A truncated save used to reach the time fold's `state["final_layer.linear.weight"]`: a KeyError traceback."""
    partial = original_state_dict(out_channels=8)
    del partial["final_layer.linear.weight"], partial["blocks.1.mlp.fc2.bias"]
    torch.save(partial, tmp_path / "partial.pt")
    argv = ["--checkpoint", str(tmp_path / "partial.pt"), "--out", str(tmp_path / "run"), "--heads", "4"]
    assert command(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1
        and f"the {repository} checkpoint is incomplete: it lacks final_layer.linear.weight" in err[0]
    )
    assert f"of the {repository} repository" in err[0] and "original DiT" not in err[0]
    assert not (tmp_path / "run").exists()
