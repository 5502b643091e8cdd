"""Which samples each rank reads at each step, and each sample's own randomness.

Two rules make runs reproducible and resumable bit for bit:
- Every random choice about a sample (its timestep, noise, class dropout, VAE posterior draw and its
  augmentation) is a function of (seed, sample number) alone, where sample number = step * global_batch +
  position in the step's window. So a run resumed at step k draws exactly what the straight run drew, and
  2 processes x micro 2 x accum 2 see the very same samples, noise and timesteps as 1 process x micro 8.
- The data order is a function of (seed, epoch): a seeded permutation per epoch cut into windows of one
  global batch; the last partial window of an epoch is dropped. The data position is the step counter.
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass

import numpy as np
import torch

from dit_accel.errors import UserError


def sample_seed(seed: int, sample_number: int) -> int:
    """A 63-bit seed for one sample, well mixed (SeedSequence), from the run seed and the sample number."""
    return int(np.random.SeedSequence([seed, sample_number]).generate_state(1, np.uint64)[0] >> 1)


@dataclass(frozen=True)
class SampleOrder:
    """Which dataset items each rank reads at each micro-step. A pure function of (seed, step), so the
    data position of a run is its step counter and nothing else needs saving to resume exactly."""

    dataset_size: int
    global_batch: int
    micro_batch: int
    grad_accum: int
    world_size: int
    seed: int

    def __post_init__(self):
        if self.micro_batch * self.grad_accum * self.world_size != self.global_batch:
            raise ValueError("global_batch must equal micro_batch * grad_accum * world_size")
        if self.dataset_size < self.global_batch:
            raise UserError(
                f"the dataset has {self.dataset_size} samples, fewer than one global batch of "
                f"{self.global_batch}",
                "add data or re-plan with a smaller --global-batch",
            )

    @property
    def steps_per_epoch(self) -> int:
        """Full windows only: the last partial window of an epoch is dropped, never padded."""
        return self.dataset_size // self.global_batch

    def epoch_and_offset(self, step: int) -> tuple[int, int]:
        """(epoch, samples into that epoch) before optimizer step `step` (0-based) is taken."""
        return step // self.steps_per_epoch, (step % self.steps_per_epoch) * self.global_batch

    def position(self, step: int) -> dict:
        """Where the data stands after `step` optimizer steps, as a checkpoint records it (train_state.json)."""
        epoch, offset = self.epoch_and_offset(step)
        return {
            "epoch": epoch,
            "samples_into_epoch": offset,
            "world_size": self.world_size,
            "global_batch": self.global_batch,
            "micro_batch": self.micro_batch,
            "grad_accum": self.grad_accum,
            "dataset_size": self.dataset_size,
            "seed": self.seed,
            "samples_seen": step * self.global_batch,
        }

    def permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.dataset_size)

    def micro_batch_items(self, step: int, micro_step: int, rank: int, permutation: np.ndarray | None = None):
        """[(dataset_index, sample_number)] for one rank's micro-batch. Rank-major layout of the window:
        rank r owns positions [r * grad_accum * micro_batch, (r + 1) * grad_accum * micro_batch)."""
        epoch, offset = self.epoch_and_offset(step)
        permutation = self.permutation(epoch) if permutation is None else permutation
        first = (rank * self.grad_accum + micro_step) * self.micro_batch
        return [
            (int(permutation[offset + position]), step * self.global_batch + position)
            for position in range(first, first + self.micro_batch)
        ]

    def batches(self, start_step: int, rank: int):
        """Every micro-batch of this rank from `start_step` on, forever, in order."""
        step, epoch, permutation = start_step, None, None
        while True:
            if self.epoch_and_offset(step)[0] != epoch:
                epoch = self.epoch_and_offset(step)[0]
                permutation = self.permutation(epoch)
            for micro_step in range(self.grad_accum):
                yield self.micro_batch_items(step, micro_step, rank, permutation)
            step += 1


class OrderedBatches(torch.utils.data.Sampler):
    """SampleOrder as a DataLoader batch_sampler, starting at the resumed step."""

    def __init__(self, order: SampleOrder, start_step: int, rank: int):
        self.order, self.start_step, self.rank = order, start_step, rank

    def __iter__(self):
        return self.order.batches(self.start_step, self.rank)


@contextlib.contextmanager
def seeded_global_rngs(seed: int):
    """Seed python/numpy/torch RNGs for one sample's augmentation, then put the previous states back, so a
    dataset's own `random.random() < 0.5` flip is a function of the sample, in a worker or not."""
    py_state, np_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)
        try:
            yield
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)


class KeyedSamples(torch.utils.data.Dataset):
    """Wraps a dataset so item (index, sample_number) is read with that sample's own RNG seed."""

    def __init__(self, dataset, seed: int):
        self.dataset, self.seed = dataset, seed

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, key):
        index, sample_number = key
        with seeded_global_rngs(sample_seed(self.seed, sample_number) ^ 0x5EED):
            item = self.dataset[index]
        return item, sample_number


@dataclass
class SampleNoise:
    """Draws a micro-batch's diffusion randomness from each sample's own generator (see module docstring)."""

    seed: int
    num_timesteps: int
    noise_shape: tuple[int, ...]
    class_dropout: float
    posterior_shape: tuple[int, ...] | None = None  # online VAE: the posterior sample's noise
    # A flow objective's float t in [0, 1] ("uniform" or "lognormal" on `flow_path`); None: DDPM's integer t.
    time_sampling: str | None = None
    flow_path: str = "linear"

    @classmethod
    def for_objective(cls, objective, seed: int, noise_shape, class_dropout: float, posterior_shape=None):
        """The draws the trainer's objective needs: DiT's integer timesteps, or a flow's float times."""
        flow = getattr(objective, "name", "ddpm") == "flow"
        return cls(
            seed,
            0 if flow else objective.num_timesteps,
            tuple(noise_shape),
            class_dropout,
            posterior_shape=posterior_shape,
            time_sampling=objective.time_sampling if flow else None,
            flow_path=objective.path if flow else "linear",
        )

    def __call__(self, sample_numbers: list[int]) -> dict[str, torch.Tensor]:
        from dit_accel.diffusion.flow import draw_time

        timesteps, noises, drops, posteriors = [], [], [], []
        for number in sample_numbers:
            generator = torch.Generator().manual_seed(sample_seed(self.seed, number))
            if self.time_sampling is None:
                timesteps.append(torch.randint(0, self.num_timesteps, (), generator=generator))
            else:
                timesteps.append(draw_time(self.time_sampling, self.flow_path, generator))
            noises.append(torch.randn(self.noise_shape, generator=generator))
            drops.append(torch.rand((), generator=generator) < self.class_dropout)
            if self.posterior_shape is not None:
                posteriors.append(torch.randn(self.posterior_shape, generator=generator))
        out = {"t": torch.stack(timesteps), "noise": torch.stack(noises), "drop": torch.stack(drops)}
        if posteriors:
            out["posterior_noise"] = torch.stack(posteriors)
        return out


class Collate:
    """Stacks (x, label) items and adds each sample's randomness; runs in the DataLoader workers."""

    def __init__(self, noise: SampleNoise):
        self.noise = noise

    def __call__(self, items):
        xs, labels, numbers, images = [], [], [], []
        for item, number in items:
            x, label = _unpack_item(item)
            xs.append(torch.as_tensor(x))
            labels.append(int(label))
            numbers.append(number)
            if isinstance(item, tuple) and len(item) == 3:  # a latent's source image (REPA from a cache)
                images.append(item[2])
        batch = {
            "x": torch.stack(xs),
            "y": torch.tensor(labels, dtype=torch.long),
            "sample_number": torch.tensor(numbers, dtype=torch.long),
        }
        if images:
            batch["image"] = torch.stack(images)
        batch.update(self.noise(numbers))
        return batch


def _unpack_item(item):
    if isinstance(item, dict):
        x = next(item[key] for key in ("latent", "latents", "image", "pixel_values", "x") if key in item)
        label = next(item[key] for key in ("label", "class_label", "y", "labels") if key in item)
        return x, label
    return item[0], item[1]
