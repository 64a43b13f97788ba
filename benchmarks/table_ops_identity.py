"""Is a Post-LN encoder converted with ``--quantizer openvino-int8`` (per-norm ops, no carry, β kept) the original's
ONNX graph, tensor for tensor? (round 62)

Since round 62 the embeddings' norm centers its own input under ``per_norm_centering`` and the embedding tables keep
their rows. On a BERT-family encoder every weight of that conversion is then the original's: each norm is an
RMSNorm that centers its input (``centers_input``: torch's ``layer_norm``), no writer is centered (each is behind a
norm's op), no MLP is widened and every β stays in its norm. A quantizer that reads the exported graph (NNCF's
``compress_weights``, ONNX Runtime's ``quantize_dynamic``) then rounds the original's very tensors, and its error
is the original's to the last digit. This script checks that without running a quantizer (an MPNet NNCF run
takes an hour of one core on the shared machine): the converted model's parameters against the original's
(``torch.equal``), and the two ONNX exports (``bench_quant_encoders.export``: legacy exporter, opset 17, the
graph ``bench_openvino.py quant`` hands to OpenVINO) compared by their op types and every initializer's bytes.

    python benchmarks/table_ops_identity.py --model DIR [DIR ...] --json out.json

``--quantizer`` names the engine (default ``openvino-int8``; ``onnxruntime-dynamic`` and ``openvino-int4`` set
the same options on a Post-LN encoder; ``openvino-static`` keeps the defaults since round 63).
"""

from __future__ import annotations

import argparse
import collections
import copy
import hashlib
import json
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_quant_encoders as encoders  # noqa: E402 (the benchmarks folder is on the path only now)


def graph_facts(path: Path) -> tuple[collections.Counter, collections.Counter]:
    """The exported graph's op types, and its initializers as a multiset of (shape, sha256 of the bytes): names
    differ between two exports (the converted model's modules are other classes), values must not."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path))
    ops = collections.Counter(n.op_type for n in model.graph.node)
    inits = collections.Counter()
    for t in model.graph.initializer:
        a = numpy_helper.to_array(t)
        inits[(tuple(a.shape), hashlib.sha256(a.tobytes()).hexdigest()[:16])] += 1
    return ops, inits


def check(model_dir: Path, quantizer: str) -> dict[str, Any]:
    from transformers import AutoModel, AutoTokenizer

    import normswap

    tok = AutoTokenizer.from_pretrained(model_dir)
    original = AutoModel.from_pretrained(model_dir).float().eval()
    converted = copy.deepcopy(original)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = normswap.patch(converted, quantizer=quantizer, tokenizer=str(model_dir))
    params = dict(original.named_parameters())
    conv = dict(converted.named_parameters())
    differ = sorted(n for n in params if n not in conv or not torch.equal(params[n], conv[n]))
    extra = sorted(n for n in conv if n not in params)
    norms = [m for m in converted.modules() if isinstance(m, normswap.RMSNorm)]
    names = [n for n in ("input_ids", "attention_mask", "token_type_ids") if n in tok.model_input_names]
    example = encoders.batches(tok, encoders.english(4), 32, names)[0]
    with tempfile.TemporaryDirectory() as tmp:
        facts = {}
        for label, model in (("original", original), ("converted", converted)):
            path = Path(tmp) / f"{label}.onnx"
            encoders.export(model, example, path)
            facts[label] = graph_facts(path)
    (ops_o, init_o), (ops_c, init_c) = facts["original"], facts["converted"]
    with torch.no_grad():
        a = original(**example).last_hidden_state
        b = converted(**example).last_hidden_state
    return {"model": str(model_dir), "quantizer": quantizer, "plan": report.plan.summary(),
            "parameters": len(params), "parameters_differing": differ, "parameters_added": extra,
            "rmsnorms": len(norms), "rmsnorms_centering_input": sum(bool(m.centers_input) for m in norms),
            "onnx_ops_equal": ops_o == ops_c, "onnx_ops": dict(ops_c), "onnx_ops_original": dict(ops_o),
            "onnx_initializers": sum(init_c.values()), "onnx_initializers_equal": init_o == init_c,
            "float32_max_abs_diff": float((a - b).abs().max())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, nargs="+", required=True, help="transformers directories")
    ap.add_argument("--quantizer", default="openvino-int8")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    print("| model | plan | parameters differing | RMSNorms centering their input | ONNX ops equal | "
          "ONNX initializers equal | float32 max abs diff |\n|---|---|---|---|---|---|---|")
    for d in args.model:
        r = check(d, args.quantizer)
        rows.append(r)
        print(f"| {d.name} | {r['plan']} | {len(r['parameters_differing'])} of {r['parameters']} | "
              f"{r['rmsnorms_centering_input']} of {r['rmsnorms']} | {r['onnx_ops_equal']} | "
              f"{r['onnx_initializers_equal']} ({r['onnx_initializers']}) | {r['float32_max_abs_diff']:.1e} |",
              flush=True)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
