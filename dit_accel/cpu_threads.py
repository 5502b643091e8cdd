"""The intra-op thread count of a run on the CPU (the demo, tests, a laptop).

torch's default (one thread per core) suits large matrices on an idle machine. The models that run on a CPU
are tiny, where a second thread saves little, and the cores are often shared: with other jobs on a 2-core
box, sampling the demo model took 105 s with 2 threads and 29 s with 1 (docs/sampling.md). So training and
sampling on a machine without CUDA use one thread per process unless OMP_NUM_THREADS says otherwise; CUDA
runs are left alone (their CPU threads feed the GPU, not the math).
"""

from __future__ import annotations

import contextlib
import os

CPU_THREADS = 1


@contextlib.contextmanager
def cpu_threads():
    """Inside the block, CPU_THREADS intra-op threads where there is no CUDA and OMP_NUM_THREADS is unset;
    the previous count is restored after (tests run the trainer in-process)."""
    import torch

    if torch.cuda.is_available() or os.environ.get("OMP_NUM_THREADS"):
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(CPU_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(before)
