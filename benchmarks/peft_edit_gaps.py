"""What a random LoRA does on the Linears under edits the adapter bases do not model (round 56).

For each gap of round 55 (a bias-less value projection whose β share moved through attention, the centered
reader of an approximate norm, the Linears a mean carry widened, a Post-LN β folded through the residual, a
stream rotated by ``rotate("hadamard")``, with and without online ops) one tiny float64 replica from a config
(LayerNorm γ/β randomised, tests/zoo.py), the same random LoRA (r=4, seed 1, non-zero B) attached to the original
and to the converted model, and one of three outcomes: ``refused`` (the line PEFT's attach raised),
``exact`` (the adapter's delta on the output, converted+LoRA − converted, within 1e-9 of original+LoRA −
original, relative to the latter's max) or ``silently wrong`` (that relative error). The reference for a
Post-LN residual fold is the same conversion with β kept in the norm (both approximate, one calibration).
Tests never time or load checkpoints; this runs in seconds on tiny models and is here to record before/after.

    PYTHONPATH=$PWD python benchmarks/peft_edit_gaps.py --out docs/results/peft_edit_gaps56_after.json
"""

from __future__ import annotations

import argparse
import copy
import json
import warnings

import peft
import torch

import normswap
from normswap.inputs import hf_example_inputs
from normswap.rotation.rotate import rotate
from tests.custom_models import ProjLM
from tests.custom_models import randomise as custom_randomise
from tests.integrations.test_peft_adapter_refusals import dinov3_no_value_bias
from tests.integrations.test_peft_online_ops import _out, _relative
from tests.zoo import APPROXIMATE, EXACT, build


def _lora(model, targets, **kw):
    torch.manual_seed(1)
    return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=targets, init_lora_weights=False, **kw))


def _ids_call(model, probe):
    with torch.no_grad():
        return model(probe[0])


def case(name, converted, reference, probe, targets, call=_out, **kw) -> dict:
    base = call(reference, probe)
    ref = call(_lora(copy.deepcopy(reference), targets, **kw), probe)
    conv0 = call(converted, probe)
    row = {"case": name, "targets": targets, "adapter_effect": _relative(ref, base),
           "conversion_error": _relative(conv0, base)}
    try:
        out = call(_lora(copy.deepcopy(converted), targets, **kw), probe)
    except Exception as e:  # noqa: BLE001 - recorded: a refusal (NormswapError) or PEFT's own failure
        return {**row, "outcome": "refused" if type(e).__name__ == "NormswapError" else type(e).__name__,
                "line": str(e)}
    err = _relative(out - conv0, ref - base)
    return {**row, "adapter_delta_error": err, "outcome": "exact" if err <= 1e-9 else "silently wrong"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    rows = []
    o, c, p = dinov3_no_value_bias()
    rows.append(case("β moved through attention: DINOv3 ViT without value bias, v_proj", c, o, p, ["v_proj"]))
    torch.manual_seed(0)
    o = custom_randomise(ProjLM(v_bias=False))
    ids = (torch.randint(0, 40, (2, 9), generator=torch.Generator().manual_seed(0)),)
    c = copy.deepcopy(o)
    normswap.patch(c, example_inputs=ids, mode="exact", beta_placement="fold")
    rows.append(case("β moved through attention: custom decoder, attn.v", c, o, ids, ["attn.v"], call=_ids_call))
    o = build(APPROXIMATE, "bert")
    p = hf_example_inputs(o, seed=5)
    c = copy.deepcopy(o)
    normswap.patch(c, mode="exact")
    rows.append(case("mean carry (BERT, mode exact): intermediate.dense (up)", c, o, p, ["intermediate.dense"]))
    rows.append(case("mean carry (BERT, mode exact): output.dense (down)", c, o, p,
                     r".*layer\.\d+\.output\.dense"))
    c = copy.deepcopy(o)
    normswap.patch(c)
    rows.append(case("centered reader of an approximate norm (BERT default): intermediate.dense", c, o, p,
                     ["intermediate.dense"]))
    c, k = copy.deepcopy(o), copy.deepcopy(o)
    normswap.patch(c, beta_placement="fold", mean_carry=False)
    normswap.patch(k, beta_placement="keep", mean_carry=False)
    folds = normswap.plan_of(c).residual_folds
    rows.append(case("Post-LN β folded through the residual (BERT): a reader, vs β kept", c, k, p,
                     [folds[0].readers[0]]))
    rows.append(case("Post-LN β folded through the residual (BERT): the residual writers, vs β kept", c, k, p,
                     sorted({w for rf in folds for w in rf.writers})))
    for name, targets, kw in [("gpt2", ["c_attn"], {"fan_in_fan_out": True}),
                              ("gpt2", ["c_proj"], {"fan_in_fan_out": True}),
                              ("opt", ["q_proj"], {}), ("opt", ["fc1"], {}), ("opt", ["fc2"], {})]:
        o = build(EXACT, name)
        p = hf_example_inputs(o, seed=5)
        for online in (False, True):
            c = copy.deepcopy(o)
            normswap.patch(c, fold_gamma=True)
            rotate(c, "hadamard", seed=2, online=online)
            rows.append(case(f"rotate hadamard{' + online ops' if online else ''}: {name} {targets[0]}", c, o, p,
                             targets, **kw))
    for r in rows:
        print(json.dumps({k: v for k, v in r.items() if k != "line"}))
    with open(args.out, "w") as fh:
        json.dump({"torch": torch.__version__, "peft": peft.__version__, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
