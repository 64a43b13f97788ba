"""A Hub id already in the Hugging Face cache resolves offline, and with the Hub unreachable, as in transformers.

Each test builds its own cache the way huggingface_hub lays it out (``models--org--name/`` with ``blobs/``
named by content hash, ``snapshots/<commit>/`` of relative symlinks into them, and ``refs/<branch or tag>``
holding the commit) and points huggingface_hub at it. Nothing touches the network: offline, or with
``HF_ENDPOINT`` on a local port nothing listens on.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from pathlib import Path

import pytest
from huggingface_hub import constants

import normswap
from normswap import presets
from normswap.checkpoint import source
from normswap.errors import NormswapError

REPO = "some-org/tiny-gpt2"
MAIN, OLD = "1" * 40, "2" * 40


def add_snapshot(cache: Path, repo_id: str, files: Path, commit: str, refs: tuple[str, ...] = ("main",)) -> Path:
    """Put the files of directory ``files`` into ``cache`` as revision ``commit`` of ``repo_id``."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    blobs, snapshot = repo / "blobs", repo / "snapshots" / commit
    blobs.mkdir(parents=True, exist_ok=True)
    for f in sorted(p for p in files.rglob("*") if p.is_file()):
        data = f.read_bytes()
        blob = blobs / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / f.relative_to(files)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hub-src")
    main = presets.save("tiny-gpt2", root / "main")
    old = root / "old"  # an older revision: another n_positions in its config (resolved here, never loaded)
    old.mkdir()
    for f in main.iterdir():
        (old / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((old / "config.json").read_text())
    cfg["n_positions"] = 96
    (old / "config.json").write_text(json.dumps(cfg))
    return {"main": main, "old": old}


@pytest.fixture
def cache(tmp_path, saved, monkeypatch) -> Path:
    """A Hugging Face cache holding REPO at MAIN (refs/main) and OLD (tag v1), made the one in use."""
    hub = tmp_path / "hub"
    add_snapshot(hub, REPO, saved["old"], OLD, refs=("v1",))
    add_snapshot(hub, REPO, saved["main"], MAIN)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))  # what HF_HUB_CACHE / HF_HOME set at import
    return hub


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def unreachable(monkeypatch) -> None:
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port()}")


def test_offline_hub_id_resolves_from_the_cache(cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    src = source.resolve(REPO)
    assert src.kind == "hub" and src.spec == REPO
    assert src.path == cache / "models--some-org--tiny-gpt2" / "snapshots" / MAIN
    assert src.config["n_positions"] == 128 and [f.name for f in src.safetensors] == ["model.safetensors"]
    assert src.safetensors[0].is_symlink()  # the cache's own layout, read in place


def test_revision_branch_tag_and_commit(cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert source.resolve(REPO, revision="v1").config["n_positions"] == 96
    assert source.resolve(REPO, revision=OLD).path.name == OLD
    assert source.resolve(REPO, revision="main").path.name == MAIN
    with pytest.raises(NormswapError, match=r"not in the Hugging Face cache at revision 'v2' \(searched .*hub"):
        source.resolve(REPO, revision="v2")
    with pytest.raises(NormswapError, match="--revision applies to a Hub id"):
        source.resolve("tiny-gpt2", revision="v1")


def test_unreachable_hub_resolves_from_the_cache(cache, unreachable):
    assert not source.hub_reachable(timeout=1.0)
    src = source.resolve(REPO)
    assert src.path.name == MAIN and src.kind == "hub"


@pytest.mark.parametrize("offline", [True, False])
def test_an_id_not_in_the_cache_is_refused_naming_the_cache(cache, monkeypatch, offline):
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    else:
        for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
            monkeypatch.delenv(var, raising=False)
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    with pytest.raises(NormswapError) as err:
        source.resolve("some-org/not-cached")
    msg = str(err.value)
    assert "\n" not in msg and f"searched {cache}" in msg and "hf download some-org/not-cached" in msg
    assert ("HF_HUB_OFFLINE is set" if offline else "unreachable") in msg


def test_convert_a_cached_hub_id_with_the_hub_unreachable(cache, unreachable, tmp_path):
    report = normswap.convert(REPO, tmp_path / "out", verify=False)
    out = tmp_path / "out"
    assert report.output == str(out)
    manifest = json.loads((out / "config.json").read_text())["normswap"]
    assert manifest["source"] == REPO
    files = sorted(p.name for p in out.iterdir())
    assert "tokenizer.json" in files and "model.safetensors" in files
    assert not any(p.is_symlink() for p in out.iterdir())  # real files, not links into the cache
    assert type(normswap.load(out)).__name__ == "NormswapGPT2LMHeadModel"


@pytest.mark.slow
def test_load_a_converted_checkpoint_by_hub_id_from_the_cache(cache, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    normswap.convert("tiny-gpt2", tmp_path / "rms", verify=False)
    add_snapshot(cache, "some-org/tiny-gpt2-rms", tmp_path / "rms", MAIN)
    model = normswap.load("some-org/tiny-gpt2-rms", task="base", revision="main")
    assert type(model).__name__ == "NormswapGPT2Model" and normswap.plan_of(model) is not None
    with pytest.raises(NormswapError, match=f"not in the Hugging Face cache \\(searched {cache}"):
        normswap.load("some-org/other-rms")


def test_cli_offline_with_hf_home_in_a_fresh_process(saved, tmp_path, warm_python):
    """The real command, its environment read at start-up as in a job on a compute node: HF_HOME's cache.

    A child of the warm fork server (``tests/warm_python.py``): the server started with ``HF_HOME`` its own
    directory and every other ``HF_*`` cache variable unset (what this test's fresh interpreter was given), and
    never imported normswap; the child reads the Hub cache from that ``HF_HOME`` as the fresh interpreter did."""
    with warm_python.hub_cache() as hub:
        add_snapshot(hub, REPO, saved["main"], MAIN)
        res = warm_python.run("from normswap.cli import main; main()", "convert", REPO, "--out",
                              str(tmp_path / "rms"), "--mode", "exact", "--no-verify", "-q", timeout=600)
    assert res.returncode == 0, res.stderr
    assert json.loads((tmp_path / "rms" / "config.json").read_text())["normswap"]["source"] == REPO
