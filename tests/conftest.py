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


_modules_when_frozen = [0]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After a test that imported modules, freeze again what is alive (as after collection): the modules a
    test imports lazily (a model family's modeling file, ``torch._dynamo``, onnxscript, peft: tens of
    thousands of objects each) live to the end of the run, and every full collection walked them all, the
    automatic ones and the ``gc.collect()`` each conversion makes (``test_streaming_combos.py`` alone: 93 full
    collections, 12.8 of its 40 CPU s). A test that imports nothing new costs nothing here; one that does
    pays one full collection first, so that the garbage it left is collected, not frozen."""
    yield
    import gc

    if len(sys.modules) != _modules_when_frozen[0]:
        gc.collect()
        gc.freeze()
        _modules_when_frozen[0] = len(sys.modules)


@pytest.fixture(scope="session")
def warm_python():
    """A fork server with torch and transformers' modeling stack imported (``tests/warm_python.py``), for
    checks that need a new process but not an empty interpreter; started on first use, one per worker. Its
    ``HF_HOME`` is an empty directory of its own (``warm_python.hf_home``), for the checks about the Hub cache
    and remote code read from the environment a process starts with."""
    from tests.warm_python import WarmPython

    server = WarmPython()
    yield server
    server.close()


# Test files that share a per-process fixture, each group run by one xdist worker. ``--dist loadfile`` hands out
# work by file, so files sharing a session fixture that is expensive to build each built it again on the other
# worker about half the time: the warm fork server (~8 CPU s to start: torch and transformers' modeling stack
# imported), the ONNX files' tiny models and exports (``onnx_exports``: each dynamo export 3-4 CPU s, six of them
# and the ViT program asked for by both files).
SHARED_WORK = {
    "warm-python": ("tests/integrations/test_trainer_decay.py", "tests/integrations/test_torch_export.py",
                    "tests/rotation/test_rotate_checkpoint.py", "tests/checkpoint/test_faults.py",
                    "tests/recipes/test_recipe_fsdp.py", "tests/checkpoint/test_checkpoint.py",
                    "tests/checkpoint/test_hub_cache.py", "tests/integrations/test_peft_adapter_bases_files.py",
                    "tests/recipes/test_example_script.py", "tests/recipes/test_recipe_distributed.py",
                    "tests/test_interrupts.py"),
    "onnx-exports": ("tests/integrations/test_onnx_export.py", "tests/integrations/test_onnx_fusion.py"),
}
_GROUP_OF = {path: group for group, paths in SHARED_WORK.items() for path in paths}


def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` with the files of each :data:`SHARED_WORK` group as one unit of work (one worker runs
    them all, one after the other); every other file is its own unit, as before."""
    if config.getoption("dist", None) != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedWorkScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return _GROUP_OF.get(path, path)

    return SharedWorkScheduling(config, log)
