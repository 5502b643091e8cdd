"""`dit-accel sample` (`command`, its flags in `args` without torch): PNG grids and the evaluation batch
(`eval_batch`), from the sampling every caller shares (`generate`: settings, seeds, labels, weights and
decoder, the sampler run to images). `python -m dit_accel.sample` runs the command in every rank of
`accelerate launch`.

Imports: the foundations, models, diffusion, evaluate, run and data; never the trainer (training's
in-loop sampling imports this package, not the other way).
"""
