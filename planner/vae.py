"""The Stable Diffusion VAE encoder, which `--latents online` runs on every micro-batch.

Its size and compute follow from the architecture DiT uses (diffusers' AutoencoderKL with
block_out_channels (128, 256, 512, 512), two ResNet blocks per level, one attention block in the middle);
a test holds the parameter count to a meta-device AutoencoderKL.
"""

from __future__ import annotations

ENCODER_CHANNELS = (128, 256, 512, 512)
LAYERS_PER_BLOCK = 2
IMAGE_CHANNELS = 3
LATENT_CHANNELS = 4
ENCODER_PARAMS = 34_163_664  # encoder + quant_conv, counted from the architecture below by a test


def encoder_macs_per_image(resolution: int) -> int:
    """Multiply-adds of one encoder forward on a resolution x resolution image.

    conv_in; per level two ResNet blocks (two 3x3 convs each, a 1x1 shortcut when channels change) and a
    stride-2 3x3 downsample on all but the last level; the middle: two ResNet blocks and one single-head
    self-attention over the (resolution/8)^2 positions; conv_out to 2 x 4 moments and the 1x1 quant_conv.
    Norms and activations are left out (element-wise, under 1%).
    """
    side = resolution
    macs = side * side * IMAGE_CHANNELS * ENCODER_CHANNELS[0] * 9
    channels = ENCODER_CHANNELS[0]
    for level, out_channels in enumerate(ENCODER_CHANNELS):
        for block in range(LAYERS_PER_BLOCK):
            in_channels = channels if block == 0 else out_channels
            macs += side * side * 9 * (in_channels * out_channels + out_channels * out_channels)
            if in_channels != out_channels:
                macs += side * side * in_channels * out_channels
        channels = out_channels
        if level < len(ENCODER_CHANNELS) - 1:
            side //= 2
            macs += side * side * 9 * channels * channels
    positions = side * side
    macs += 2 * positions * 9 * 2 * channels * channels  # two middle ResNet blocks
    macs += 4 * positions * channels * channels + 2 * positions * positions * channels  # attention
    macs += positions * 9 * channels * 2 * LATENT_CHANNELS + positions * (2 * LATENT_CHANNELS) ** 2
    return macs


def encoder_activation_bytes(
    resolution: int, micro_batch: int, maps: float, bytes_per_element: int = 4
) -> int:
    """No-grad working set of one encode: `maps` full-resolution 128-channel feature maps per image.

    The first level is the widest the encoder ever holds (128 x H x W). A trace of diffusers' encoder finds
    five such maps alive at once in the second ResNet block of that level: conv_in's output (held by
    Encoder.forward while down block 0 runs), the first ResNet block's output (the second's input), and in the
    second block its conv2 output, the residual sum and the division by output_scale_factor.
    """
    return int(maps * micro_batch * ENCODER_CHANNELS[0] * resolution * resolution * bytes_per_element)
