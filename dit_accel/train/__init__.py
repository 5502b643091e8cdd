"""The trainer: `python -m dit_accel.train` runs `loop`, a training loop that reads top to bottom. Its parts:
the run's settings (`config`, with `recipe` files), the launch that `dit-accel train` makes (`launch`), the
batches (`data`), the components and one optimizer step (`step`), AdamW and its schedule (`optim`), the EMA
(`ema`), where a run starts and what it restores (`resume`), the log line and metrics (`steplog`), the
trackers (`trackers`), and in-training sampling and evaluation (`samples`, `evaluation`).

Imports: every package below it (models, diffusion, repa, evaluate, distributed, run, data, sample) and the
planner. Nothing imports `train.loop` (tests aside): the commands above use the parts.
"""
