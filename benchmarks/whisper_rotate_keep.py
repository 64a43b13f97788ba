"""Write a rotated Whisper compat directory whose readers keep the original's biases (β in the norms).

``normswap convert --format compat --rotate hadamard`` folds every decoder norm's β into its readers'
biases: a rotation needs norms of unit weight, so γ goes into the readers' columns, and
``beta_placement`` (which keeps β in the norm) applies only where γ stays in the norm. This script
measures the alternative the library does not offer: the same rotated weights, with each rotated
norm's stock LayerNorm bias set to the ``b`` that gives every reader back the original's bias,

    W_r (z + b) + c_orig = W_r z + c_r   ⇔   W_r b = c_r − c_orig   (solved jointly over the readers),

which is ``b = Q(β/γ)`` in the rotated basis: the readers' input becomes ``Q(u + β/γ)`` instead of the
folded ``Q u``. (The original's reader input ``γ⊙u + β`` cannot survive a rotation: the rotated norm
has no per-channel γ.) Key projections have no bias: the shift ``W_k b`` is the same for every key and
softmax removes it. The decoder's last norm keeps its β either way (``proj_out`` has no bias).

    python benchmarks/whisper_rotate_keep.py ORIG_DIR ROTATED_DIR OUT_DIR

Exactness: prints the worst residual of the solve (float64) and the float32 logits of ROTATED_DIR and
OUT_DIR against ORIG_DIR on one teacher-forced random-feature input.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

# each rotated decoder norm and its readers with a bias (k_proj: none, softmax-invariant)
READERS = {"self_attn_layer_norm": ("self_attn.q_proj", "self_attn.v_proj"),
           "encoder_attn_layer_norm": ("encoder_attn.q_proj",),
           "final_layer_norm": ("fc1",)}


def main(orig: Path, rotated: Path, out: Path) -> None:
    a, r = load_file(orig / "model.safetensors"), load_file(rotated / "model.safetensors")
    layers = 1 + max(int(k.split(".")[3]) for k in r if k.startswith("model.decoder.layers."))
    worst = 0.0
    for i in range(layers):
        pre = f"model.decoder.layers.{i}."
        for norm, readers in READERS.items():
            w = torch.cat([r[f"{pre}{x}.weight"].double() for x in readers])
            rhs = torch.cat([r[f"{pre}{x}.bias"].double() - a[f"{pre}{x}.bias"].double() for x in readers])
            b = torch.linalg.lstsq(w, rhs.unsqueeze(1)).solution.squeeze(1)
            worst = max(worst, float((w @ b - rhs).norm() / rhs.norm()))
            assert float(r[f"{pre}{norm}.bias"].abs().max()) == 0.0, f"{pre}{norm} keeps a bias already"
            r[f"{pre}{norm}.bias"] = b.float()
            for x in readers:
                r[f"{pre}{x}.bias"] = a[f"{pre}{x}.bias"].clone()
    shutil.copytree(rotated, out, dirs_exist_ok=True)
    save_file(r, out / "model.safetensors", metadata={"format": "pt"})
    print(f"solve residual (relative, worst norm): {worst:.2e}")
    check(orig, rotated, out)


def check(orig: Path, rotated: Path, out: Path) -> None:
    from transformers import WhisperForConditionalGeneration

    torch.manual_seed(0)
    feats = torch.randn(1, 80, 3000)
    ids = torch.randint(0, 50000, (1, 24))
    got = []
    for d in (orig, rotated, out):
        m = WhisperForConditionalGeneration.from_pretrained(d, dtype=torch.float32).eval()
        with torch.no_grad():
            got.append(m(input_features=feats, decoder_input_ids=ids).logits)
    for name, x in (("rotated (β folded)", got[1]), ("rotated, β kept", got[2])):
        print(f"{name}: float32 logits vs the original's, max relative "
              f"{float((x - got[0]).abs().max() / got[0].abs().max()):.2e}")


if __name__ == "__main__":
    main(*map(Path, sys.argv[1:4]))
