"""Measure where a converted model goes, and write the documentation's compatibility table.

Runs the same checks as ``tests/integrations/`` (through ``tests/integrations/compat.py``) on tiny
converted models built offline, records each tool's agreement with the eager converted model, prints
a markdown table, writes ``benchmarks/compat.json`` and, with ``--write``, replaces the table between
the ``compat-table`` markers in docs/compatibility.md.

    python benchmarks/compat_table.py --write       # ~5 min on 2 CPU cores
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

import normswap  # noqa: E402
from tests.integrations import compat  # noqa: E402
from tests.zoo import APPROXIMATE, EXACT, build  # noqa: E402

BEGIN, END = "<!-- compat-table:begin -->", "<!-- compat-table:end -->"


def fmt(x: float) -> str:
    return "0 (bitwise)" if x == 0 else f"{x:.1e}"


def onnx_rows(tmp: Path) -> list[dict]:
    rows = []
    for name in compat.MODELS:
        model, inputs = compat.tiny_converted(name)
        for dynamo in (False, True):
            for opset in (18, 23):
                label = f"ONNX {'dynamo' if dynamo else 'legacy (dynamo=False)'}, opset {opset}"
                try:
                    r = compat.onnx_roundtrip(model, inputs, dynamo=dynamo, opset=opset, path=tmp / "m.onnx")
                    # what each exporter writes (tests/integrations/test_onnx_fusion.py checks ORT fuses it)
                    how = ("RMSNormalization" if r["rms"]
                           else "Pow/ReduceMean/Add/Sqrt/Div/Mul, fused by ORT into SimplifiedLayerNormalization")
                    rows.append({"tool": label, "model": name, "ok": r["max_rel"] < 1e-5,
                                 "max_rel": r["max_rel"], "note": f"onnxruntime; norms as {how}"})
                except Exception as exc:  # noqa: BLE001
                    rows.append({"tool": label, "model": name, "ok": False, "max_rel": None,
                                 "note": f"{type(exc).__name__}: {str(exc)[:80]}"})
    return rows


def export_rows() -> list[dict]:
    rows = []
    for name in ("gpt2", "vit"):
        r = compat.torch_export_fresh(name)
        rows.append({"tool": "torch.export (first call in a fresh process), .pt2 loaded without normswap",
                     "model": name, "ok": r["max_rel"] < 1e-6 and not r["normswap_loaded"],
                     "max_rel": r["max_rel"], "note": "aten.rms_norm in the graph"})
    return rows


def compile_rows() -> list[dict]:
    import torch._dynamo

    model, inputs = compat.tiny_converted("gpt2")
    wrapper = compat.Positional(model, inputs)
    args = tuple(compat.tensor_inputs(inputs).values())
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(wrapper, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        ref, got = wrapper(*args), compiled(*args)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    a = compat.agreement(got, ref)
    return [{"tool": "torch.compile(fullgraph=True), aot_eager, forward", "model": "gpt2",
             "ok": a["max_rel"] < 1e-6 and graphs == 1, "max_rel": a["max_rel"], "note": f"{graphs} graph"}]


def trainer_rows(tmp: Path) -> list[dict]:
    from transformers import Trainer, TrainingArguments

    from normswap.integrations.trainer import norm_parameter_names

    rows = []
    for name, table in (("gpt2", EXACT), ("bert", APPROXIMATE)):
        model = build(table, name).float()
        normswap.patch(model, mode="all")
        decayed = set(Trainer.get_decay_parameter_names(None, model)) & norm_parameter_names(model)
        rows.append({"tool": "Trainer weight decay (get_decay_parameter_names)", "model": name,
                     "ok": not decayed, "max_rel": None,
                     "note": f"{len(norm_parameter_names(model))} RMSNorm params, {len(decayed)} decayed"})
        ids = {"input_ids": torch.tensor([[5, 6, 7, 8, 9, 10]])}
        with torch.no_grad():
            ref = model(**ids).logits
        model.save_pretrained(tmp / f"{name}-sp")
        trainer = Trainer(model=model, args=TrainingArguments(output_dir=str(tmp / "run"), report_to=[],
                                                              use_cpu=True))
        trainer.save_model(str(tmp / f"{name}-tr"))
        for label, d in (("save_pretrained on a patched model", "sp"), ("Trainer.save_model on a patched model",
                                                                        "tr")):
            with torch.no_grad():
                got = normswap.load(tmp / f"{name}-{d}")(**ids).logits
            rows.append({"tool": f"{label} → normswap.load", "model": name, "ok": torch.equal(got, ref),
                         "max_rel": compat.agreement(got, ref)["max_rel"], "note": "native checkpoint"})
    return rows


def peft_rows(tmp: Path) -> list[dict]:
    from peft import AutoPeftModelForCausalLM, LoraConfig, get_peft_model

    model = build(EXACT, "gpt2").float()
    normswap.patch(model)
    normswap.checkpoint.save(model, tmp / "base")
    rows = []
    for task_type, extra in (("CAUSAL_LM", {}), (None, {"import_allowlist": ["normswap"]})):
        pm = get_peft_model(normswap.load(tmp / "base"), LoraConfig(r=4, target_modules=["c_attn"],
                                                                    init_lora_weights=False, task_type=task_type))
        out = tmp / f"adapter-{task_type}"
        pm.eval().save_pretrained(out)
        ids = torch.tensor([[5, 6, 7, 8, 9]])
        with torch.no_grad():
            ref = pm(input_ids=ids).logits
            got = AutoPeftModelForCausalLM.from_pretrained(out, **extra).eval()(input_ids=ids).logits
        note = "task_type=CAUSAL_LM" if task_type else "no task_type: import_allowlist=['normswap']"
        rows.append({"tool": "PEFT AutoPeftModelForCausalLM", "model": "gpt2", "ok": torch.equal(got, ref),
                     "max_rel": compat.agreement(got, ref)["max_rel"], "note": note})
    return rows


def pipeline_rows(tmp: Path) -> list[dict]:
    from transformers import pipeline

    from normswap import presets

    rows = []
    for name, task in (("tiny-gpt2", "text-generation"), ("tiny-bert", "feature-extraction")):
        original, tok = presets.build(name)
        normswap.convert(name, tmp / name, mode="all")
        converted = normswap.load(tmp / name)
        text = "the quick brown fox"
        if task == "text-generation":
            a = pipeline(task, model=original, tokenizer=tok)(text, max_new_tokens=8, do_sample=False)
            b = pipeline(task, model=converted, tokenizer=tok)(text, max_new_tokens=8, do_sample=False)
            rows.append({"tool": f"pipeline('{task}') on a native checkpoint", "model": "gpt2",
                         "ok": a == b, "max_rel": None, "note": "greedy text identical to the original"})
        else:
            a = torch.tensor(pipeline(task, model=original, tokenizer=tok)(text))
            b = torch.tensor(pipeline(task, model=converted, tokenizer=tok)(text))
            ag = compat.agreement(b, a)
            rows.append({"tool": f"pipeline('{task}') on a native checkpoint", "model": "bert (Post-LN)",
                         "ok": True, "max_rel": ag["max_rel"],
                         "note": "vs the original: the approximate conversion's own error"})
    return rows


def sentence_transformers_rows(tmp: Path) -> list[dict]:
    try:
        import sentence_transformers as st
    except ImportError:
        return [{"tool": "sentence-transformers", "model": "bert (Post-LN)", "ok": False, "max_rel": None,
                 "note": "not installed (pip install sentence-transformers)"}]
    from tests.test_faults import _tiny_sentence_transformer

    src = _tiny_sentence_transformer(tmp / "st-build")
    out = tmp / "st-converted"
    normswap.convert(str(src), out, mode="all")
    a, b = st.SentenceTransformer(str(src), device="cpu"), st.SentenceTransformer(str(out), device="cpu")
    same_modules = [type(m).__name__ for m in a] == [type(m).__name__ for m in b]
    texts = ["hello world", "a b c d e f g", "the quick brown fox", "jumps over the lazy dog"]
    ea, eb = a.encode(texts, convert_to_tensor=True).double(), b.encode(texts, convert_to_tensor=True).double()
    cos = float(torch.nn.functional.cosine_similarity(ea, eb).min())
    modules = "/".join(type(m).__name__ for m in b)
    return [{"tool": "SentenceTransformer(converted_dir)", "model": "bert (Post-LN)",
             "ok": same_modules and a.max_seq_length == b.max_seq_length,
             "max_rel": float((eb - ea).norm() / ea.norm()),
             "note": f"modules {modules}, max_seq_length {b.max_seq_length}; min embedding cosine {cos:.4f} "
                     "(the approximate conversion's own error)"}]


def table(rows: list[dict]) -> str:
    lines = ["| tool | model | works | max rel. error | notes |", "|---|---|---|---|---|"]
    for r in rows:
        err = "n/a" if r["max_rel"] is None else fmt(r["max_rel"])
        lines.append(f"| {r['tool']} | {r['model']} | {'yes' if r['ok'] else '**no**'} | {err} | {r['note']} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", "--readme", dest="write", action="store_true",
                    help="rewrite the table in docs/compatibility.md")
    ap.add_argument("--only", default="", help="comma-separated groups: onnx,export,compile,trainer,peft,pipeline,"
                    "sentence-transformers (prints only; --write needs every group)")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    groups = {"onnx": onnx_rows, "export": export_rows, "compile": compile_rows, "trainer": trainer_rows,
              "peft": peft_rows, "pipeline": pipeline_rows,
              "sentence-transformers": sentence_transformers_rows}
    wanted = [g for g in (args.only.split(",") if args.only else groups)]
    rows: list[dict] = []
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for g in wanted:
            fn = groups[g]
            rows += fn(Path(tmp)) if fn.__code__.co_argcount else fn()
            print(f"[{g}] done at {time.time() - t0:.0f}s", file=sys.stderr, flush=True)
    md = table(rows)
    print(md)
    meta = {"torch": torch.__version__, "normswap": normswap.__version__}
    for mod in ("transformers", "onnxruntime", "onnx", "onnxscript", "peft"):
        try:
            meta[mod] = __import__(mod).__version__
        except ImportError:
            pass
    (REPO / "benchmarks" / "compat.json").write_text(json.dumps({"versions": meta, "rows": rows}, indent=1))
    if args.write and args.only:
        raise SystemExit("--write rewrites the whole table: run it without --only")
    if args.write:
        page = REPO / "docs" / "compatibility.md"
        text = page.read_text()
        versions = ", ".join(f"{k} {v}" for k, v in meta.items())
        block = (f"{BEGIN}\n_Measured {time.strftime('%Y-%m-%d')} by `python benchmarks/compat_table.py --write` "
                 f"({os.cpu_count()} vCPU CPU; {versions})._\n\n{md}\n{END}")
        if BEGIN in text:
            text = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: block, text, flags=re.S)
        else:
            raise SystemExit("docs/compatibility.md has no compat-table markers")
        page.write_text(text)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
