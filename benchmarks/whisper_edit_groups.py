"""Write Whisper hybrids that carry one group of a compat conversion's edits each (for the attribution).

A compat conversion keeps the stock LayerNorms, so each group of its edits is exact on its own:
centering a writer moves every token's stream by a multiple of the all-ones vector, which the next
LayerNorm removes; a β folded into the readers' biases is the same affine map; a centered decoder
embedding with the untied original ``proj_out`` is the same model. Each hybrid is the compat directory
with every tensor outside its group set back to the original's, so its float32 outputs equal the
original's up to rounding, and only the quantizer sees the difference.

    python benchmarks/whisper_edit_groups.py ORIG_DIR COMPAT_DIR OUT_PREFIX

writes OUT_PREFIX-writers (centered ``out_proj``/``fc2``), OUT_PREFIX-embeddings (centered decoder
``embed_tokens``/``embed_positions``, untied ``proj_out``) and OUT_PREFIX-beta (LayerNorm β folded into
``q_proj``/``v_proj``/``fc1`` biases); a fourth argument names other groups, e.g. ``encoder,decoder``:
every edit of one stack (the decoder's with ``proj_out``), the other stack the original's (exact for a
rotated compat model, whose encoder output is a model output and so left as the original's).
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

from safetensors.torch import load_file, save_file

GROUPS = {
    "writers": re.compile(r"\.(out_proj|fc2)\."),
    # the MLP writers alone (round 58: the rows a rotation draw cannot re-round)
    "fc2": re.compile(r"\.fc2\."),
    "out-proj": re.compile(r"\.out_proj\."),
    "embeddings": re.compile(r"decoder\.embed_(tokens|positions)|^proj_out"),
    "beta": re.compile(r"layer_norm\.bias|\.(q_proj|v_proj|fc1)\.bias"),
    # by stream (for a rotated compat model, whose encoder output is a model output and so is the original's):
    # every edit of one stack, the other stack as the original's
    "encoder": re.compile(r"^model\.encoder\."),
    "decoder": re.compile(r"^model\.decoder\.|^proj_out"),
    # the encoder's norms and their readers alone (γ and β folded into q/k/v/fc1; writers the original's)
    "encoder-readers": re.compile(r"^model\.encoder\.layers\.\d+\.(self_attn\.[qkv]_proj|fc1|self_attn_layer_norm"
                                  r"|final_layer_norm)\."),
}
DEFAULT_GROUPS = ("writers", "embeddings", "beta")


def main(orig: Path, compat: Path, prefix: str, groups: tuple[str, ...] = DEFAULT_GROUPS) -> None:
    a, b = load_file(orig / "model.safetensors"), load_file(compat / "model.safetensors")
    for name in groups:
        pattern = GROUPS[name]
        out = Path(f"{prefix}-{name}")
        shutil.copytree(compat, out, dirs_exist_ok=True)
        hybrid = {}
        for key, value in b.items():
            keep = pattern.search(key) is not None
            if key == "proj_out.weight" and not keep:
                hybrid[key] = a["model.decoder.embed_tokens.weight"].to(value.dtype)
            else:
                hybrid[key] = value if keep else a[key].to(value.dtype)
        save_file(hybrid, out / "model.safetensors", metadata={"format": "pt"})
        print(out, sum(1 for k in b if pattern.search(k)), "tensors from compat")


if __name__ == "__main__":
    chosen = tuple(sys.argv[4].split(",")) if len(sys.argv) > 4 else DEFAULT_GROUPS
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], chosen)
