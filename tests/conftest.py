"""Shared test setup: never touch the network, deterministic seeds, float64 comparisons."""

import os
import sys

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def _share_the_cores() -> None:
    """Under pytest-xdist (``-n``, set in pyproject.toml), each worker gets its share of the cores for
    torch's intra-op threads, rather than every worker starting as many threads as there are cores.

    The share is also put in ``OMP_NUM_THREADS`` (unless set already), so that the processes a test
    starts (the CLI in a fresh interpreter, the docs examples' fork server, distributed recipes) keep to
    it too: with two workers on two cores, a child's two OpenMP threads spin-wait on each other and a
    tiny model's step gets tens of times slower (docs/rotation.md's learned rotation: 0.5 s with one
    thread, 20 s with two on a loaded 2-core machine)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        share = max(1, (os.cpu_count() or 1) // workers)
        os.environ.setdefault("OMP_NUM_THREADS", str(share))
        torch.set_num_threads(share)


_share_the_cores()


def _keep_bytecode() -> None:
    """Let this run write bytecode (``__pycache__``, git-ignored) where ``PYTHONDONTWRITEBYTECODE`` says not to
    (the CI machine's image sets it), for this process and the ones it starts.

    Without it nothing is ever cached: each xdist worker compiles normswap's and the tests' sources again and
    pytest rewrites every test module's asserts again (collection: 28 CPU s a process instead of 13.5 s once
    the caches exist, measured with ``--collect-only -n 0``), and every fresh interpreter a test starts (the
    CLI, recipes, interrupts, ~50 of them) compiles the normswap modules it imports. Reading bytecode is not
    affected by the variable, so one process's cache serves all the later ones."""
    if sys.dont_write_bytecode or os.environ.get("PYTHONDONTWRITEBYTECODE"):
        sys.dont_write_bytecode = False
        os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


_keep_bytecode()


def pytest_collection_finish(session) -> None:
    """Freeze what collection left alive (the imported torch, transformers and test modules: ~400,000
    objects that live to the end anyway) out of the cyclic garbage collector's reach. Conversions call
    ``gc.collect()`` to free a model before the next one is loaded; each call walked all of them, ~0.3 s,
    up to five times a conversion. Objects the tests create later are collected as before."""
    import gc

    gc.collect()
    gc.freeze()


@pytest.fixture(scope="session")
def warm_python():
    """A fork server with torch and transformers' modeling stack imported (``tests/warm_python.py``), for
    checks that need a new process but not an empty interpreter; started on first use, one per worker."""
    from tests.warm_python import WarmPython

    server = WarmPython()
    yield server
    server.close()
