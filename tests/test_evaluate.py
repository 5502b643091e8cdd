"""FID, sFID, Inception Score, precision and recall (dit_accel.evaluate).

The arithmetic is held to independent computations with known answers: Gaussians whose Fréchet distance
has a closed form, a matrix square root by Denman-Beavers iteration, hand-worked Inception Scores and k-NN
manifolds, a brute-force k-NN in float64."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

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
    assert metrics.trace_sqrt_product(sigma1, sigma2) == pytest.approx(np.trace(root), rel=1e-9)


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
