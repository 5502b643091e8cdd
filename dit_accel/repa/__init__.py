"""REPA (Yu et al., ICLR 2025): representation alignment of an early block to a frozen encoder.

`encoder`: DINOv2 ViT/14 backbones read from their published state dicts, offline, and their input.
`align`: the projector (a submodule of the network), block K's captured tokens, the alignment term.
`training`: the alignment built from the run's flags and checked against the plan; a micro-batch's targets.

Imports: the foundations and the planner only; the network holds the projector, the trainer calls it.
"""
