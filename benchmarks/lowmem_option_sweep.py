"""``normswap convert --low-memory`` against ``--in-memory`` over the option space (round 57).

Round 58 adds ``--max-shard-size``, ``--task`` (per model: its own head, the bare model, a head it lacks) and the
rotation's own options (each refused by ``--low-memory`` up front) to the factors. Round 59: ``--new-head`` streams
(no longer a documented refusal); a refusal an option fixes is exit 2 on both paths (docs/cli.md), so both paths
must refuse an input with the same code; the shard layouts must be the same (``same_shard_layout``, now a problem
where they differ); and a model with custom modeling code (``tinyln``, ``--trust-remote-code`` on every row).

For tiny random checkpoints saved to local directories (LayerNorm γ/β, biases and LayerScale λ randomised; deeper
than the 3/4-layer proxies, so the streamed plan is extrapolated), runs ``normswap convert`` (the click command,
in this process) in memory and with ``--low-memory`` for each option combination of a pairwise covering array
(every value of every option with every value of every other option, among the combinations the CLI accepts in
memory), and compares:

- both exit codes; a streamed refusal must be one ``error:`` line and leave nothing behind (exit 2 when it is a
  usage error answered before anything is read);
- every written checkpoint's shards against its index (round 58: ``--max-shard-size`` small enough to split the
  tiny models): each tensor in the file the index names, no shard over the size unless it is one tensor, the
  index's ``total_size`` the tensors' bytes;
- where both succeed: the written tensors (bitwise, dtype included), the manifests (``config.json``'s
  ``normswap`` entry, less the fields that must differ: the verification figures, which the streamed path takes
  on layers 0, 1 and L-1, and the analysis line), the other written files (bitwise, README.md less its
  verification line);
- the loaded converted model against the original in float64 (largest output difference over the largest
  output), where the conversion is exact and kept float32 weights.

Not a test: it runs a few hundred conversions (about 10-20 minutes on 2 cores). Results go to a JSON file, saved
after every combination (``--resume`` skips the combinations already in it).

    OMP_NUM_THREADS=1 python benchmarks/lowmem_option_sweep.py --json docs/results/lowmem_option_sweep.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
from click.testing import CliRunner
from safetensors import safe_open

from normswap import presets
from normswap.cli import main
from normswap.cli.plan_opts import check_combination
from normswap.errors import UsageError
from normswap.options import TASKS, parse_size

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's tests/ (run as a script)
from tests.remote_code_model import save_remote_code_model  # noqa: E402
from tests.streaming_models import MODELS, written_tensors  # noqa: E402

# round 59: custom modeling code (auto_map), converted with --trust-remote-code on every row; compat only in memory
REMOTE = {"tinyln"}
SWEPT = [*MODELS, *sorted(REMOTE)]

# every plan option of normswap/cli/plan_opts.py, --rotate and its options, --dtype: (name, values); the first
# value is the default (no argument)
FACTORS: list[tuple[str, list[tuple[str, ...]]]] = [
    ("format", [(), ("--format", "compat")]),
    ("fold_gamma", [(), ("--fold-gamma",)]),
    ("mode", [(), ("--mode", "exact"), ("--mode", "all")]),
    ("beta_placement", [(), ("--beta-placement", "keep"), ("--beta-placement", "rounding"),
                        ("--beta-placement", "fold")]),
    ("layer_scale", [(), ("--layer-scale", "fold")]),
    ("stem_centering", [(), ("--stem-centering", "op"), ("--stem-centering", "weights")]),
    ("writer_centering", [(), ("--writer-centering", "op"), ("--writer-centering", "auto")]),
    ("untie", [(), ("--untie",), ("--keep-tied",)]),
    ("no_bias_slots", [(), ("--no-bias-slots",)]),
    ("per_norm_centering", [(), ("--per-norm-centering",)]),
    ("no_mean_carry", [(), ("--no-mean-carry",)]),
    ("no_constant_trades", [(), ("--no-constant-trades",)]),
    ("carry_multiple", [(), ("--carry-multiple", "1"), ("--carry-multiple", "16")]),
    ("rotate", [(), ("--rotate", "hadamard"), ("--rotate", "random"), ("--rotate", "none", "--online-hadamard"),
                # round 58: the rotation's own options, each with a rotation (all refused by --low-memory up front)
                ("--rotate", "learned", "--learn-steps", "2"), ("--rotate", "hadamard", "--rotate-output", "restore"),
                ("--rotate", "random", "--seed", "3"), ("--rotate", "hadamard", "--smooth", "0.5"),
                ("--rotate", "none", "--online-hadamard", "--online-block", "8")]),
    ("dtype", [(), ("--dtype", "float32"), ("--dtype", "bfloat16"), ("--dtype", "float16")]),
    # round 58: shards small enough to split the tiny checkpoints (about 150-400 KB) into several files
    ("max_shard_size", [(), ("--max-shard-size", "100KB"), ("--max-shard-size", "16KB")]),
]
# round 58: --task, per model (the heads each tiny checkpoint can be loaded with): its own class's task, the bare
# model (the head's tensors left out; BERT's pooler is new), and a task head the checkpoint lacks (--new-head)
TASK_VALUES: dict[str, list[tuple[str, ...]]] = {
    "gpt2": [(), ("--task", "causal-lm"), ("--task", "base"), ("--task", "sequence-classification", "--new-head")],
    "opt": [(), ("--task", "causal-lm"), ("--task", "base"), ("--task", "sequence-classification", "--new-head")],
    "bert": [(), ("--task", "masked-lm"), ("--task", "base", "--new-head"),
             ("--task", "token-classification", "--new-head")],
    "dinov2": [(), ("--task", "base"), ("--task", "image-classification", "--new-head")],
    "whisper": [(), ("--task", "speech-seq2seq"), ("--task", "base"),
                ("--task", "audio-classification", "--new-head")],
    "gptj": [(), ("--task", "causal-lm"), ("--task", "base"), ("--task", "sequence-classification", "--new-head")],
    "bert_cls": [(), ("--task", "sequence-classification"), ("--task", "base"),
                 ("--task", "masked-lm", "--new-head")],
    "tinyln": [(), ("--task", "base")],
}
INSPECT_SKIP = {"dtype", "max_shard_size"}  # convert's options only: inspect plans without writing


def factors_for(name: str) -> list[tuple[str, list[tuple[str, ...]]]]:
    """FACTORS and the model's --task values (custom code: --trust-remote-code on every row)."""
    out = [*FACTORS, ("task", TASK_VALUES.get(name, [()]))]
    if name in REMOTE:
        out.append(("trust_remote_code", [("--trust-remote-code",)]))
    return out

# manifest fields that must differ between the paths: the verification (streamed: layers 0, 1 and L-1, other
# figures) and the analysis line (streamed: "low-memory: 3-layer proxy extrapolated ...")
MANIFEST_SKIP = {"verification", "streamed"}
PLAN_OPTION_SKIP = {"analysis", "analysis_inputs"}
SITE_SKIP = {"error"}  # the streamed plan's per-norm error is the proxy's (random weights)


def save_source(name: str, root: Path) -> Path:
    """The tiny checkpoint, sharded, with γ/β, biases and LayerScale λ randomised."""
    if name in REMOTE:
        return save_remote_code_model(root / name)
    cls, config = MODELS[name]()
    torch.manual_seed(0)
    model = presets.randomise_norms(cls(config)).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "lambda" in pname:  # LayerScale: factors from 0.05 to 5, as real DINOv2 spreads them
                p.copy_(torch.exp(1.2 * torch.randn(p.shape, generator=gen)))
    out = root / name
    model.save_pretrained(out, max_shard_size="40KB")
    return out


def combination_args(combo: dict[str, tuple[str, ...]]) -> list[str]:
    return [a for values in combo.values() for a in values]


def accepted_in_memory(args: list[str], src: Path) -> bool:
    """Whether the CLI accepts the options in memory (check_combination, torch-free)."""
    cmd = main.get_command(None, "convert")  # type: ignore[arg-type]
    try:
        ctx = cmd.make_context("convert", [str(src), "--out", "/nonexistent/x", *args], resilient_parsing=False)
        check_combination(ctx.params, low_memory=False, model=str(src))
    except (UsageError, Exception):  # noqa: BLE001 - click's own usage errors too
        return False
    return True


# the values --low-memory refuses before reading anything (check_combination, exit 2): left out of the covering
# array, each tried in REFUSED_ROWS combinations of its own
STREAM_REFUSED = {("per_norm_centering", ("--per-norm-centering",)),
                  ("writer_centering", ("--writer-centering", "auto")),
                  *(("rotate", v) for v in dict(FACTORS)["rotate"] if v)}
REFUSED_ROWS = 2
# what --low-memory refuses once it has planned (exit 2 since round 59, an option fixes it; nothing written;
# docs/checkpoints.md): it depends on the model's plan, which the analysis of the proxies makes, not on the command
# line alone. Round 59: --new-head streams (its refusal is gone)
DOCUMENTED_REFUSALS = ("approximate norm(s) need calibration on the whole model",
                       "through their residual writers, which the low-memory path cannot do")


def covering_array(src: Path, seed: int = 0, candidates: int = 60,
                   factors: list[tuple[str, list[tuple[str, ...]]]] | None = None) -> list[dict[str, tuple[str, ...]]]:
    """A pairwise covering array (greedy, AETG-like) over ``factors`` (default FACTORS) less STREAM_REFUSED, among
    the combinations accepted in memory: every pair of values of two options that some accepted combination holds
    is in at least one row. Then REFUSED_ROWS random accepted rows for each value in STREAM_REFUSED."""
    rng = random.Random(seed)
    factors = FACTORS if factors is None else factors
    names = [n for n, _ in factors]
    values = {n: [v for v in vs if (n, v) not in STREAM_REFUSED] for n, vs in factors}
    uncovered = {((a, i), (b, j)) for a, b in itertools.combinations(names, 2)
                 for i in range(len(values[a])) for j in range(len(values[b]))}
    rows: list[dict[str, tuple[str, ...]]] = []
    while uncovered:
        best, best_new = None, set()
        target = rng.choice(sorted(uncovered))
        for _ in range(candidates):
            pick = {n: rng.randrange(len(values[n])) for n in names}
            (a, i), (b, j) = target
            pick[a], pick[b] = i, j
            combo = {n: values[n][k] for n, k in pick.items()}
            covered = {((x, pick[x]), (y, pick[y])) for x, y in itertools.combinations(names, 2)} & uncovered
            if len(covered) > len(best_new) and accepted_in_memory(combination_args(combo), src):
                best, best_new = combo, covered
        if best is None:
            uncovered.discard(target)  # no accepted combination holds this pair (e.g. --fold-gamma + keep)
            continue
        rows.append(best)
        uncovered -= best_new
    for name, value in sorted(STREAM_REFUSED):
        found = 0
        for _ in range(500):
            combo = {n: (rng.choice(values[n]) if n != "rotate" else ()) for n in names}
            combo[name] = value
            if accepted_in_memory(combination_args(combo), src):
                rows.append(combo)
                found += 1
                if found == REFUSED_ROWS:
                    break
    return rows


def run_cli(args: list[str]) -> tuple[int, list[str], str]:
    res = CliRunner().invoke(main, args)
    err = [ln for ln in res.stderr.splitlines() if ln.strip()]
    exc = res.exception if res.exception is not None and not isinstance(res.exception, SystemExit) else None
    return res.exit_code, err, repr(exc) if exc is not None else ""


def _strip_manifest(m: dict[str, Any]) -> dict[str, Any]:
    m = {k: v for k, v in m.items() if k not in MANIFEST_SKIP}
    plan = m.get("plan")
    if isinstance(plan, dict):
        plan = dict(plan)
        plan["options"] = {k: v for k, v in plan.get("options", {}).items() if k not in PLAN_OPTION_SKIP}
        plan["sites"] = [{k: v for k, v in s.items() if k not in SITE_SKIP} for s in plan.get("sites", [])]
        m["plan"] = plan
    return m


def manifest_of(d: Path) -> dict[str, Any]:
    cfg = json.loads((d / "config.json").read_text())
    return cfg.get("normswap", {})


def config_without_manifest(d: Path) -> dict[str, Any]:
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("normswap", None)
    return cfg


def diff_dicts(a: Any, b: Any, path: str = "") -> list[str]:
    """Where two JSON values differ (paths, at most a few)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b), key=str):
            if k not in a or k not in b:
                out.append(f"{path}.{k} only in {'streamed' if k in b else 'in-memory'}")
            else:
                out += diff_dicts(a[k], b[k], f"{path}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in diff_dicts(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {json.dumps(a)[:120]} != {json.dumps(b)[:120]}"]


def compare_outputs(mem: Path, stream: Path) -> dict[str, Any]:
    """Tensors, manifests and side files of two output directories."""
    ta, tb = written_tensors(mem), written_tensors(stream)
    only = sorted(set(ta) ^ set(tb))
    differ = sorted(k for k in set(ta) & set(tb) if ta[k].dtype != tb[k].dtype or ta[k].shape != tb[k].shape
                    or not torch.equal(ta[k], tb[k]))
    worst = 0.0
    for k in differ:
        if ta[k].shape == tb[k].shape and ta[k].is_floating_point():
            d = (ta[k].double() - tb[k].double()).abs().max() / ta[k].double().abs().max().clamp_min(1e-30)
            worst = max(worst, float(d))
    manifest = diff_dicts(_strip_manifest(manifest_of(mem)), _strip_manifest(manifest_of(stream)))
    config = diff_dicts(config_without_manifest(mem), config_without_manifest(stream))
    files_a = {p.name for p in mem.iterdir() if p.suffix != ".safetensors" and p.name != "model.safetensors.index.json"}
    files_b = {p.name for p in stream.iterdir() if p.suffix != ".safetensors"
               and p.name != "model.safetensors.index.json"}
    side = sorted(f"{n} only in {'in-memory' if n in files_a else 'streamed'}" for n in files_a ^ files_b)
    for n in sorted(files_a & files_b - {"config.json", "README.md"}):
        if (mem / n).read_bytes() != (stream / n).read_bytes():
            side.append(f"{n} differs")
    if "README.md" in files_a & files_b:
        def card(p: Path) -> str:  # less its verification section (other figures streamed) and its own name
            name = p.parent.name
            text = p.read_text().replace(f"# {name}\n", "# OUT\n").replace(f'("{name}")', '("OUT")')
            head, _, rest = text.partition("## Verification")
            return head + rest[rest.find("## How to load"):]
        if card(mem / "README.md") != card(stream / "README.md"):
            side.append("README.md differs")
    return {"tensors_only_in_one": only[:8], "tensors_differ": differ[:8], "n_tensors_differ": len(differ),
            "worst_rel_diff": worst, "manifest_diff": manifest[:8], "config_diff": config[:8], "side_files": side}


def outputs_vs_original(name: str, src: Path, out: Path, task: str | None = None) -> float:
    """Largest output difference over the largest output, the converted model loaded in float64 against the
    original in float64 (loaded with ``--task``'s class; not for a new head, which the original lacks)."""
    import transformers

    import normswap
    from normswap.inputs import hf_example_inputs

    remote = {"trust_remote_code": True} if name in REMOTE else {}
    if name in REMOTE:
        cls = transformers.AutoModelForCausalLM if task is None else transformers.AutoModel
    else:
        cls, _ = MODELS[name]()
    if task not in (None, "causal-lm", "masked-lm", "speech-seq2seq") and name not in REMOTE:  # --task base
        cls = getattr(transformers, TASKS[task])
    original = cls.from_pretrained(src, **remote).double().eval()
    converted = normswap.load(out, **remote).double().eval()
    probe = hf_example_inputs(original, seed=3)
    probe = {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in probe.items()}
    with torch.no_grad():
        a, b = original(**probe), converted(**probe)
    if torch.is_tensor(a):  # custom code (tinyln's bare model) returns a plain tensor
        ra, rb = a, b
    else:
        key = "logits" if "logits" in a else "last_hidden_state"
        ra, rb = a[key], b[key]
    if isinstance(rb, torch.Tensor) and ra.shape == rb.shape:
        return float((rb - ra).abs().max() / ra.abs().max())
    return float("nan")


def shard_problems(d: Path, max_shard_size: str | None) -> tuple[list[str], dict[str, Any]]:
    """Whether a written checkpoint's shards and index agree: with several weight files, the index lists every
    tensor in the file that holds it and no other, names only files that exist, and its ``total_size`` is the
    tensors' bytes; no file holds more than ``max_shard_size`` unless it is one tensor. Returns the problems and
    the layout (file -> tensor count)."""
    files = sorted(f for f in d.glob("*.safetensors") if not f.name.startswith("normswap"))
    held: dict[str, str] = {}
    sizes: dict[str, int] = {}
    counts: dict[str, int] = {}
    problems = []
    for f in files:
        with safe_open(str(f), "pt") as h:
            keys = list(h.keys())
            tensors = [h.get_slice(k) for k in keys]
            nbytes = sum(math.prod(t.get_shape()) * _ITEMSIZE[t.get_dtype()] for t in tensors)
        counts[f.name], sizes[f.name] = len(keys), nbytes
        for k in keys:
            if k in held:
                problems.append(f"{k} in {held[k]} and {f.name}")
            held[k] = f.name
        if max_shard_size and nbytes > parse_size(max_shard_size) and len(keys) > 1:
            problems.append(f"{f.name} holds {nbytes} B > {max_shard_size}")
    index_path = d / "model.safetensors.index.json"
    if len(files) > 1 or index_path.exists():
        if not index_path.exists():
            problems.append(f"{len(files)} weight files and no index")
        else:
            index = json.loads(index_path.read_text())
            wmap = index.get("weight_map", {})
            if wmap != held:
                wrong = sorted(k for k in set(wmap) | set(held) if wmap.get(k) != held.get(k))
                problems.append(f"index and files disagree on {len(wrong)} tensor(s), e.g. {wrong[:3]}")
            missing = sorted(set(wmap.values()) - {f.name for f in files})
            if missing:
                problems.append(f"index names missing files {missing[:3]}")
            total = index.get("metadata", {}).get("total_size")
            if total is not None and int(total) != sum(sizes.values()):
                problems.append(f"index total_size {total} != {sum(sizes.values())} B of tensors")
    return problems, counts


_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def run_one(name: str, src: Path, combo: dict[str, tuple[str, ...]], work: Path) -> dict[str, Any]:
    args = combination_args(combo)
    row: dict[str, Any] = {"model": name, "args": " ".join(args)}
    outs = {}
    work.mkdir(parents=True, exist_ok=True)
    for kind, flag in (("mem", "--in-memory"), ("stream", "--low-memory")):
        out = work / kind
        shutil.rmtree(out, ignore_errors=True)
        t0 = time.perf_counter()
        code, err, exc = run_cli(["convert", str(src), "--out", str(out), "-q", flag, *args])
        row[kind] = {"exit": code, "stderr": err[-3:], "exception": exc, "seconds": round(time.perf_counter() - t0, 2),
                     "wrote": out.exists()}
        outs[kind] = out
        leftovers = [p.name for p in work.iterdir() if p.name not in ("mem", "stream")]
        if leftovers:
            row[kind]["leftovers"] = leftovers
            for p in leftovers:
                shutil.rmtree(work / p, ignore_errors=True)
    problems = []
    m, s = row["mem"], row["stream"]
    if s["exit"] != 0:
        if len(s["stderr"]) != 1 or not s["stderr"][0].startswith("error: "):
            problems.append("streamed refusal is not one error line")
        if s["wrote"] or s.get("leftovers"):
            problems.append("streamed refusal left files")
        if s["exception"]:
            problems.append(f"streamed traceback {s['exception'][:160]}")
    if m["exit"] != 0 and (m["wrote"] or m.get("leftovers")):
        problems.append("in-memory failure left files")
    if m["exception"]:
        problems.append(f"in-memory traceback {m['exception'][:160]}")
    shard = dict(zip(combo.get("max_shard_size", ())[::2], combo.get("max_shard_size", ())[1::2], strict=True))
    for kind in ("mem", "stream"):
        if row[kind]["exit"] == 0:
            bad, layout = shard_problems(outs[kind], shard.get("--max-shard-size"))
            row[kind]["shards"] = layout
            problems += [f"{kind} shards: {b}" for b in bad]
    if m["exit"] == 0 and s["exit"] == 0:
        cmp = compare_outputs(outs["mem"], outs["stream"])
        row["compare"] = cmp
        row["same_shard_layout"] = m["shards"] == s["shards"]
        if not row["same_shard_layout"]:  # round 59: the streamed writer splits as save_pretrained does
            problems.append("shard layouts differ")
        if cmp["tensors_only_in_one"] or cmp["n_tensors_differ"]:
            problems.append("tensors differ")
        if cmp["manifest_diff"] or cmp["config_diff"]:
            problems.append("manifest differs")
        if cmp["side_files"]:
            problems.append("side files differ")
        exact = not any(s.get("verdict") == "approximate" and s.get("convert")
                        for s in manifest_of(outs["mem"]).get("plan", {}).get("sites", []))
        task = combo.get("task", ())
        if exact and combo["dtype"] in ((), ("--dtype", "float32")) and "--new-head" not in task:
            try:
                row["mem_vs_original"] = outputs_vs_original(name, src, outs["mem"], task[1] if task else None)
                row["stream_vs_original"] = outputs_vs_original(name, src, outs["stream"], task[1] if task else None)
            except Exception as exc:  # noqa: BLE001 - recorded, not fatal
                row["vs_original_error"] = repr(exc)[:200]
                problems.append("loading/running failed")
            else:
                if max(row["mem_vs_original"], row["stream_vs_original"]) > 1e-5:
                    problems.append("output differs from the original")
    elif m["exit"] == 0 and s["exit"] != 0:
        row["streamed_refusal"] = s["stderr"][-1] if s["stderr"] else ""
        if s["exit"] != 2:  # round 59: every refusal the streamed path makes is one an option fixes
            problems.append(f"streamed refusal exit {s['exit']} (not a usage error)")
    elif m["exit"] != s["exit"]:
        problems.append(f"exit codes {m['exit']} vs {s['exit']}")
    # normswap inspect --low-memory with the same plan options: the plan convert --low-memory writes, or its refusal
    plan_args = [a for n, values in combo.items() if n not in INSPECT_SKIP for a in values]
    code, err, exc = run_cli(["inspect", str(src), "--json", "--low-memory", *plan_args])
    row["inspect"] = {"exit": code, "stderr": err[-1:], "exception": exc}
    if s["exit"] == 0:
        if code != 0:
            problems.append(f"inspect --low-memory exit {code}")
        else:
            res = CliRunner().invoke(main, ["inspect", str(src), "--json", "--low-memory", *plan_args])
            shown = json.loads(res.stdout)
            written = {k: v for k, v in manifest_of(outs["stream"])["plan"].items() if k != "adapter_bases"}
            row["inspect"]["plan_diff"] = diff_dicts(shown, written)[:8]
            if row["inspect"]["plan_diff"]:
                problems.append("inspect plan differs from the manifest")
    elif code != s["exit"] or (err[-1:] != s["stderr"][-1:]):
        problems.append(f"inspect --low-memory answers {code} {err[-1:]} where convert answers {s['exit']}")
    row["problems"] = problems
    for kind in ("mem", "stream"):
        shutil.rmtree(outs[kind], ignore_errors=True)
    return row


def summarize(paths: list[Path]) -> dict[str, Any]:
    """Per model: combinations run, both converted, streamed refused (exit 2 / documented exit 1), with problems
    (by kind); the rows compacted (arguments, exit codes, problems, outputs against the original)."""
    rows = [r for p in paths for r in json.loads(p.read_text())["rows"]]
    table: dict[str, dict[str, Any]] = {}
    for r in rows:
        t = table.setdefault(r["model"], {"combinations": 0, "both_converted": 0, "streamed_refused_exit2": 0,
                                          "streamed_refused_documented": 0, "with_problems": 0, "problems": {},
                                          "worst_vs_original": 0.0, "both_converted_with_task": 0,
                                          "both_converted_sharded": 0, "same_shard_layout": 0})
        t["combinations"] += 1
        m, s = r["mem"]["exit"], r["stream"]["exit"]
        t["both_converted"] += m == 0 and s == 0
        if m == 0 and s == 0:  # round 58's factors, among the rows both paths wrote
            t["both_converted_with_task"] += "--task" in r["args"]
            sharded = len(r["stream"].get("shards", {})) > 1
            t["both_converted_sharded"] += sharded
            t["same_shard_layout"] += sharded and bool(r.get("same_shard_layout"))
        t["streamed_refused_exit2"] += m == 0 and s == 2
        t["streamed_refused_documented"] += m == 0 and s != 0 and any(
            d in (r["stream"]["stderr"] or [""])[-1] for d in DOCUMENTED_REFUSALS)
        t["with_problems"] += bool(r["problems"])
        for p in r["problems"]:
            kind = p.split(" (")[0][:60]
            t["problems"][kind] = t["problems"].get(kind, 0) + 1
        for k in ("mem_vs_original", "stream_vs_original"):
            if isinstance(r.get(k), float):
                t["worst_vs_original"] = max(t["worst_vs_original"], r[k])
    compact = [{"model": r["model"], "args": r["args"], "exit_in_memory": r["mem"]["exit"],
                "exit_low_memory": r["stream"]["exit"], "problems": r["problems"],
                "shards": [len(r[k].get("shards", {})) for k in ("mem", "stream")],
                **({"refusal": r["streamed_refusal"]} if "streamed_refusal" in r else {}),
                **{k: r[k] for k in ("mem_vs_original", "stream_vs_original") if k in r}} for r in rows]
    return {"by_model": table, "rows": compact}


def main_(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--summarize", type=Path, nargs="+", default=None, metavar="RUN_JSON",
                    help="write the summary of these runs' JSON files to --json instead of running")
    ap.add_argument("--work", type=Path, default=Path("/tmp/lowmem57/sweep"))
    ap.add_argument("--models", default=",".join(SWEPT))
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--limit", type=int, default=0,
                    help="at most this many covering-array combinations per model (0: all), and the refused rows")
    ap.add_argument("--refused-per-value", type=int, default=REFUSED_ROWS,
                    help="with --limit: how many rows to keep for each value --low-memory refuses up front")
    args = ap.parse_args(argv)
    if args.summarize:
        summary = summarize(args.summarize)
        args.json.write_text(json.dumps(summary, indent=1))
        print(json.dumps(summary["by_model"], indent=1))
        return 0
    args.work.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"rows": []}
    if args.resume and args.json.exists():
        results = json.loads(args.json.read_text())
    done = {(r["model"], r["args"]) for r in results["rows"]}
    for name in args.models.split(","):
        src = args.work / "src" / name
        if not src.exists():
            save_source(name, args.work / "src")
        rows = covering_array(src, factors=factors_for(name))
        if args.limit:  # the first rows of the covering array, and some of the refused values' rows
            refused = [r for r in rows if any((n, v) in STREAM_REFUSED for n, v in r.items())]
            kept = [r for n, v in sorted(STREAM_REFUSED)
                    for r in [q for q in refused if q.get(n) == v][: args.refused_per_value]]
            rows = [r for r in rows if r not in refused][: args.limit] + kept
        results.setdefault("arrays", {})[name] = len(rows)
        print(f"{name}: {len(rows)} combinations", flush=True)
        for combo in rows:
            key = (name, " ".join(combination_args(combo)))
            if key in done:
                continue
            row = run_one(name, src, combo, args.work / "run")
            results["rows"].append(row)
            mark = "OK " if not row["problems"] else "BAD"
            print(f"{mark} {name} {row['args']}: mem {row['mem']['exit']} stream {row['stream']['exit']} "
                  f"{row['problems']}", flush=True)
            args.json.write_text(json.dumps(results, indent=1))
    bad = [r for r in results["rows"] if r["problems"]]
    both = sum(1 for r in results["rows"] if r["mem"]["exit"] == 0 and r["stream"]["exit"] == 0)
    refused = sum(1 for r in results["rows"] if r["mem"]["exit"] == 0 and r["stream"]["exit"] != 0)
    results["summary"] = {"combinations": len(results["rows"]), "both_converted": both,
                          "streamed_refused": refused, "with_problems": len(bad)}
    args.json.write_text(json.dumps(results, indent=1))
    print(json.dumps(results["summary"]))
    return 0


if __name__ == "__main__":
    sys.exit(main_())
