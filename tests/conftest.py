"""Shared test setup: never touch the network, deterministic seeds, float64 comparisons."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def _share_the_cores() -> None:
    """Under pytest-xdist (``-n``, set in pyproject.toml), each worker gets its share of the cores for
    torch's intra-op threads, rather than every worker starting as many threads as there are cores."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


_share_the_cores()
