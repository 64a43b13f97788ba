"""Build every zoo entry, convert it, and write the documentation's supported-architecture matrix.

The zoo (``tests/zoo.py``) holds one tiny random config per architecture family normswap supports:
LayerNorm γ/β, every bias and LayerScale λ randomised, eval mode, float64. For each entry this script
plans and converts the model, measures the converted model against a float64 reference on inputs the
analysis never saw, and prints one markdown row. ``--write`` replaces the table between the
``zoo-table`` markers in docs/architectures.md.

Columns: model type (``config.model_type``), family, LayerNorm-like modules found, verdict counts
(exact, of which with a centering op; approximate; skipped), the fp64 max relative error of
``patch(mode="exact")`` (approximate norms kept as LayerNorm; already-RMS models with
``fold_gamma=True``), rotation-readiness after ``patch(fold_gamma=True)`` + ``normswap.rotate``, and
the bf16 error ratio of an all-exact conversion. Exit status 1 when an entry contradicts the zoo's
claim (an ``EXACT`` entry with an approximate norm, ...) or an exact conversion misses 1e-9.

    python benchmarks/zoo_table.py                # print the table (~3 min on 2 CPU cores)
    python benchmarks/zoo_table.py --write        # and rewrite it in docs/architectures.md
    python benchmarks/zoo_table.py --only gpt2,bert --no-extras   # a few rows, no rotation/bf16
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import re
import sys
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

import normswap  # noqa: E402
from normswap import NormswapError  # noqa: E402
from normswap.analysis.plan import CENTERED_VERDICTS, EXACT_VERDICTS  # noqa: E402
from normswap.inputs import cast_inputs, hf_example_inputs  # noqa: E402
from normswap.pipeline import default_dtype  # noqa: E402
from normswap.surgery.verify import compare, dtype_error_ratio  # noqa: E402
from tests.zoo import APPROXIMATE, EXACT, MORE, RMS, SSM, build, float64_casts, float64_reference  # noqa: E402

BEGIN, END = "<!-- zoo-table:begin -->", "<!-- zoo-table:end -->"
EXACT_LIMIT = 1e-9  # the bound tests/test_patch_hf.py asserts for exact conversions

# (class-name test, family), first match wins
FAMILIES = (
    (lambda c: c.startswith("Whisper"), "speech encoder-decoder"),
    (lambda c: c.endswith("ForCTC"), "speech encoder (CTC)"),
    (lambda c: c == "CLIPModel", "text + vision encoders"),
    (lambda c: c.startswith("CLIPText"), "text encoder"),
    (lambda c: c.startswith("CLIPVision"), "vision encoder"),
    (lambda c: c.endswith("ViTModel"), "vision encoder"),
    (lambda c: c.endswith("ForCausalLM") or c.endswith("LMHeadModel"), "decoder LM"),
    (lambda c: c.endswith("ForMaskedLM"), "encoder (masked LM)"),
    (lambda c: c.endswith("ForConditionalGeneration") or c.endswith("MTModel"), "encoder-decoder"),
    (lambda c: c.endswith("ForImageClassification"), "vision classifier"),
)


SSM_FAMILY = "state-space / hybrid LM"  # the zoo's SSM table: Mamba, RWKV, xLSTM, hybrids


def family(cls_name: str) -> str:
    return next((f for test, f in FAMILIES if test(cls_name)), "other")


def entries(only: set[str] | None = None) -> list[tuple[str, dict, str]]:
    """(zoo name, table, claimed verdict) for every zoo entry: exact | approximate | skipped."""
    out = [(n, EXACT, "exact") for n in EXACT] + [(n, {n: MORE[n][0]}, MORE[n][1]) for n in MORE]
    out += [(n, APPROXIMATE, "approximate") for n in APPROXIMATE] + [(n, RMS, "skipped") for n in RMS]
    out += [(n, {n: SSM[n][0]}, SSM[n][1]) for n in SSM]
    return [e for e in out if only is None or e[0] in only]


def _claim_problem(claim: str, counts: dict[str, int], n_sites: int) -> str:
    exact = sum(counts[v] for v in EXACT_VERDICTS)
    if claim == "exact" and (counts["approximate"] or not exact):
        return "zoo claims exact"
    if claim == "approximate" and not counts["approximate"]:
        return "zoo claims approximate norms"
    if claim == "skipped" and n_sites:
        return "zoo claims every norm skipped"
    return ""


def _rotation(model: torch.nn.Module) -> str:
    rotated = copy.deepcopy(model)
    try:
        normswap.patch(rotated, fold_gamma=True, mode="exact")
    except NormswapError as exc:  # shown in the table, not hidden: the model is left unchanged
        return f"**fails**: {str(exc).split(';')[0]}"
    if normswap.plan_of(rotated) is None:
        return "no: no exact norm"
    rot = normswap.rotate(rotated, 0)
    if rot.rotated and not rot.skipped:
        return "yes"
    why = rot.skipped[0]["reason"] if rot.skipped else ""
    return ("partly: " if rot.rotated else "no: ") + why if why else "no"


def _bf16_ratio(model: torch.nn.Module) -> str:
    converted = copy.deepcopy(model)
    report = normswap.patch(converted)
    probe = hf_example_inputs(model, batch=8, seq=32, seed=11)
    with torch.no_grad(), default_dtype(torch.float64):
        ref = model(**probe)
    args, kwargs = cast_inputs((), probe, torch.bfloat16)
    with torch.no_grad():
        a = compare(ref, copy.deepcopy(model).to(torch.bfloat16)(*args, **kwargs))
        b = compare(ref, converted.to(torch.bfloat16)(*args, **kwargs), set(report.plan.changed_outputs))
    r = dtype_error_ratio(a, b)
    return f"{r:.2f}" if r is not None else "-"


def row(name: str, table: dict, claim: str, extras: bool) -> dict:
    model = build(table, name)
    cls = type(model).__name__
    plan = normswap.plan(model)
    counts = plan.counts()
    n_norms = len(plan.sites) + len(plan.skipped)
    has_approx = counts["approximate"] > 0
    rms_only = not plan.sites

    # fp64: patch(mode="exact") against a float64 reference, on inputs the analysis did not run on
    converted = copy.deepcopy(model)
    reference = float64_reference(model)
    probe = hf_example_inputs(model, seed=123)
    with torch.no_grad(), default_dtype(torch.float64):
        ref = reference(**probe)
    report = normswap.patch(converted, mode="exact", fold_gamma=rms_only)
    error = None
    if report.changed:
        if rms_only:  # HF's RMS norms (gated ones too) round to float32 inside: compare the math
            with torch.no_grad(), default_dtype(torch.float64), float64_casts():
                ref = reference(**probe)
        with torch.no_grad(), default_dtype(torch.float64), float64_casts() if rms_only else contextlib.nullcontext():
            out = converted(**probe)
        figs = compare(ref, out, set(report.plan.changed_outputs))
        error = figs.get("worst_rel_error_any_output")

    problem = _claim_problem(claim, counts, len(plan.sites))
    if error is not None and error > EXACT_LIMIT:
        problem = problem or f"exact conversion off by {error:.1e}"
    rotation = ratio = "-"
    if extras:
        rotation = _rotation(model) if not rms_only else "-"
        ratio = _bf16_ratio(model) if not has_approx and not rms_only else "-"
    return {"entry": name, "model_type": model.config.model_type, "class": cls,
            "family": SSM_FAMILY if name in SSM else family(cls),
            "norms": n_norms, "exact": sum(counts[v] for v in EXACT_VERDICTS),
            "centered": sum(counts[v] for v in CENTERED_VERDICTS), "approximate": counts["approximate"],
            "skipped": counts["skipped"], "error": error, "gamma_folded": rms_only and report.changed,
            "rotation": rotation, "bf16": ratio, "problem": problem}


def _error_cell(r: dict) -> str:
    if r["error"] is None:
        return "-"
    cell = "0" if r["error"] == 0 else f"{r['error']:.1e}"
    return cell + (" (γ folded)" if r["gamma_folded"] else "")


def markdown(rows: list[dict], extras: bool) -> str:
    head = ["zoo entry", "model type", "family", "norms", "exact", "approximate", "skipped", "fp64 max rel. error"]
    if extras:
        head += ["rotation (fold_gamma=True)", "bf16 ratio"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        exact = str(r["exact"]) + (f" ({r['centered']} with centering)" if r["centered"] else "")
        cells = [f"`{r['entry']}`", f"`{r['model_type']}`", r["family"], str(r["norms"]), exact,
                 str(r["approximate"]), str(r["skipped"]), _error_cell(r)]
        if extras:
            cells += [r["rotation"].replace("|", "/"), r["bf16"]]
        if r["problem"]:
            cells[0] += f" **({r['problem']})**"
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", "--readme", dest="write", action="store_true",
                    help="rewrite the table between the zoo-table markers of docs/architectures.md")
    ap.add_argument("--only", default="", help="comma-separated zoo entries (prints only)")
    ap.add_argument("--no-extras", action="store_true", help="skip the rotation and bf16 columns (faster)")
    args = ap.parse_args()
    if args.write and (args.only or args.no_extras):
        raise SystemExit("--write rewrites the whole table: run it without --only / --no-extras")
    warnings.filterwarnings("ignore")
    only = set(args.only.split(",")) if args.only else None
    todo = entries(only)
    if only and len(todo) != len(only):
        known = {e[0] for e in entries()}
        raise SystemExit(f"unknown zoo entries: {', '.join(sorted(only - known))}")
    t0 = time.time()
    rows = []
    for name, table, claim in todo:
        rows.append(row(name, table, claim, not args.no_extras))
        print(f"[{name}] {time.time() - t0:.0f}s", file=sys.stderr, flush=True)
    rows.sort(key=lambda r: (r["family"], r["model_type"], r["entry"]))
    md = markdown(rows, not args.no_extras)
    print(md)
    if args.write:
        page = REPO / "docs" / "architectures.md"
        text = page.read_text()
        if BEGIN not in text or END not in text:
            raise SystemExit("docs/architectures.md has no zoo-table markers")
        versions = f"torch {torch.__version__}, transformers {__import__('transformers').__version__}"
        block = (f"{BEGIN}\n_Generated {time.strftime('%Y-%m-%d')} by `python benchmarks/zoo_table.py --write` "
                 f"({len(rows)} zoo entries; {os.cpu_count()} vCPU CPU; "
                 f"{versions})._\n\n{md}\n{END}")
        text = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: block, text, flags=re.S)
        page.write_text(text)
    return 1 if any(r["problem"] for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
