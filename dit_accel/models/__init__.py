"""The networks and their weights: DiT (`dit`, diffusers' DiTTransformer2DModel with one shared embedder), its
diffusers layout in and out (`diffusers_format`), regional compilation (`compile`), the frozen VAE that makes
latents (`vae`), and the published DiT, SiT and REPA checkpoints read into the DiT (`original_dit`,
`original_sit`).

Imports: the foundations (errors, atomic) and the planner's spec only. A network knows nothing of run
folders, objectives or the trainer; they hand it tensors.
"""
