"""What makes a run survive a cluster: checkpoints that count only once complete (`checkpoint`) and their
timeline and manifest (`lineage`), the weights a run folder holds, read for sampling and fine-tuning
(`weights`), one run per folder (`lock`), stop signals noticed at a step boundary (`preemption`), a rank
that stopped making progress (`watchdog`), the per-rank logs (`logs`), and test-only fault injection
(`faults`).

Imports: the foundations, `models` and `repa` (what a checkpoint's weights are), `distributed` (the
collectives a save agrees in) and the planner; never the trainer, which drives it.
"""
