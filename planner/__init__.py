"""dit-accel's planner: DiT memory and throughput arithmetic in pure Python (never imports torch)."""

from planner.errors import PlanError
from planner.spec import DiTSpec, model_spec

__all__ = ["DiTSpec", "PlanError", "model_spec"]
