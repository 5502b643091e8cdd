"""The ADM evaluator's arithmetic on Inception features: Fréchet distance (FID on pool features, sFID on
spatial ones), Inception Score, and k-nearest-neighbour precision and recall.

Definitions follow guided-diffusion's evaluations/evaluator.py, which every DiT/SiT/REPA paper reports with:
- statistics are the mean and the unbiased covariance (N - 1) of the features;
- the Inception Score is exp(E[KL(p(y|x) || p(y))]) over consecutive splits of 5,000 samples (10 splits for
  the standard 50,000), averaged over the splits; p(y|x) is the softmax of the pool features times the
  classifier's weights, without its bias;
- precision is the share of samples inside the reference manifold, recall the share of references inside
  the sample manifold; a manifold is the union of balls around each of its points whose radius is the
  (squared) distance to its k-th nearest neighbour, k = 3, the point itself not counted. Squared distances
  are computed in float16 as the evaluator does (float32 where float16 overflows).

The matrix square root of the Fréchet distance is not scipy's (no dependency of this package brings scipy):
tr(sqrt(S1 S2)) = sum of sqrt(eigenvalues of sqrt(S1) S2 sqrt(S1)), a symmetric positive semi-definite
matrix, so two symmetric eigen-decompositions in float64 give it without complex round-off (one small one
when a side has fewer samples than features).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

IS_SPLIT_SIZE = 5000  # the evaluator's split: 50,000 samples make its 10 splits
NEAREST_NEIGHBOUR_K = 3
DISTANCE_BLOCK = 10000  # rows and columns of one block of pairwise distances, as the evaluator batches them


@dataclass(frozen=True)
class Statistics:
    """Mean and covariance of one feature set (the `mu`/`sigma` or `mu_s`/`sigma_s` of a reference .npz).
    `factor`, when kept, is B with sigma = B^T B: (N, D) for N <= D samples, a cheaper route to the trace
    of the Fréchet distance (`trace_sqrt_product`)."""

    mu: np.ndarray
    sigma: np.ndarray
    factor: np.ndarray | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.mu.ndim != 1 or self.sigma.shape != (len(self.mu), len(self.mu)):
            raise ValueError(f"statistics of mismatched shapes: mu {self.mu.shape}, sigma {self.sigma.shape}")


def statistics(features: np.ndarray) -> Statistics:
    """Mean and unbiased covariance of an (N, D) feature matrix, in float64 (N >= 2)."""
    features = np.asarray(features, dtype=np.float64)
    if features.ndim != 2 or len(features) < 2:
        raise ValueError(f"need an (N >= 2, D) feature matrix, got shape {features.shape}")
    mu = features.mean(axis=0)
    factor = (features - mu) / np.sqrt(len(features) - 1)
    return Statistics(mu, factor.T @ factor, factor if len(features) <= features.shape[1] else None)


def _symmetric_sqrt(matrix: np.ndarray) -> np.ndarray:
    eigenvalues, eigenvectors = np.linalg.eigh((matrix + matrix.T) / 2)
    return (eigenvectors * np.sqrt(np.clip(eigenvalues, 0, None))) @ eigenvectors.T


def trace_sqrt_product(first: Statistics, second: Statistics) -> float:
    """tr(sqrt(S1 S2)) for covariance matrices: S1 S2 is similar to the PSD matrix sqrt(S1) S2 sqrt(S1),
    whose eigenvalues are real and non-negative up to round-off. With S1 = B^T B from N <= D samples, the
    non-zero eigenvalues of S1 S2 are those of the N x N matrix B S2 B^T: the same trace for far less work
    (a 1,000-sample FID during training, a test's handful)."""
    if first.factor is None and second.factor is not None:
        first, second = second, first
    if first.factor is not None:
        inner = first.factor @ second.sigma @ first.factor.T
    else:
        root1 = _symmetric_sqrt(first.sigma)
        inner = root1 @ second.sigma @ root1
    eigenvalues = np.linalg.eigvalsh((inner + inner.T) / 2)
    return float(np.sqrt(np.clip(eigenvalues, 0, None)).sum())


def frechet_distance(first: Statistics, second: Statistics) -> float:
    """|mu1 - mu2|^2 + tr(S1) + tr(S2) - 2 tr(sqrt(S1 S2)): the Fréchet distance of two Gaussians."""
    if first.mu.shape != second.mu.shape:
        raise ValueError(f"features of different sizes: {first.mu.shape} and {second.mu.shape}")
    difference = first.mu - second.mu
    trace_product = trace_sqrt_product(first, second)
    return float(difference @ difference + np.trace(first.sigma) + np.trace(second.sigma) - 2 * trace_product)


def softmax(logits: np.ndarray) -> np.ndarray:
    logits = np.asarray(logits, dtype=np.float64)
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    return shifted / shifted.sum(axis=1, keepdims=True)


def inception_score(probabilities: np.ndarray, split_size: int = IS_SPLIT_SIZE) -> float:
    """Mean over consecutive splits of exp(mean_i KL(p_i || mean p)); `probabilities` is (N, classes)."""
    probabilities = np.asarray(probabilities, dtype=np.float64)
    scores = []
    for start in range(0, len(probabilities), split_size):
        part = probabilities[start : start + split_size]
        marginal = part.mean(axis=0, keepdims=True)
        with np.errstate(divide="ignore", invalid="ignore"):  # 0 log 0 = 0: a class a sample rules out
            kl = np.where(part > 0, part * (np.log(part) - np.log(marginal)), 0.0)
        scores.append(np.exp(kl.sum(axis=1).mean()))
    return float(np.mean(scores))


def squared_distances(rows, columns):
    """Pairwise squared Euclidean distances of two (n, D) and (m, D) tensors as the evaluator computes them:
    |u|^2 - 2 u.v + |v|^2, clipped at 0, in float16, redone in float32 when float16 overflows."""
    import torch

    def in_dtype(dtype):
        u, v = rows.to(dtype), columns.to(dtype)
        norms_u = (u * u).sum(dim=1, keepdim=True)
        norms_v = (v * v).sum(dim=1).unsqueeze(0)
        return torch.clamp(norms_u - 2 * (u @ v.T) + norms_v, min=0)

    distances = in_dtype(torch.float16)
    if torch.isfinite(distances).all():
        return distances.float()
    return in_dtype(torch.float32)


def _blocks(count: int, size: int):
    return [(start, min(start + size, count)) for start in range(0, count, size)]


def manifold_radii(features, k: int = NEAREST_NEIGHBOUR_K, block: int = DISTANCE_BLOCK):
    """Each point's squared distance to its k-th nearest neighbour in the same set (itself, at 0, not
    counted): the radius of its ball in the manifold. Needs more than k points."""
    import torch

    if len(features) <= k:
        raise ValueError(f"a k = {k} manifold needs more than {k} points, got {len(features)}")
    radii = torch.empty(len(features), dtype=torch.float32, device=features.device)
    for row_start, row_end in _blocks(len(features), block):
        nearest = []  # the k + 1 smallest of each column block: the k + 1 smallest overall are among them
        for column_start, column_end in _blocks(len(features), block):
            distances = squared_distances(features[row_start:row_end], features[column_start:column_end])
            keep = min(k + 1, column_end - column_start)
            nearest.append(torch.topk(distances, keep, dim=1, largest=False).values)
        radii[row_start:row_end] = torch.sort(torch.cat(nearest, dim=1), dim=1).values[:, k]
    return radii


def inside_manifold(points, manifold, radii, block: int = DISTANCE_BLOCK):
    """For each of `points`, whether it lies within some ball of the manifold (distance <= that radius)."""
    import torch

    inside = torch.zeros(len(points), dtype=torch.bool, device=points.device)
    for row_start, row_end in _blocks(len(points), block):
        for column_start, column_end in _blocks(len(manifold), block):
            distances = squared_distances(points[row_start:row_end], manifold[column_start:column_end])
            within = (distances <= radii[column_start:column_end].unsqueeze(0)).any(dim=1)
            inside[row_start:row_end] |= within
    return inside


def precision_recall(
    reference, samples, k: int = NEAREST_NEIGHBOUR_K, block: int = DISTANCE_BLOCK
) -> tuple[float, float]:
    """(precision, recall) of sample features against reference features, (N, D) tensors or arrays."""
    import torch

    reference, samples = torch.as_tensor(reference), torch.as_tensor(samples)
    reference_radii = manifold_radii(reference, k, block)
    sample_radii = manifold_radii(samples, k, block)
    precision = inside_manifold(samples, reference, reference_radii, block).double().mean()
    recall = inside_manifold(reference, samples, sample_radii, block).double().mean()
    return float(precision), float(recall)
