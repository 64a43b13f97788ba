"""Does the kind of memory a model's weights live in move its torch eager time? DINOv2 in three copies, side by side.

``original``: ``Dinov2Model.from_pretrained`` (transformers 5 maps the safetensors file: its weights are a private
file mapping, which the kernel may back with huge pages where the page cache holds large folios); ``copy``: its deep
copy (anonymous memory, 4 KiB pages unless ``THP_MEM_ALLOC_ENABLE=1`` makes PyTorch's CPU allocator ask for huge
pages); ``native``: the deep copy converted (``patch(..., beta_placement="keep")``), as every variant of
``dinov2_online_speed.py`` is built. Batch 8 at 112 px, one thread, each timing the fastest of 5 forwards under
``torch.inference_mode``, ABBA rounds (``dinov2_online_speed.abba``). Prints the page figures from
``/proc/self/smaps`` (``FilePmdMapped`` of the checkpoint's mapping, ``AnonHugePages`` of the process) and the
ratios to the original; writes both to the JSON.

    python benchmarks/eager_memory_probe.py --model DINOV2_SMALL --rounds 8 --json probe.json
    THP_MEM_ALLOC_ENABLE=1 python benchmarks/eager_memory_probe.py --model DINOV2_SMALL --rounds 8 --json thp.json
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dinov2_online_speed import abba  # noqa: E402


def pages() -> dict[str, int]:
    """``file_pmd_kB``: the checkpoint mapping's huge-page-mapped kB; ``anon_huge_kB``: the process's anonymous
    huge pages, kB."""
    txt = Path("/proc/self/smaps").read_text()
    out = {"anon_huge_kB": sum(int(ln.split()[1]) for ln in txt.split("\n") if ln.startswith("AnonHugePages"))}
    for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", txt):
        lines = block.split("\n")
        if "model.safetensors" in lines[0]:
            out["file_pmd_kB"] = out.get("file_pmd_kB", 0) + sum(
                int(ln.split()[1]) for ln in lines if ln.startswith("FilePmdMapped"))
    return out


def main(argv: list[str] | None = None) -> dict:
    import transformers as tf

    import normswap

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="a Dinov2Model directory (safetensors)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model = tf.Dinov2Model.from_pretrained(args.model).eval()
    native = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        normswap.patch(native, beta_placement="keep")
    models = {"original": model, "copy": copy.deepcopy(model), "native": native}
    x = torch.randn(8, 3, 112, 112)

    def timer(m: torch.nn.Module):
        def seconds() -> float:
            best = float("inf")
            for _ in range(5):
                t0 = time.perf_counter()
                with torch.inference_mode():
                    m(pixel_values=x)
                best = min(best, time.perf_counter() - t0)
            return best
        return seconds

    run = {name: timer(m) for name, m in models.items()}
    for fn in run.values():  # warm-up
        fn()
    print("pages:", pages(), flush=True)
    ratios = abba(run, args.rounds)
    for name, r in ratios.items():
        print(f"{name}: {statistics.median(r):.3f} ({min(r):.3f}-{max(r):.3f})", flush=True)
    result = {"ratios": ratios, "pages": pages()}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
