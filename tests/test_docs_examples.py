"""Every code example in README.md and the documentation runs, or says why it cannot.

A ```python, ```bash, ```sh, ```shell or ```console block in ``README.md``, ``docs/**/*.md``,
``recipes/README.md`` or ``normswap/backends/README.md`` is run here, offline, unless the line before
its fence (blank lines aside) is a marker ``<!-- docs-test: REASON -->`` with one of the reasons in ``REASONS``
(docs/writing-docs.md). A renamed option or function then fails this test instead of misleading a
reader.

How blocks run:

* one temporary working directory per page, shared by that page's blocks, which run in the order
  they appear (a later block may use what an earlier one wrote or defined);
* python blocks in this process, in one namespace per page, with the working directory as cwd;
* shell blocks with ``bash -e`` in that directory, with ``normswap`` and ``python`` on PATH being this
  checkout's (``PYTHONPATH`` set to it) and the Hugging Face Hub switched off; in a ```console block
  only the lines that start with ``$ `` are commands. The two commands run in children forked from
  one server that imported torch and transformers once (``tests/docs_runner.py``), so an example
  costs its own work, not an interpreter start each.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# the reasons a block may be left out; anything else in a marker is an error
REASONS = {
    "hub": "downloads from the Hugging Face Hub",
    "gpu": "needs a CUDA GPU",
    "install": "installs packages (CI's own install runs the same commands)",
    "ci": "CI runs it itself from the checkout (.ci/run)",
    "no-run": "illustrative: placeholders for the reader's own files or models",
    "slow": "minutes of CPU (a benchmark, a full training run)",
}
LANGS = {"python": "python", "py": "python", "bash": "shell", "sh": "shell", "shell": "shell", "console": "console"}
MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*([\w-]+)\s*(?::[^>]*)?-->\s*$")
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)[^\n]*$")


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str  # python | shell | console | other
    code: str
    marker: str | None

    @property
    def where(self) -> str:
        path = self.path.relative_to(REPO) if self.path.is_relative_to(REPO) else self.path.name
        return f"{path}:{self.line}"


def pages() -> list[Path]:
    found = [REPO / "README.md", REPO / "normswap" / "backends" / "README.md", REPO / "recipes" / "README.md"]
    found += sorted((REPO / "docs").rglob("*.md"))
    return [p for p in found if p.is_file()]


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of one markdown file, each with the docs-test marker above it (if any)."""
    lines = path.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, info = m.group(1), m.group(2), m.group(3).lower()
        j = i - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        mk = MARKER.match(lines[j]) if j >= 0 else None
        body = []
        k = i + 1
        while k < len(lines) and not (lines[k].strip().startswith(fence[0] * len(fence))
                                      and lines[k].strip().strip(fence[0]) == ""):
            body.append(lines[k][len(indent):] if lines[k].startswith(indent) else lines[k])
            k += 1
        out.append(Block(path, i + 1, LANGS.get(info, "other"), "\n".join(body) + "\n", mk.group(1) if mk else None))
        i = k + 1
    return out


def stray_markers(path: Path) -> list[str]:
    """Markers that are not followed by a fence: a typo would otherwise leave a block unmarked."""
    lines = path.read_text().splitlines()
    bad = []
    for n, line in enumerate(lines):
        if not (line.lstrip().startswith("<!--") and "docs-test" in line):
            continue
        if not MARKER.match(line):
            bad.append(f"{path.relative_to(REPO)}:{n + 1}: malformed marker {line.strip()!r}")
            continue
        nxt = next((ln for ln in lines[n + 1:] if ln.strip()), "")
        if not FENCE.match(nxt):
            bad.append(f"{path.relative_to(REPO)}:{n + 1}: marker not followed by a code fence")
    return bad


def _runnable(path: Path) -> list[Block]:
    return [b for b in blocks(path) if b.lang != "other" and b.marker is None]


# --------------------------------------------------------------------------------------------- the checks
def test_markers_are_known_and_attached():
    problems = []
    for path in pages():
        problems += stray_markers(path)
        for b in blocks(path):
            if b.marker is not None and b.marker not in REASONS:
                problems.append(f"{b.where}: unknown docs-test reason {b.marker!r} (known: {', '.join(REASONS)})")
            if b.lang != "other" and b.marker is None and re.search(r"\bpip install\b", b.code):
                problems.append(f"{b.where}: a `pip install` block must be marked <!-- docs-test: install -->")
    assert not problems, "\n".join(problems)


def test_the_readme_and_docs_have_examples_that_run():
    """The harness is not vacuous: the README and the getting-started page run their examples."""
    for name in ("README.md", "docs/getting-started.md"):
        kinds = {b.lang for b in _runnable(REPO / name)}
        assert {"python", "shell"} <= kinds, (name, kinds)


def _env() -> dict[str, str]:
    pythonpath = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**os.environ, "PYTHONPATH": pythonpath, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1", "TQDM_DISABLE": "1", "PYTHONWARNINGS": "ignore"}


@pytest.fixture(scope="module")
def shell_env():
    """PATH with ``normswap`` and ``python`` shims that run this checkout through one fork server
    (``tests/docs_runner.py``: torch and transformers imported once, not once per command)."""
    tmp = Path(tempfile.mkdtemp(prefix="nsdocs-"))
    sock = str(tmp / "s")
    runner = Path(__file__).with_name("docs_runner.py")
    env = _env()
    server = subprocess.Popen([sys.executable, str(runner), "serve", sock], env=env, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert server.stdout.readline().strip() == "ready", "the docs example server did not start"
        bindir = tmp / "bin"
        bindir.mkdir()
        for name, kind in (("normswap", "normswap"), ("python", "python"), ("python3", "python")):
            f = bindir / name
            f.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{runner}" client "{sock}" {kind} "$@"\n')
            f.chmod(f.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        yield {**env, "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"}
    finally:
        server.kill()
        server.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def _shell(code: str, lang: str) -> str:
    if lang == "console":
        code = "\n".join(ln[2:] for ln in code.splitlines() if ln.startswith("$ ")) + "\n"
    return "set -euo pipefail\n" + code


RUN_PAGES = [p for p in pages() if _runnable(p)]


def run_page(page: Path, work: Path, env: dict[str, str]) -> None:
    """Run the page's unmarked blocks in order in ``work``; AssertionError names the failing block."""
    namespace: dict = {"__name__": "__docs__"}
    cwd = os.getcwd()
    os.chdir(work)
    try:
        for b in _runnable(page):
            if b.lang == "python":
                try:
                    exec(compile(b.code, b.where, "exec"), namespace)
                except Exception as e:  # noqa: BLE001 - the block's location is what the reader needs
                    raise AssertionError(f"{b.where}: the python example failed: {type(e).__name__}: {e}") from e
            else:
                proc = subprocess.run(["bash", "-c", _shell(b.code, b.lang)], cwd=work, env=env,
                                      capture_output=True, text=True, timeout=600)
                assert proc.returncode == 0, (
                    f"{b.where}: the shell example exited {proc.returncode}\n--- block\n{b.code}"
                    f"--- stdout (tail)\n{proc.stdout[-2000:]}\n--- stderr (tail)\n{proc.stderr[-3000:]}")
    finally:
        os.chdir(cwd)


@pytest.mark.parametrize("page", RUN_PAGES, ids=[str(p.relative_to(REPO)) for p in RUN_PAGES])
def test_examples_run(page: Path, tmp_path: Path, monkeypatch, shell_env):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    work = tmp_path / "work"
    work.mkdir()
    run_page(page, work, shell_env)


def test_a_stale_example_fails(tmp_path: Path, shell_env):
    """What the harness is for: an unmarked block that uses a renamed option or name fails, and a
    marked one is not run."""
    page = tmp_path / "page.md"
    page.write_text("```bash\nnormswap --version\n```\n\n"
                    "<!-- docs-test: hub -->\n```bash\nexit 3\n```\n\n"
                    "```bash\nnormswap convert tiny-gpt2 --out o --no-such-option\n```\n")
    with pytest.raises(AssertionError, match=r"page.md:10: the shell example exited 2"):
        run_page(page, tmp_path, shell_env)
    page.write_text("```python\nimport normswap\nnormswap.no_such_function\n```\n")
    with pytest.raises(AssertionError, match=r"page.md:1: the python example failed: AttributeError"):
        run_page(page, tmp_path, shell_env)


def test_readme_architecture_counts_match_the_matrix():
    """The README quotes the generated matrix (docs/architectures.md); regenerating it must not leave
    the README's counts stale."""
    rows = [ln for ln in (REPO / "docs" / "architectures.md").read_text().splitlines() if ln.startswith("| `")]
    counts = {"all": 0, "partly": 0, "rms": 0, "none": 0}
    types = set()
    for ln in rows:
        cells = [c.strip() for c in ln.strip().strip("|").split("|")]
        types.add(cells[1])
        norms, exact, skipped = int(cells[3]), int(cells[4].split()[0]), int(cells[6])
        kind = ("all" if exact == norms else "partly" if exact else "rms" if skipped == norms else "none")
        counts[kind] += 1
    readme = " ".join((REPO / "README.md").read_text().split())
    claim = (f"{len(rows)} tiny random configurations covering {len(types)} Hugging Face model types are converted "
             f"and checked against float64 in the test suite: {counts['all']} come out fully exact, "
             f"{counts['partly']} (Post-LN) partly exact and partly approximate, {counts['rms']} are already "
             f"RMS-normed (their γ can still be folded) and {counts['none']} have no exact norm")
    assert claim in readme, claim
    exact_entries = counts["all"] + counts["partly"]
    assert f"exactness, {exact_entries} zoo architectures with exact norms" in readme


def test_readme_quickstart_is_what_ci_runs():
    """The README's second quickstart command is CI's install and test command (.ci/run)."""
    readme = (REPO / "README.md").read_text()
    line = next(ln for ln in readme.splitlines() if ln.endswith("&& python -m pytest -q"))
    ci = (REPO / ".ci" / "run").read_text()
    pip = "python -m pip install -q --disable-pip-version-check "
    for step in line.split(" && "):
        want = pip + step[len("pip install "):] if step.startswith("pip install ") else step
        assert re.search(r"(?m)^" + re.escape(want) + "$", ci), f"{want!r} is not a line of .ci/run"


# --------------------------------------------------------------------------------------------- in sequence
def reading_order() -> list[Path]:
    """The pages as a reader meets them: the README, then mkdocs.yml's nav, then the other pages."""
    nav = re.findall(r"^\s*-\s*(?:[^:\n]+:\s*)?([\w/.-]+\.md)\s*$", (REPO / "mkdocs.yml").read_text(), re.M)
    ordered = [REPO / "README.md", *(REPO / "docs" / name for name in nav)]
    return ordered + [p for p in pages() if p not in ordered]


# the destinations an example writes: `normswap convert SRC --out DIR`, normswap.convert/save(x, "DIR", ...)
_SHELL_WRITE = re.compile(r"normswap convert \S+[^\n#]*?--out (\S+)([^\n#]*)")
_PY_WRITE = re.compile(r"normswap\.(?:convert|save)\(\s*[^,()]+,\s*[\"']([^\"']+)[\"']([^)]*)\)")


def writes(block: Block) -> list[tuple[str, bool]]:
    """(destination, overwrites) for every checkpoint an example block writes to a literal path."""
    if block.lang == "python":
        return [(m[1], "overwrite=True" in m[2]) for m in _PY_WRITE.finditer(block.code)]
    found = []
    for m in _SHELL_WRITE.finditer(block.code):
        flags = m.group(0)
        found.append((m[1], "--overwrite" in flags))
    return found


def test_examples_run_one_after_another_in_one_directory():
    """A reader runs the pages in order in one directory (README's quickstart, Getting started, then
    the guides): no example may write a checkpoint directory that an earlier one already wrote unless
    it says overwrite (the write would fail with "exists and is not empty"). The placeholders of
    ``no-run``/``hub``/``gpu`` blocks are not the reader's files and are left out."""
    first: dict[str, str] = {}
    clashes = []
    for page in reading_order():
        for b in blocks(page):
            if b.lang == "other" or b.marker in ("no-run", "hub", "gpu"):
                continue
            for dest, overwrites in writes(b):
                if dest in first and not overwrites:
                    clashes.append(f"{b.where}: writes {dest}, which {first[dest]} already wrote (pass overwrite)")
                first.setdefault(dest, b.where)
    assert not clashes, "\n".join(clashes)


def test_the_sequence_check_sees_what_examples_write():
    page = Block(REPO / "x.md", 1, "shell", "normswap convert tiny-gpt2 --out a --format compat  # x\n"
                 "normswap convert tiny-bert --out b --overwrite\n", None)
    assert writes(page) == [("a", False), ("b", True)]
    code = 'normswap.convert("tiny-gpt2", "c")\nnormswap.save(model, "d", tokenizer=t, overwrite=True)\n'
    assert writes(Block(REPO / "x.md", 1, "python", code, None)) == [("c", False), ("d", True)]
    assert reading_order()[:3] == [REPO / "README.md", REPO / "docs" / "index.md", REPO / "docs" / "getting-started.md"]
