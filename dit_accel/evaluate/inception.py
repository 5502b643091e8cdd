"""Inception-v3 as TensorFlow's 2015-12-05 graph has it (the one the ADM evaluator loads), in PyTorch, with
the TF-ported weights torch-fidelity publishes.

Why not a library: torch-fidelity's package imports torchvision at its top (its __init__ loads every
feature extractor), and torchvision cannot be installed beside this project's pinned torch on a CPU box, so
the network is written here. Its module names are the weight file's keys, so the published file loads
strictly. What makes it the TF graph rather than torchvision's Inception: the input resized to 299 x 299
by TF1's bilinear resize (no half-pixel centres), scaled by (x - 128) / 128; BatchNorm eps 1e-3; average
pools that leave the padding out of the mean; a max pool in the last block's pool branch; 1008 classes.

The three outputs the evaluator reads: `pool_3` (the 2048 averaged features of the last block: FID,
precision, recall), `mixed_6/conv` (the 1x1 branch of the fourth 17 x 17 block, Mixed_6d, after its ReLU;
the evaluator keeps its first 7 channels, flattened height, width, channel as TF lays them out: sFID), and
`softmax/logits/MatMul` (pool_3 times the classifier's weights without its bias: the Inception Score).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dit_accel.errors import UserError
from dit_accel.evaluate.weights import WEIGHTS_URL, weights_file

INPUT_PX = 299
SPATIAL_BLOCK, SPATIAL_CHANNELS = "Mixed_6d", 7
POOL_FEATURES, CLASSES = 2048, 1008


class ConvBN(nn.Module):
    """Convolution without bias, BatchNorm (eps 1e-3, TF's), ReLU: every layer of the graph."""

    def __init__(self, in_channels: int, out_channels: int, kernel, stride: int = 1, padding=0):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel, stride=stride, padding=padding, bias=False)
        self.bn = nn.BatchNorm2d(out_channels, eps=0.001)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x)))


def _pool(kind: str | None, x):
    if kind == "avg":  # TF's average pool leaves the zero padding out of the mean
        return F.avg_pool2d(x, 3, stride=1, padding=1, count_include_pad=False)
    if kind == "max":  # the last block (Mixed_7c) pools by max in the TF graph
        return F.max_pool2d(x, 3, stride=1, padding=1)
    if kind == "max/2":
        return F.max_pool2d(x, 3, stride=2)
    return x


class Mixed(nn.Module):
    """One Inception block: parallel branches concatenated along channels. A branch is an optional pool, a
    chain of convolutions, and optionally a fork of convolutions applied side by side to the chain's end.
    A stride-1 convolution pads to keep the size, a stride-2 one pads nothing, as in the graph."""

    def __init__(self, in_channels: int, branches: list[tuple]):
        super().__init__()
        self.plan, self.out_channels = [], 0
        for pool, chain, fork in branches:
            channels = in_channels
            for layer in chain:
                self._add(layer, channels)
                channels = layer[1]
            for layer in fork:
                self._add(layer, channels)
            self.out_channels += sum(layer[1] for layer in fork) if fork else channels
            self.plan.append((pool, [layer[0] for layer in chain], [layer[0] for layer in fork]))

    def _add(self, layer: tuple, in_channels: int) -> None:
        name, out_channels, kernel, stride = layer
        padding = tuple(k // 2 for k in kernel) if stride == 1 else 0
        self.add_module(name, ConvBN(in_channels, out_channels, kernel, stride, padding))

    def branches(self, x) -> list[torch.Tensor]:
        outputs = []
        for pool, chain, fork in self.plan:
            y = _pool(pool, x)
            for name in chain:
                y = getattr(self, name)(y)
            outputs.append(torch.cat([getattr(self, name)(y) for name in fork], 1) if fork else y)
        return outputs

    def forward(self, x):
        return torch.cat(self.branches(x), 1)


def _c(name, out_channels, kernel, stride=1):
    return (name, out_channels, kernel if isinstance(kernel, tuple) else (kernel, kernel), stride)


def block_a(pool_features: int) -> list[tuple]:
    return [
        (None, [_c("branch1x1", 64, 1)], []),
        (None, [_c("branch5x5_1", 48, 1), _c("branch5x5_2", 64, 5)], []),
        (None, [_c("branch3x3dbl_1", 64, 1), _c("branch3x3dbl_2", 96, 3), _c("branch3x3dbl_3", 96, 3)], []),
        ("avg", [_c("branch_pool", pool_features, 1)], []),
    ]


def block_b() -> list[tuple]:
    return [
        (None, [_c("branch3x3", 384, 3, 2)], []),
        (
            None,
            [_c("branch3x3dbl_1", 64, 1), _c("branch3x3dbl_2", 96, 3), _c("branch3x3dbl_3", 96, 3, 2)],
            [],
        ),
        ("max/2", [], []),
    ]


def block_c(c7: int) -> list[tuple]:
    sevens = [_c("branch7x7_1", c7, 1), _c("branch7x7_2", c7, (1, 7)), _c("branch7x7_3", 192, (7, 1))]
    double = [_c("branch7x7dbl_1", c7, 1)]
    double += [_c(f"branch7x7dbl_{i}", c7, (7, 1) if i % 2 == 0 else (1, 7)) for i in (2, 3, 4)]
    double += [_c("branch7x7dbl_5", 192, (1, 7))]
    return [(None, [_c("branch1x1", 192, 1)], []), (None, sevens, []), (None, double, [])] + [
        ("avg", [_c("branch_pool", 192, 1)], [])
    ]


def block_d() -> list[tuple]:
    return [
        (None, [_c("branch3x3_1", 192, 1), _c("branch3x3_2", 320, 3, 2)], []),
        (
            None,
            [
                _c("branch7x7x3_1", 192, 1),
                _c("branch7x7x3_2", 192, (1, 7)),
                _c("branch7x7x3_3", 192, (7, 1)),
                _c("branch7x7x3_4", 192, 3, 2),
            ],
            [],
        ),
        ("max/2", [], []),
    ]


def block_e(pool: str) -> list[tuple]:
    def split(prefix: str):
        return [_c(f"{prefix}a", 384, (1, 3)), _c(f"{prefix}b", 384, (3, 1))]

    return [
        (None, [_c("branch1x1", 320, 1)], []),
        (None, [_c("branch3x3_1", 384, 1)], split("branch3x3_2")),
        (None, [_c("branch3x3dbl_1", 448, 1), _c("branch3x3dbl_2", 384, 3)], split("branch3x3dbl_3")),
        (pool, [_c("branch_pool", 192, 1)], []),
    ]


MIXED_BLOCKS = {
    "Mixed_5b": block_a(32),
    "Mixed_5c": block_a(64),
    "Mixed_5d": block_a(64),
    "Mixed_6a": block_b(),
    "Mixed_6b": block_c(128),
    "Mixed_6c": block_c(160),
    "Mixed_6d": block_c(160),
    "Mixed_6e": block_c(192),
    "Mixed_7a": block_d(),
    "Mixed_7b": block_e("avg"),
    "Mixed_7c": block_e("max"),
}


def resize_like_tf1(images: torch.Tensor, size: int = INPUT_PX) -> torch.Tensor:
    """TF1's ResizeBilinear without align_corners or half-pixel centres, as in the graph: output pixel i
    reads input position i * in / out, interpolated between its floor and the next pixel (clamped at the
    edge); along the width first, then the height. `images` is float NCHW."""

    def along(x: torch.Tensor, dim: int) -> torch.Tensor:
        length = x.shape[dim]
        if length == size:
            return x
        position = torch.arange(size, dtype=torch.float32, device=x.device) * (length / size)
        low = position.floor().long()
        high = (low + 1).clamp(max=length - 1)
        weight = (position - low).to(x.dtype)
        shape = [1] * x.dim()
        shape[dim] = size
        lower, upper = x.index_select(dim, low), x.index_select(dim, high)
        return lower + (upper - lower) * weight.view(shape)

    return along(along(images, 3), 2)


class InceptionV3(nn.Module):
    """uint8 NHWC images of any size in; (pool features, spatial features, unbiased logits) out.
    `input_px` is the graph's 299 always but in tests, where 75 (the least the network takes) keeps a CPU
    run short; the spatial features are then 7 x 3 x 3."""

    def __init__(self, input_px: int = INPUT_PX):
        super().__init__()
        self.input_px = input_px
        self.Conv2d_1a_3x3 = ConvBN(3, 32, 3, stride=2)
        self.Conv2d_2a_3x3 = ConvBN(32, 32, 3)
        self.Conv2d_2b_3x3 = ConvBN(32, 64, 3, padding=1)
        self.Conv2d_3b_1x1 = ConvBN(64, 80, 1)
        self.Conv2d_4a_3x3 = ConvBN(80, 192, 3)
        channels = 192
        for name, branches in MIXED_BLOCKS.items():
            block = Mixed(channels, branches)
            self.add_module(name, block)
            channels = block.out_channels
        self.fc = nn.Linear(POOL_FEATURES, CLASSES)

    @property
    def feature_widths(self) -> tuple[int, int, int]:
        """Sizes of (pool, spatial, logits): the spatial grid is what the stem and Mixed_6a leave of the
        input (17 x 17 from 299: three valid 3x3 stride-2 steps and two valid 3x3 convolutions)."""
        side = (self.input_px - 3) // 2 + 1 - 2  # Conv2d_1a (stride 2), Conv2d_2a
        side = (side - 3) // 2 + 1 - 2  # the first max pool, Conv2d_4a
        side = ((side - 3) // 2 + 1 - 3) // 2 + 1  # the second max pool, Mixed_6a
        return POOL_FEATURES, SPATIAL_CHANNELS * side * side, CLASSES

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = images.permute(0, 3, 1, 2).float()
        x = (resize_like_tf1(x, self.input_px) - 128) / 128
        x = self.Conv2d_2b_3x3(self.Conv2d_2a_3x3(self.Conv2d_1a_3x3(x)))
        x = F.max_pool2d(x, 3, stride=2)
        x = F.max_pool2d(self.Conv2d_4a_3x3(self.Conv2d_3b_1x1(x)), 3, stride=2)
        for name in MIXED_BLOCKS:
            outputs = getattr(self, name).branches(x)
            if name == SPATIAL_BLOCK:  # mixed_6/conv: NHWC order, first 7 channels
                spatial = outputs[0][:, :SPATIAL_CHANNELS].permute(0, 2, 3, 1).flatten(1)
            x = torch.cat(outputs, 1)
        pool = x.mean(dim=(2, 3))
        return pool, spatial, pool @ self.fc.weight.T


def load_inception(
    weights: str | Path | None = None, device: torch.device | str = "cpu", input_px: int = INPUT_PX
) -> InceptionV3:
    """The network with its weights from `weights` (else the torch hub cache), in eval mode, no grads.
    Nothing is downloaded: a missing file is a one-line error saying how to fetch it."""
    path = weights_file(weights)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        raise UserError(
            f"{path} is not a readable PyTorch weight file ({type(error).__name__})",
            f"fetch it again from {WEIGHTS_URL}",
        ) from None
    network = InceptionV3(input_px)
    try:
        network.load_state_dict(state)
    except (RuntimeError, TypeError, AttributeError) as error:
        first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise UserError(
            f"{path} does not hold the TF-ported Inception-v3 weights ({first_line})",
            f"use torch-fidelity's file: {WEIGHTS_URL}",
        ) from None
    return network.to(device).eval().requires_grad_(False)


PLUMBING_INPUT_PX = 75  # the least the network takes: the plumbing check scores nothing, so it costs little


def random_inception(images, device: torch.device | str = "cpu", seed: int = 0) -> InceptionV3:
    """A randomly initialised network (`seed`), its BatchNorm statistics those of `images` (uint8 NHWC: one
    forward in training mode, a cumulative average) so that its features are of order 1, at the least input
    size: `--plumbing-check`, which runs the whole evaluation path without the published weights. Its
    numbers compare with nothing."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        network = InceptionV3(PLUMBING_INPUT_PX)
    for module in network.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.momentum = None
    with torch.no_grad():
        network.train()(torch.as_tensor(images))
    return network.to(device).eval().requires_grad_(False)


@contextlib.contextmanager
def full_fp32():
    """CUDA convolutions and matmuls in true float32 (no TF32), as TensorFlow ran the evaluator's graph."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved
