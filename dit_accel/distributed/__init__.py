"""Many processes as one run: the Accelerator the plan describes and the launch checked against it
(`accelerator`), FSDP2's per-block units and FSDP on a CPU (`fsdp`), and decisions the main process takes that
every rank follows without a hang (`consensus`).

Imports: the foundations and the planner only: it is handed the plan and plain settings, never the
trainer's config.
"""
