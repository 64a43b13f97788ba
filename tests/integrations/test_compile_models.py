"""``torch.compile`` of whole converted models (issue 40): the converted model compiles into one graph
(no graph break) of the original's ops, with each ``layer_norm`` replaced by one decomposable
``rms_norm`` and nothing added but the ``add`` of a kept β (and the mean subtraction of an
``exact-with-centering`` site, which its verdict announces). Inductor fuses those ops with their
neighbours as it fuses the original's LayerNorm (an opaque custom op here would cost a memory round trip
per norm, docs/results/deploy-speed.md, second round), so the op count is what keeps the compiled
converted model from doing more work than the original. Dynamo's graph only (a recording backend): no
inductor compile, a few seconds per model.
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch

import normswap
from normswap.analysis.plan import CENTERED_VERDICTS
from tests.integrations.compat import Positional, example_inputs, tensor_inputs
from tests.zoo import APPROXIMATE, EXACT, build


def _graph_ops(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> Counter:
    """Dynamo's ops for one forward, compiled with ``fullgraph=True`` (a graph break raises)."""
    torch._dynamo.reset()
    seen: Counter = Counter()

    def record(gm, example_inputs):
        seen.update(getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes
                    if n.op in ("call_function", "call_method"))
        return gm.forward

    with torch.inference_mode():
        torch.compile(Positional(model, inputs), fullgraph=True, backend=record)(*tensor_inputs(inputs).values())
    torch._dynamo.reset()
    return seen


@pytest.mark.parametrize("name", ["gpt2", "bert", "vit"])
def test_converted_model_compiles_to_the_originals_graph_with_rms_norm_for_layer_norm(name):
    original = build(APPROXIMATE if name == "bert" else EXACT, name).float().eval()
    converted = copy.deepcopy(original)
    report = normswap.patch(converted, mode="all", calibration=False)
    converted = converted.float().eval()
    # an exact-with-centering site runs one mean subtraction where its stream begins, by design (the
    # verdict says so): the only extra arithmetic allowed besides a kept β
    centred = sum(site.verdict in CENTERED_VERDICTS for site in report.sites)
    norms = [m for m in converted.modules() if isinstance(m, normswap.RMSNorm)]
    kept_beta = sum(m.bias is not None for m in norms)
    inputs = example_inputs(name, original)

    before, after = _graph_ops(original, inputs), _graph_ops(converted, inputs)

    # a norm that centers its own input runs LayerNorm's one kernel (since round 63 a Post-LN encoder's embeddings'
    # norm by default: its tables keep their rows)
    centering = sum(m.centers_input for m in norms)
    assert before["layer_norm"] == len(norms) > 0 and after["layer_norm"] == centering, (before, after)
    assert centering == (name == "bert"), centering
    assert after["rms_norm"] == len(norms) - centering, after  # torch's decomposable op: no opaque normswap op
    assert not any("normswap" in op for op in after), after
    added = {op: n - before[op] for op, n in after.items() if n > before[op]}
    # besides rms_norm: a kept β's add, a centring site's mean and sub, shape/dtype reads (getattr, size)
    # and each parameter's .to(x.dtype), which is the parameter itself here (float32 throughout: no
    # kernel; it is a cast only for parameters of another dtype)
    assert set(added) <= {"rms_norm", "add", "mean", "sub", "getattr", "size", "to"}, added
    assert added.get("add", 0) <= kept_beta, (added, kept_beta)
    assert added.get("mean", 0) <= centred and added.get("sub", 0) <= centred, (added, centred)
    assert added.get("to", 0) <= len(norms) + kept_beta, added
    assert all(p.dtype == torch.float32 for m in norms for p in m.parameters())
    metadata = ("getattr", "size", "to")
    assert (sum(after.values()) - sum(after[k] for k in metadata)
            <= sum(before.values()) - sum(before[k] for k in metadata) + kept_beta + 2 * centred)
