"""`dit-accel evaluate`, `sample --evaluate` and training's `--eval-every`: the ADM evaluator's five numbers
(FID, sFID, Inception Score, precision, recall) from an Inception-v3 that reproduces the TensorFlow graph,
without TensorFlow.

`metrics` is the arithmetic on features (numpy and torch only), `inception` the network and its weights,
`features` the batched, distributed extraction, `reference` the ADM .npz layout and the cached reference
statistics, `command` the CLI. docs/evaluation.md says how close the numbers are to the TF evaluator's.

Imports: the foundations only; sampling and training hand it images.
"""

PAPER_SAMPLES = 50_000  # FID-50K: what DiT, SiT and REPA report (here: no torch, for the light flag modules)
