"""A CPU run uses one intra-op thread per process unless OMP_NUM_THREADS says otherwise, and gives the
previous count back (the trainer and sampler also run in-process, inside tests)."""

import torch

from dit_accel.cpu_threads import CPU_THREADS, cpu_threads


def test_one_thread_inside_the_block_and_the_old_count_after(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with cpu_threads():
            assert torch.get_num_threads() == CPU_THREADS == 1
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_omp_num_threads_is_the_users_word(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with cpu_threads():
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
