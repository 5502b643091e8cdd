"""Weights out of and into dit-accel as run folders: `dit-accel export` (a run as a diffusers DiTPipeline
folder, `export`) and `import-dit`, `import-sit`, `import-repa` (a published `.pt` as a step-0 run,
`imports`).

Imports: models (the conversions themselves), diffusion, run, data and sample; the commands sit at the top
with the rest.
"""
