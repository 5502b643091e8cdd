"""How a network learns to denoise and how it samples: DiT's diffusion (`objective`, `sampling`) and the flow
objective of SiT and REPA (`flow`, `flow_sampling`); `names`, the choices their flags take, without torch.
See docs/model.md for the formulas.

Imports: the foundations only (errors, progress); never a network, a run folder or the trainer: a sampler
is handed a model function, an objective is handed tensors."""
