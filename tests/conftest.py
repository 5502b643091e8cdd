"""Every test runs offline, with a private HF_HOME so a stray user config or cache is never read.

Tiers: `launched` tests start real processes, `slow` ones trace whole models in-process; every other test
is marked `unit` here, so `python -m pytest -m unit` is the fast tier a developer runs while working.
CI runs all of them."""

import os

import pytest


@pytest.fixture(autouse=True)
def _isolated_hf_home(tmp_path_factory, monkeypatch):
    home = tmp_path_factory.getbasetemp() / "hf_home"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))


def pytest_configure(config):
    """One intra-op thread per test process, as every launched command runs (OMP_NUM_THREADS=1 above): torch
    otherwise starts one per core, and the xdist workers, each with its threads, contend for the same cores,
    running the small ops of these tiny models several times slower. OMP_NUM_THREADS set by the caller wins."""
    if "OMP_NUM_THREADS" not in os.environ:
        import torch

        torch.set_num_threads(1)


def pytest_collection_modifyitems(items):
    for item in items:
        if not any(item.get_closest_marker(name) for name in ("launched", "slow")):
            item.add_marker(pytest.mark.unit)
