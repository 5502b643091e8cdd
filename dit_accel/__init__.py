"""dit-accel: train DiT with Hugging Face Accelerate exactly as `dit-plan` planned it."""

__version__ = "0.1.0"
