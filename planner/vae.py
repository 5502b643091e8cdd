"""The VAE encoder that `--latents online` runs on every micro-batch, for each tokenizer (planner.spec.TOKENIZERS).

  sd-vae  the Stable Diffusion VAE DiT uses: diffusers' AutoencoderKL with block_out_channels (128, 256, 512,
          512), two ResNet blocks a level, one attention block in the middle, 4 latent channels.
  va-vae  VA-VAE f16d32, LightningDiT's: the LDM autoencoder with (128, 128, 256, 256, 512), two ResNet blocks a
          level, self-attention after each block of the last level (16 px at 256) beside the middle's, 32
          latent channels.

Sizes and compute follow from the architecture; tests hold the parameter counts to meta-device AutoencoderKLs
and the multiply-adds to torch's flop counter.
"""

from __future__ import annotations

from dataclasses import dataclass

IMAGE_CHANNELS = 3


@dataclass(frozen=True)
class EncoderShape:
    channels: tuple[int, ...]  # per level
    latent_channels: int
    attention_levels: tuple[int, ...] = ()  # levels whose ResNet blocks are each followed by self-attention
    layers_per_block: int = 2
    encoder_params: int = 0  # encoder + quant_conv, counted from the architecture by a test
    params: int = 0  # the whole autoencoder (the decoder too), as it is loaded


ENCODERS = {
    "sd-vae": EncoderShape((128, 256, 512, 512), 4, encoder_params=34_163_664, params=83_653_863),
    "va-vae": EncoderShape((128, 128, 256, 256, 512), 32, (4,), encoder_params=28_417_408, params=69_836_067),
}
ENCODER_CHANNELS = ENCODERS["sd-vae"].channels
ENCODER_PARAMS = ENCODERS["sd-vae"].encoder_params
LAYERS_PER_BLOCK = 2
LATENT_CHANNELS = ENCODERS["sd-vae"].latent_channels


def _attention_macs(positions: int, channels: int) -> int:
    """One single-head self-attention block over `positions`: q, k, v and out 1x1, scores and the mix."""
    return 4 * positions * channels * channels + 2 * positions * positions * channels


def encoder_macs_per_image(resolution: int, tokenizer: str = "sd-vae") -> int:
    """Multiply-adds of one encoder forward on a resolution x resolution image.

    conv_in; per level the ResNet blocks (two 3x3 convs each, a 1x1 shortcut when channels change), each
    followed by self-attention at an attention level, and a stride-2 3x3 downsample on all but the last level;
    the middle: two ResNet blocks and one self-attention; conv_out to 2 x latent moments and the 1x1 quant_conv.
    Norms and activations are left out (element-wise, under 1%).
    """
    shape = ENCODERS[tokenizer]
    side = resolution
    macs = side * side * IMAGE_CHANNELS * shape.channels[0] * 9
    channels = shape.channels[0]
    for level, out_channels in enumerate(shape.channels):
        for block in range(shape.layers_per_block):
            in_channels = channels if block == 0 else out_channels
            macs += side * side * 9 * (in_channels * out_channels + out_channels * out_channels)
            if in_channels != out_channels:
                macs += side * side * in_channels * out_channels
            if level in shape.attention_levels:
                macs += _attention_macs(side * side, out_channels)
        channels = out_channels
        if level < len(shape.channels) - 1:
            side //= 2
            macs += side * side * 9 * channels * channels
    positions, latent = side * side, shape.latent_channels
    macs += 2 * positions * 9 * 2 * channels * channels  # two middle ResNet blocks
    macs += _attention_macs(positions, channels)
    macs += positions * 9 * channels * 2 * latent + positions * (2 * latent) ** 2
    return macs


def encoder_activation_bytes(
    resolution: int, micro_batch: int, maps: float, bytes_per_element: int = 4
) -> int:
    """No-grad working set of one encode: `maps` full-resolution 128-channel feature maps per image.

    The first level is the widest the encoder ever holds (128 x H x W, in both tokenizers). A trace of
    diffusers' encoder finds five such maps alive at once in the second ResNet block of that level: conv_in's
    output (held by Encoder.forward while down block 0 runs), the first ResNet block's output (the second's
    input), and in the second block its conv2 output, the residual sum and the division by output_scale_factor.
    """
    return int(maps * micro_batch * ENCODER_CHANNELS[0] * resolution * resolution * bytes_per_element)


def autoencoder_params(tokenizer: str, assumed_sd_vae_params: int) -> int:
    """The whole autoencoder's parameters, loaded for online latents: the Stable Diffusion VAE's is an
    assumption (`--assume vae_params=`), VA-VAE's its architecture's."""
    return assumed_sd_vae_params if tokenizer == "sd-vae" else ENCODERS[tokenizer].params
