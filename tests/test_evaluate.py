"""FID, sFID, Inception Score, precision and recall (dit_accel.evaluate).

The arithmetic is held to independent computations with known answers: Gaussians whose Fréchet distance
has a closed form, a matrix square root by Denman-Beavers iteration, hand-worked Inception Scores and k-NN
manifolds, a brute-force k-NN in float64."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from ports import launch_port
from teardown_probe import SCRIPT, teardowns
from test_sample import fresh_accelerate_state

from dit_accel.evaluate import metrics

# --- Fréchet distance -------------------------------------------------------------------------------------


def _random_rotation(dimension: int, rng) -> np.ndarray:
    q, r = np.linalg.qr(rng.normal(size=(dimension, dimension)))
    return q * np.sign(np.diag(r))


def test_frechet_distance_of_commuting_gaussians_is_the_closed_form():
    """Shared eigenvectors R: |mu1 - mu2|^2 + sum_i (sqrt(a_i) - sqrt(b_i))^2."""
    rng = np.random.default_rng(0)
    rotation = _random_rotation(6, rng)
    a, b = rng.uniform(0.1, 4, 6), rng.uniform(0.1, 4, 6)
    mu1, mu2 = rng.normal(size=6), rng.normal(size=6)
    first = metrics.Statistics(mu1, rotation @ np.diag(a) @ rotation.T)
    second = metrics.Statistics(mu2, rotation @ np.diag(b) @ rotation.T)
    expected = np.sum((mu1 - mu2) ** 2) + np.sum((np.sqrt(a) - np.sqrt(b)) ** 2)
    assert metrics.frechet_distance(first, second) == pytest.approx(expected, rel=1e-10)
    assert metrics.frechet_distance(first, first) == pytest.approx(0, abs=1e-10)


def _denman_beavers_sqrt(matrix: np.ndarray, iterations: int = 60) -> np.ndarray:
    y, z = matrix.copy(), np.eye(len(matrix))
    for _ in range(iterations):
        y, z = (y + np.linalg.inv(z)) / 2, (z + np.linalg.inv(y)) / 2
    return y


def test_trace_of_the_square_root_of_a_non_symmetric_product_matches_an_iterative_square_root():
    rng = np.random.default_rng(1)
    a, b = rng.normal(size=(5, 5)), rng.normal(size=(5, 5))
    sigma1, sigma2 = a @ a.T + 0.1 * np.eye(5), b @ b.T + 0.1 * np.eye(5)
    root = _denman_beavers_sqrt(sigma1 @ sigma2)
    np.testing.assert_allclose(root @ root, sigma1 @ sigma2, rtol=1e-8)
    first, second = metrics.Statistics(np.zeros(5), sigma1), metrics.Statistics(np.zeros(5), sigma2)
    assert metrics.trace_sqrt_product(first, second) == pytest.approx(np.trace(root), rel=1e-9)


def test_fewer_samples_than_features_take_the_small_route_to_the_same_distance():
    rng = np.random.default_rng(5)
    few = metrics.statistics(rng.normal(size=(6, 40)))
    many = metrics.statistics(rng.normal(1.0, 2.0, size=(500, 40)))
    assert few.factor is not None and many.factor is None
    full = metrics.Statistics(few.mu, few.sigma)  # no factor: the D x D route
    # the D x D route takes square roots of 34 round-off eigenvalues (~1e-16 each) of the singular S1
    expected = metrics.frechet_distance(full, many)
    assert metrics.frechet_distance(few, many) == pytest.approx(expected, rel=1e-7)
    assert metrics.frechet_distance(many, few) == pytest.approx(expected, rel=1e-7)


def test_a_singular_covariance_is_no_failure():
    """Fewer samples than dimensions (a tiny eval during training) gives a rank-deficient covariance."""
    rng = np.random.default_rng(2)
    few = metrics.statistics(rng.normal(size=(4, 10)))
    many = metrics.statistics(rng.normal(size=(400, 10)))
    assert np.linalg.matrix_rank(few.sigma) == 3
    assert math.isfinite(metrics.frechet_distance(few, many)) and metrics.frechet_distance(few, many) > 0


def test_statistics_are_the_mean_and_the_unbiased_covariance():
    stats = metrics.statistics(np.array([[0.0, 1.0], [2.0, 1.0], [4.0, 4.0]]))
    np.testing.assert_allclose(stats.mu, [2.0, 2.0])
    # deviations (-2,-1), (0,-1), (2,2): sums of products over N - 1 = 2
    np.testing.assert_allclose(stats.sigma, [[4.0, 3.0], [3.0, 3.0]])


def test_sampled_gaussians_approach_their_closed_form_distance():
    rng = np.random.default_rng(3)
    first = rng.normal(0.0, 1.0, size=(20000, 3))
    second = rng.normal(1.0, 2.0, size=(20000, 3))
    expected = 3 * 1.0**2 + 3 * (1.0 - 2.0) ** 2  # mean shift 1 per axis, standard deviations 1 and 2
    measured = metrics.frechet_distance(metrics.statistics(first), metrics.statistics(second))
    assert measured == pytest.approx(expected, rel=0.05)


# --- Inception Score --------------------------------------------------------------------------------------


def test_inception_score_of_hand_worked_softmaxes():
    # p1 = (1/2, 1/2), p2 = (1, 0): marginal (3/4, 1/4); KL1 = 1/2 ln(4/3), KL2 = ln(4/3)
    two = np.array([[0.5, 0.5], [1.0, 0.0]])
    assert metrics.inception_score(two) == pytest.approx((4 / 3) ** 0.75, rel=1e-12)
    confident_and_diverse = np.eye(4)[np.arange(100) % 4]
    assert metrics.inception_score(confident_and_diverse) == pytest.approx(4.0)
    assert metrics.inception_score(np.full((10, 7), 1 / 7)) == pytest.approx(1.0)


def test_inception_score_averages_consecutive_splits_of_5000():
    """10,000 samples: the first split scores 4 (one-hot, balanced), the second 1 (all alike): mean 2.5."""
    first = np.eye(4)[np.arange(5000) % 4]
    second = np.tile([0.7, 0.1, 0.1, 0.1], (5000, 1))
    assert metrics.inception_score(np.concatenate([first, second])) == pytest.approx(2.5)
    assert metrics.inception_score(np.concatenate([second, first])) == pytest.approx(2.5)
    assert metrics.inception_score(np.concatenate([first, second]), split_size=10000) < 2.5


def test_softmax_of_logits():
    probabilities = metrics.softmax(np.array([[0.0, math.log(3.0)], [1000.0, 1000.0]]))
    np.testing.assert_allclose(probabilities, [[0.25, 0.75], [0.5, 0.5]])


# --- precision and recall ---------------------------------------------------------------------------------


def test_precision_and_recall_of_hand_worked_manifolds():
    """1-D points, squared distances, k = 3 (the point itself, at 0, not counted)."""
    reference = torch.tensor([[0.0], [1.0], [2.0], [3.0], [10.0]])
    samples = torch.tensor([[2.5], [5.0], [20.0], [21.0], [22.0]])
    # reference's 3rd nearest: 0 -> 3 (9); 1 -> 3 (4); 2 -> 0 (4); 3 -> 0 (9); 10 -> 1 (81)
    np.testing.assert_allclose(metrics.manifold_radii(reference).numpy(), [9, 4, 4, 9, 81])
    # samples' 3rd nearest: 2.5 -> 21 (342.25); 5 -> 21 (256); 20 -> 5 (225); 21 -> 5 (256); 22 -> 5 (289)
    np.testing.assert_allclose(metrics.manifold_radii(samples).numpy(), [342.25, 256, 225, 256, 289])
    # precision: 2.5 (within 4 of 1 and 2), 5 (4 from 3, within its 9), 20, 21, 22 none (10 is 100 away > 81): 2 of 5
    # recall: every reference lies within 342.25 of 2.5: 5 of 5
    assert metrics.precision_recall(reference, samples) == (pytest.approx(0.4), pytest.approx(1.0))


def _brute_force_precision_recall(reference: np.ndarray, samples: np.ndarray, k: int):
    def radii(points):
        return np.sort(((points[:, None] - points[None]) ** 2).sum(-1), axis=1)[:, k]

    def share_inside(points, manifold, manifold_radii):
        distances = ((points[:, None] - manifold[None]) ** 2).sum(-1)
        return (distances <= manifold_radii[None]).any(axis=1).mean()

    return share_inside(samples, reference, radii(reference)), share_inside(
        reference, samples, radii(samples)
    )


@pytest.mark.parametrize("block", [7, 10000])
def test_precision_and_recall_match_a_brute_force_knn_for_any_block_size(block):
    """Small integer features: every squared distance is exact in float16, so the answers are equal."""
    rng = np.random.default_rng(4)
    reference = rng.integers(0, 4, size=(40, 8)).astype(np.float32)
    samples = (rng.integers(0, 4, size=(30, 8)) + rng.integers(0, 2, size=(30, 8))).astype(np.float32)
    expected = _brute_force_precision_recall(reference.astype(np.float64), samples.astype(np.float64), k=3)
    precision, recall = metrics.precision_recall(reference, samples, block=block)
    assert (precision, recall) == pytest.approx(expected, abs=1e-12)
    assert 0 < precision < 1 and 0 < recall < 1


def test_squared_distances_fall_back_to_float32_when_float16_overflows():
    far = torch.tensor([[300.0, 0.0]])
    distances = metrics.squared_distances(far, torch.zeros(1, 2))
    assert distances.dtype == torch.float32 and distances.item() == 90000.0


# --- the network -------------------------------------------------------------------------------------------


def test_tf1_resize_reads_position_i_times_in_over_out_without_half_pixel_centres():
    from dit_accel.evaluate.inception import resize_like_tf1

    row = torch.tensor([[[[10.0, 20.0]]]])  # 1 x 1 x 1 x 2 -> width 4: positions 0, 0.5, 1, 1.5 (clamped)
    np.testing.assert_allclose(resize_like_tf1(row, 4)[..., 0, :].flatten().numpy(), [10, 15, 20, 20][:4])
    square = torch.arange(9.0).view(1, 1, 3, 3)
    assert torch.equal(resize_like_tf1(square, 3), square)
    # 3 -> 2: positions 0 and 1.5 along both axes
    np.testing.assert_allclose(resize_like_tf1(square, 2)[0, 0].numpy(), [[0.0, 1.5], [4.5, 6.0]])


# torch-fidelity's FeatureExtractorInceptionV3 (its source at commit 5e211a9): the sha256 of its state dict's
# sorted "name shape dtype" lines, its tensor count and its element count, recorded once from that module
# (docs/evaluation.md: the same random weights gave bit-identical features in both networks).
TORCH_FIDELITY_LAYOUT = ("928ac4362eaf1dd51cd1dba587554736ca4639309f446436ea83fa2721257cf5", 566, 23_885_486)


def test_the_network_has_the_state_dict_layout_of_torch_fidelitys_inception():
    """The published weight file is torch-fidelity's module's state dict: the same names, shapes and dtypes."""
    import hashlib

    from dit_accel.evaluate.inception import InceptionV3

    state = InceptionV3(299).state_dict()
    lines = "\n".join(f"{name} {tuple(t.shape)} {t.dtype}" for name, t in sorted(state.items()))
    layout = (hashlib.sha256(lines.encode()).hexdigest(), len(state), sum(t.numel() for t in state.values()))
    assert layout == TORCH_FIDELITY_LAYOUT


EVAL_PX = 75  # the least Inception-v3 takes; the graph's 299 would make these tests 16 times slower


def _fitted_random_inception(images: np.ndarray):
    """A randomly initialised network whose BatchNorm statistics are those of `images` (one forward in
    training mode with a cumulative average), so that its features are of order 1, not vanishing."""
    from dit_accel.evaluate.inception import InceptionV3

    torch.manual_seed(0)
    network = InceptionV3(EVAL_PX)
    for module in network.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.momentum = None
    with torch.no_grad():
        network.train()(torch.as_tensor(images))
    return network.eval()


def _blobs(count: int, seed: int, px: int = 32) -> np.ndarray:
    """Smooth coloured images: a bright disc of random place, size and colour on a dark background."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[:px, :px]
    images = np.zeros((count, px, px, 3), dtype=np.uint8)
    for image in images:
        cy, cx, radius = rng.uniform(8, px - 8, 2).tolist() + [rng.uniform(4, 10)]
        inside = (y - cy) ** 2 + (x - cx) ** 2 <= radius**2
        image[inside] = rng.integers(128, 256, 3)
        image[~inside] = rng.integers(0, 64, 3)
    return images


@pytest.fixture(scope="module")
def evaluation(tmp_path_factory):
    """Weights in the published file's layout, a reference batch and a sample batch."""
    root = tmp_path_factory.mktemp("evaluate")
    reference = _blobs(12, seed=1)
    torch.save(_fitted_random_inception(reference).state_dict(), root / "inception.pth")
    np.savez(root / "reference.npz", reference)
    np.savez(root / "alike.npz", _blobs(10, seed=2), np.arange(10))  # arr_1: labels, as sample writes
    np.savez(root / "reference16.npz", _blobs(12, seed=1, px=16))  # at the 16 px of `tiny_run`'s samples
    return root


def _evaluate(root, samples: str, *extra, out: str = "results.json", cache=None):
    from dit_accel.evaluate.command import main

    argv = ["--samples", str(root / samples), "--reference", str(root / "reference.npz")]
    argv += ["--inception-weights", str(root / "inception.pth"), "--cache-dir", str(cache or root / "cache")]
    argv += ["--input-px", str(EVAL_PX), "--batch-size", "4", "--out", str(root / out), *extra]
    return main(argv)


@pytest.fixture(scope="module")
def alike_scores(evaluation):
    """One run of the command: its output and its JSON (the reference's statistics are cached by it)."""
    import contextlib
    import io
    import json

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert _evaluate(evaluation, "alike.npz", out="alike.json") == 0
    return out.getvalue(), json.loads((evaluation / "alike.json").read_text())


def test_the_command_scores_samples_and_says_the_count_beside_fid(alike_scores):
    table, scores = alike_scores
    assert "FID" in table and "10 samples vs 12 reference images" in table
    assert f"FID {scores['fid']:.4f} (10 samples vs 12 reference images)" in table.splitlines()
    assert "! 10 samples, not the 50,000 the papers score" in table
    assert scores["num_samples"] == 10 and scores["num_reference"] == 12
    assert scores["reference_statistics"] == "computed from its images"
    assert scores["fid"] > 1 and scores["sfid"] > 1 and scores["inception_score"] > 1
    assert 0 <= scores["precision"] <= 1 and 0 <= scores["recall"] <= 1
    assert scores["inception_score_splits"] == 1


def test_the_reference_scored_against_itself_is_perfect_and_its_statistics_come_from_the_cache(
    evaluation, alike_scores, capsys
):
    """The plumbing (read, shard, gather, order) loses nothing: FID 0, precision and recall 1. The first
    run cached the reference's statistics: this one extracts the samples' features only."""
    import json

    assert _evaluate(evaluation, "reference.npz", out="self.json") == 0
    progress = capsys.readouterr().err
    assert "sample features: 12/12" in progress and "reference features" not in progress
    assert len(list((evaluation / "cache").glob("reference-*.npz"))) == 1
    itself = json.loads((evaluation / "self.json").read_text())
    # zero up to the round-off of traces of order 1e4
    assert itself["fid"] == pytest.approx(0, abs=1e-4) and itself["sfid"] == pytest.approx(0, abs=1e-4)
    assert itself["precision"] == itself["recall"] == 1.0


def test_precomputed_reference_statistics_are_used(evaluation, alike_scores, tmp_path):
    """A reference whose mu/mu_s are its own images' statistics shifted (by 1 and 0.5 per feature): its
    images scored against it give FID = 2048 x 1^2 and sFID = 63 x 0.5^2 exactly, so the precomputed
    statistics are what FID used."""
    import json

    (entry,) = (evaluation / "cache").glob("reference-*.npz")  # made by the first run, from the images
    with np.load(entry) as cached:
        own = {name: cached[name] for name in cached.files}
    with np.load(evaluation / "reference.npz") as reference:
        images = reference["arr_0"]
    shifted = {
        "mu": own["mu"] + 1.0,
        "sigma": own["sigma"],
        "mu_s": own["mu_s"] + 0.5,
        "sigma_s": own["sigma_s"],
    }
    (tmp_path / "inception.pth").symlink_to(evaluation / "inception.pth")
    np.savez(tmp_path / "images.npz", images)
    np.savez(tmp_path / "reference.npz", images, **shifted)
    assert _evaluate(tmp_path, "images.npz") == 0
    first = json.loads((tmp_path / "results.json").read_text())
    assert first["reference_statistics"] == "precomputed" and first["num_reference"] == 12
    assert first["fid"] == pytest.approx(2048, rel=1e-6) and first["sfid"] == pytest.approx(
        63 * 0.25, rel=1e-6
    )
    assert first["precision"] == first["recall"] == 1.0  # from the images, as the evaluator does


@pytest.mark.parametrize(
    "problem",
    [
        "missing samples",
        "float images",
        "no weights",
        "too few",
        "half the statistics",
        "foreign weights",
        "statistics of the wrong size",
        "infinite sigma",
        "NaN mu",
        "another resolution",
    ],
)
def test_bad_input_is_one_line_and_exit_2_with_nothing_written(
    evaluation, alike_scores, tmp_path, capsys, problem
):
    root = tmp_path
    for name in ("inception.pth", "reference.npz", "alike.npz"):
        (root / name).symlink_to(evaluation / name)
    samples = "alike.npz"
    if problem == "missing samples":
        samples = "absent.npz"
    elif problem == "float images":
        np.savez(root / "float.npz", np.zeros((5, 8, 8, 3), dtype=np.float32))
        samples = "float.npz"
    elif problem == "no weights":
        (root / "inception.pth").unlink()
    elif problem == "too few":
        np.savez(root / "few.npz", _blobs(3, seed=5))
        samples = "few.npz"
    elif problem == "half the statistics":
        (root / "reference.npz").unlink()
        np.savez(root / "reference.npz", _blobs(6, seed=1), mu=np.zeros(2048))
    elif problem == "foreign weights":
        (root / "inception.pth").unlink()
        torch.save({"conv.weight": torch.zeros(1)}, root / "inception.pth")
    elif problem in ("statistics of the wrong size", "infinite sigma", "NaN mu"):
        # once: a ValueError traceback, a LinAlgError traceback, and "FID nan" with exit 0 and results written
        pool, spatial = 2048, 63  # the Inception's widths at EVAL_PX
        statistics = {
            "mu": np.zeros(pool, np.float32),
            "sigma": np.eye(pool, dtype=np.float32),
            "mu_s": np.zeros(spatial, np.float32),
            "sigma_s": np.eye(spatial, dtype=np.float32),
        }
        if problem == "statistics of the wrong size":
            statistics["mu_s"], statistics["sigma_s"] = np.zeros(7, np.float32), np.eye(7, dtype=np.float32)
        elif problem == "infinite sigma":
            statistics["sigma"][3, 3] = np.inf
        else:
            statistics["mu"][0] = np.nan
        (root / "reference.npz").unlink()
        np.savez(root / "reference.npz", _blobs(6, seed=1), **statistics)
    elif problem == "another resolution":  # once scored without a word
        (root / "reference.npz").unlink()
        np.savez(root / "reference.npz", _blobs(6, seed=1, px=48))
    assert _evaluate(root, samples, cache=evaluation / "cache") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dit-accel evaluate: error: ") and len(err.splitlines()) == 1, err
    assert not (root / "results.json").exists()
    expected = {
        "statistics of the wrong size": "mu_s/sigma_s have shapes (7,) and (7, 7), the Inception features (63,)",
        "infinite sigma": "mu/sigma hold NaN or infinite values",
        "NaN mu": "mu/sigma hold NaN or infinite values",
        "another resolution": "holds 48 x 48 images but the samples are 32 x 32",
        "too few": "the samples hold 3 images",
    }.get(problem, "")
    assert expected in err
    if problem == "no weights":
        assert "curl -L --create-dirs -o" in err and "weights-inception-2015-12-05-6726825d.pth" in err


@pytest.mark.launched
def test_two_launched_processes_give_the_numbers_of_one(evaluation, alike_scores, tmp_path):
    """Each rank extracts its share of both batches (reference: 6 + 6, samples: 5 + 5); the gathered
    features, in global order, give the one-process numbers (a fresh cache: the reference is recomputed)."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    command += [
        "--main_process_port",
        launch_port(),
        SCRIPT,
        "dit_accel.evaluate.command",
    ]  # then whether a teardown ran
    command += ["--samples", str(evaluation / "alike.npz"), "--reference", str(evaluation / "reference.npz")]
    command += [
        "--inception-weights",
        str(evaluation / "inception.pth"),
        "--cache-dir",
        str(tmp_path / "cache"),
    ]
    command += ["--input-px", str(EVAL_PX), "--batch-size", "4", "--out", str(tmp_path / "two.json")]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert teardowns(result.stderr) == []  # ended by exit_command, the process group never freed
    assert result.stdout.count("measured on") == 1  # the table comes from the main process only
    one = alike_scores[1]
    two = json.loads((tmp_path / "two.json").read_text())
    for key in ("fid", "sfid", "inception_score"):  # batches of other sizes: float round-off apart
        assert two[key] == pytest.approx(one[key], rel=1e-5), key
    for key in ("precision", "recall", "num_samples", "num_reference"):
        assert two[key] == one[key], key
    assert len(list((tmp_path / "cache").glob("reference-*.npz"))) == 1


# --- sample --evaluate: scored as it is sampled ----------------------------------------------------------------


# A 1-block pixel-space DiT at 16 px on one CPU "GPU": the plan of the runs these tests and test_train_eval score.
TINY_PIXEL_MODEL = [
    *("--model", "DiT-S/2", "--depth", "1", "--hidden", "32", "--heads", "2", "--resolution", "16"),
    *("--latents", "pixel", "--num-classes", "4", "--vram", "8G", "--precision", "fp32", "--gpus", "1"),
]


def plan_tiny_pixel(*flags) -> None:
    """`dit-plan` for the tiny pixel model at global batch 8, with `flags` (--out, --objective)."""
    from planner.cli import main as dit_plan

    assert dit_plan([*TINY_PIXEL_MODEL, "--global-batch", "8", *flags]) == 0


def write_tiny_pixel_workspace(root) -> None:
    """Demo images (4 classes x 2, 16 px) in root/images and the tiny pixel model's plan in root/plan."""
    from dit_accel.data.demo import write_demo_data

    write_demo_data(root / "images", classes=4, per_class=2, resolution=16, seed=0)
    plan_tiny_pixel("--out", str(root / "plan"))


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A 1-block pixel-space DiT at 16 px, trained one step on demo images: a real run folder to sample."""
    from dit_accel.train.loop import main as train

    root = tmp_path_factory.mktemp("tiny_run")
    write_tiny_pixel_workspace(root)
    argv = [
        "--plan",
        root / "plan" / "plan.json",
        "--data-path",
        root / "images",
        "--output-dir",
        root / "run",
    ]
    argv += ["--max-steps", 1, "--num-workers", 0, "--no-progress-bar", "--no-tensorboard"]
    with fresh_accelerate_state():
        assert train([str(a) for a in argv]) == 0
    return root / "run"


def _sample(run, *argv) -> int:
    from dit_accel.sample.command import main

    common = ["--checkpoint", run, "--num-samples", 5, "--batch-size", 5, "--steps", 2, "--no-ema"]
    with fresh_accelerate_state():
        return main([str(a) for a in [*common, *argv]])


def test_sample_evaluate_scores_what_evaluate_scores_on_the_same_images(
    evaluation, tiny_run, tmp_path, capsys
):
    """One run keeps the batch (--npz) and scores it (--evaluate); `evaluate` on that .npz and a run that
    only scores (no file of images anywhere) give the same five numbers: same seed, same images."""
    import json

    scoring = [
        "--evaluate",
        evaluation / "reference16.npz",
        "--inception-weights",
        evaluation / "inception.pth",
    ]
    scoring += ["--cache-dir", evaluation / "cache", "--input-px", EVAL_PX]
    assert _sample(tiny_run, "--npz", tmp_path / "s.npz", *scoring, "--results", tmp_path / "both.json") == 0
    from dit_accel.evaluate.command import main as evaluate

    argv = ["--samples", tmp_path / "s.npz", "--reference", *scoring[1:], "--batch-size", 5]
    argv += ["--out", tmp_path / "file.json"]
    assert evaluate([str(a) for a in argv]) == 0
    assert _sample(tiny_run, *scoring, "--results", tmp_path / "only.json") == 0
    printed = capsys.readouterr().out
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "both.json",
        "file.json",
        "only.json",
        "s.npz",
    ]
    both, from_file, only = (
        json.loads((tmp_path / f"{n}.json").read_text()) for n in ("both", "file", "only")
    )
    for key in ("fid", "sfid", "inception_score", "precision", "recall", "num_samples", "num_reference"):
        assert only[key] == pytest.approx(from_file[key], rel=1e-9) == both[key], key
    assert only["num_samples"] == 5 and only["num_reference"] == 12 and math.isfinite(only["fid"])
    assert only["samples"].endswith("not kept") and only["sampling"]["steps"] == 2
    assert (
        printed.count(f"FID {only['fid']:.4f} (5 samples vs 12 reference images)") == 3
    )  # both runs of sample, and evaluate

    # A reference at another resolution (32 px against the run's 16) stops it before any sampling too.
    other = ["--evaluate", evaluation / "reference.npz", *scoring[2:], "--results", tmp_path / "bad.json"]
    assert _sample(tiny_run, *other, "--npz", tmp_path / "bad.npz") == 2
    err = capsys.readouterr().err.strip()
    assert "holds 32 x 32 images but the samples are 16 x 16" in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "bad.json").exists() and not list(tmp_path.glob("bad.npz*"))

    # A missing reference stops the command before any sampling, one line, nothing written.
    missing = ["--evaluate", tmp_path / "absent.npz", *scoring[2:], "--results", tmp_path / "bad.json"]
    assert _sample(tiny_run, *missing) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dit-accel sample: error: --evaluate ") and "absent.npz does not exist" in err, err
    assert len(err.splitlines()) == 1, err
    assert not (tmp_path / "bad.json").exists()


def test_a_resumed_batch_is_scored_with_the_shards_it_already_had(evaluation, tiny_run, tmp_path, capsys):
    """`--npz --evaluate` over a half-made batch reads the finished shard back for its features (here one
    whose images were altered, so a resampled shard would show): the scores are those of the file it
    assembles."""
    import json

    from dit_accel.evaluate.command import main as evaluate

    assert _sample(tiny_run, "--batch-size", 3, "--npz", tmp_path / "a.npz") == 0
    with np.load(tmp_path / "a.npz") as made:
        images, labels = made["arr_0"], made["arr_1"]
    (tmp_path / "b.npz.parts").mkdir()
    np.savez(tmp_path / "b.npz.parts" / "batch_000000.npz", images=255 - images[:3], labels=labels[:3])
    scoring = ["--inception-weights", evaluation / "inception.pth", "--cache-dir", evaluation / "cache"]
    scoring += ["--input-px", EVAL_PX]
    argv = ["--batch-size", 3, "--npz", tmp_path / "b.npz", "--evaluate", evaluation / "reference16.npz"]
    assert _sample(tiny_run, *argv, *scoring, "--results", tmp_path / "b.json") == 0
    assert "1 batches made, 1 already done" in capsys.readouterr().out
    with np.load(tmp_path / "b.npz") as resumed:
        assert np.array_equal(resumed["arr_0"][:3], 255 - images[:3])
        assert np.array_equal(resumed["arr_0"][3:], images[3:])
    argv = ["--samples", tmp_path / "b.npz", "--reference", evaluation / "reference16.npz", "--batch-size", 3]
    assert evaluate([str(a) for a in [*argv, *scoring, "--out", tmp_path / "file.json"]]) == 0
    scored, from_file = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("b", "file"))
    for key in ("fid", "sfid", "inception_score", "precision", "recall"):
        assert scored[key] == pytest.approx(from_file[key], rel=1e-9), key


@pytest.mark.parametrize("env", [{}, {"TORCH_HOME": "/x/th"}, {"XDG_CACHE_HOME": "/x/xdg"}])
def test_the_default_weights_place_is_the_torch_hub_cache_worked_out_without_torch(monkeypatch, env):
    from pathlib import Path

    from dit_accel.evaluate.weights import hub_checkpoints_dir

    for name in ("TORCH_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert hub_checkpoints_dir() == Path(torch.hub.get_dir()) / "checkpoints"


def test_every_missing_input_is_named_at_once(evaluation, tmp_path, monkeypatch, capsys):
    """Neither the weights nor the reference: both in one line (the weights alone were named, then the
    reference on the next try)."""
    from dit_accel.evaluate.command import main

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))  # no weights in its hub cache
    argv = ["--samples", str(evaluation / "alike.npz"), "--reference", str(tmp_path / "absent.npz")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1
        and "--reference" in err[0]
        and "absent.npz does not exist and the Inception-v3" in err[0]
    )
    assert "VIRTUAL_imagenet256_labeled.npz" in err[0] and "curl -L --create-dirs" in err[0]


def test_the_plumbing_check_runs_the_whole_path_offline_and_says_it_is_no_fid(
    evaluation, tmp_path, monkeypatch, capsys
):
    """No weights anywhere: `--plumbing-check` scores on a random network fitted to the reference, and the
    table, the FID line and the JSON all say that these numbers are no metric."""
    import json

    from dit_accel.evaluate.command import main

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    argv = ["--samples", str(evaluation / "alike.npz"), "--reference", str(evaluation / "reference.npz")]
    out = tmp_path / "plumbing.json"
    assert main([*argv, "--plumbing-check", "--out", str(out), "--cache-dir", str(tmp_path / "cache")]) == 0
    printed = capsys.readouterr().out
    assert (
        printed.startswith("!!! PLUMBING CHECK with a random Inception network")
        and "-- PLUMBING CHECK, not an FID" in printed
    )
    scores = json.loads(out.read_text())
    assert "NOT an FID" in scores["plumbing_check"] and "NOT an FID" in scores["inception_weights"]
    assert scores["num_samples"] == 10 and math.isfinite(scores["fid"]) and 0 <= scores["precision"] <= 1
    assert not (tmp_path / "cache").exists()  # a random network's statistics are never cached
