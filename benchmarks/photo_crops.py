"""Held-out image inputs for the vision benchmarks: random crops of real photographs.

The package index ships a few photographs (``scikit-image``'s ``skimage/data``: astronaut, coffee,
chelsea, rocket, motorcycle, retina, …); one crop per image is not enough to rank quantizers, so this
draws many: a random square of 25-100 % of the shorter side at a random place, mirrored half the time,
resized bicubically to ``size`` and normalised with ImageNet's mean and std (DINOv2's and ViT's
processors). Grey images are repeated over three channels. Which files are used is part of the seed's
contract: sorted names, so a run on the same folder draws the same crops.

Calibration and evaluation must not share photographs: pass ``files`` (or ``exclude``) to split them.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
# scikit-image's sample files that are drawings, test patterns or tiny: not photographs
NOT_PHOTOS = frozenset({"chessboard_GRAY.png", "chessboard_RGB.png", "color.png", "logo.png", "phantom.png",
                        "microaneurysms.png", "no_time_for_that_tiny.gif", "page.png", "text.png"})


def photographs(folder: Path, exclude: Sequence[str] = ()) -> list[Path]:
    """The photograph files under ``folder`` (PNG/JPEG, sorted), less the known non-photographs and ``exclude``."""
    skip = NOT_PHOTOS | set(exclude)
    files = sorted(p for ext in ("*.png", "*.jpg", "*.jpeg") for p in Path(folder).glob(ext))
    return [p for p in files if p.name not in skip]


def crop_boxes(width: int, height: int, n: int, gen: torch.Generator,
               scale: tuple[float, float] = (0.25, 1.0)) -> list[tuple[int, int, int, int, bool]]:
    """``n`` square boxes ``(left, top, right, bottom, mirrored)`` inside a ``width × height`` image, each
    side a uniform fraction ``scale`` of the shorter side."""
    short = min(width, height)
    boxes = []
    for _ in range(n):
        side = max(1, int(short * (scale[0] + (scale[1] - scale[0]) * float(torch.rand((), generator=gen)))))
        left = int(torch.randint(0, width - side + 1, (), generator=gen))
        top = int(torch.randint(0, height - side + 1, (), generator=gen))
        boxes.append((left, top, left + side, top + side, bool(torch.rand((), generator=gen) < 0.5)))
    return boxes


def photo_crops(folder: Path | None = None, n: int = 256, size: int = 224, seed: int = 0,
                files: Sequence[Path] | None = None, exclude: Sequence[str] = ()) -> torch.Tensor:
    """``[n, 3, size, size]`` normalised pixels: ``n`` crops spread evenly over the photographs."""
    import numpy as np
    from PIL import Image

    files = list(files) if files is not None else photographs(Path(folder), exclude)
    if not files:
        raise SystemExit(f"no photographs (PNG/JPEG) in {folder}")
    gen = torch.Generator().manual_seed(seed)
    mean = torch.tensor(MEAN).view(3, 1, 1)
    std = torch.tensor(STD).view(3, 1, 1)
    out = []
    for i, path in enumerate(files):
        count = n // len(files) + (1 if i < n % len(files) else 0)
        img = Image.open(path).convert("RGB")
        for left, top, right, bottom, mirrored in crop_boxes(*img.size, count, gen):
            crop = img.crop((left, top, right, bottom)).resize((size, size), Image.BICUBIC)
            if mirrored:
                crop = crop.transpose(Image.FLIP_LEFT_RIGHT)
            t = torch.from_numpy(np.asarray(crop, dtype=np.float32).copy()).permute(2, 0, 1) / 255.0
            out.append((t - mean) / std)
    return torch.stack(out)
