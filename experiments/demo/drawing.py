"""A drawing on the demo's canvas -> the 28x28 uint8 image a model takes, made the way the
dataset's own images were made.

    python -m pytest -q tests/experiments/demo/test_demo_drawing.py

Both datasets hold light items on a black background, so the canvas (dark ink on white, or
strokes on a transparent layer, composed over white) first becomes ink intensity, 0 where
nothing was drawn and 1 under full ink: the datasets' "negated" step.

Fashion-MNIST (Xiao, Rasul and Vollgraf 2017, the dataset's README): each product photo was
trimmed of the edges close to the corner colour (5% distance), resized so that its longest
edge is 28 pixels, sharpened with a Gaussian operator (radius and sigma 1), its shortest edge
extended to 28 with the item in the centre, negated and stored as 8-bit grey. Here: trim to
the box of ink above 5%, resize the longest edge to 28 by area averaging (the original
subsampled, skipping rows and columns: harmless on photos, it would drop brush strokes
thinner than the step), sharpen with an unsharp mask of radius 1, centre the box on 28x28.

MNIST (LeCun et al., the dataset's page): NIST's bilevel digits were size-normalised to fit a
20x20 box keeping their aspect ratio (anti-aliasing gave grey levels), then placed in 28x28 so
that the centre of mass of the pixels sits at the centre of the field. Here: trim to the box
of ink, resize (Lanczos, anti-aliased) so the longest edge is 20, and translate so the centre
of mass is at the centre (13.5, 13.5), rounded to whole pixels and kept inside the frame.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from PIL import Image, ImageFilter

SIDE = 28          # the datasets' image side
MNIST_BOX = 20     # MNIST's digits fit this box inside SIDE
TRIM = 0.05        # Fashion-MNIST's trimming distance, as ink intensity


def ink(canvas: Any) -> np.ndarray | None:
    """Ink intensity in [0, 1], float32 [H, W], from what the canvas sends.

    Args:
      canvas: a Gradio image-editor value (a dict whose "composite" is the picture), or an
        image array [H, W], [H, W, 3] (RGB) or [H, W, 4] (RGBA; transparent counts as white).
    Returns:
      None for an empty canvas (nothing sent, or no ink).
    """
    if isinstance(canvas, dict):
        canvas = canvas.get("composite")
    if canvas is None:
        return None
    a = np.asarray(canvas, dtype=np.float32) / 255.0
    if a.ndim == 2:
        grey = a
    else:
        grey = a[..., :3].mean(-1) if a.shape[-1] >= 3 else a[..., 0]
        if a.shape[-1] == 4:  # compose over white: unpainted transparent pixels carry no ink
            grey = a[..., 3] * grey + (1.0 - a[..., 3])
    out = 1.0 - grey
    return out if out.max() > TRIM else None


def _box(intensity: np.ndarray) -> np.ndarray:
    """The rows and columns that hold ink above TRIM (the datasets' trimming step)."""
    rows = np.flatnonzero((intensity > TRIM).any(1))
    cols = np.flatnonzero((intensity > TRIM).any(0))
    return intensity[rows[0]:rows[-1] + 1, cols[0]:cols[-1] + 1]


def _resize_longest(intensity: np.ndarray, side: int, resample) -> Image.Image:
    """A greyscale image whose longest edge is `side`, aspect ratio kept (>= 1 pixel)."""
    h, w = intensity.shape
    scale = side / max(h, w)
    size = (max(1, round(w * scale)), max(1, round(h * scale)))
    img = Image.fromarray(np.clip(intensity * 255.0, 0, 255).astype(np.uint8), "L")
    return img.resize(size, resample)


def fashion_style(intensity: np.ndarray) -> np.ndarray:
    """Fashion-MNIST's recipe (module docstring): trim, longest edge 28, sharpen, centre."""
    item = _resize_longest(_box(intensity), SIDE, Image.Resampling.BOX)
    item = item.filter(ImageFilter.UnsharpMask(radius=1, percent=100, threshold=0))
    out = Image.new("L", (SIDE, SIDE), 0)
    out.paste(item, ((SIDE - item.width) // 2, (SIDE - item.height) // 2))
    return np.asarray(out, np.uint8)


def mnist_style(intensity: np.ndarray) -> np.ndarray:
    """MNIST's recipe (module docstring): 20x20 box, centre of mass at the field's centre."""
    digit = np.asarray(_resize_longest(_box(intensity), MNIST_BOX, Image.Resampling.LANCZOS),
                       np.float32)
    h, w = digit.shape
    rows, cols = np.indices(digit.shape)
    mass = digit.sum()
    centre = (SIDE - 1) / 2
    top = int(np.clip(round(centre - (rows * digit).sum() / mass), 0, SIDE - h))
    left = int(np.clip(round(centre - (cols * digit).sum() / mass), 0, SIDE - w))
    out = np.zeros((SIDE, SIDE), np.uint8)
    out[top:top + h, left:left + w] = digit.astype(np.uint8)
    return out


def to_input(canvas: Any, dataset: str) -> np.ndarray | None:
    """The model input for a drawing: uint8 [28, 28, 1] as the dataset stores its images.

    Args:
      canvas: what `ink` takes.
      dataset: "mnist" follows MNIST's recipe; any other (Fashion-MNIST, synthetic) follows
        Fashion-MNIST's.
    Returns:
      None for an empty canvas.
    """
    intensity = ink(canvas)
    if intensity is None:
        return None
    style = mnist_style if dataset == "mnist" else fashion_style
    return style(intensity)[..., None]
