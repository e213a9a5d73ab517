"""What the classify panel shows, as plain markdown, HTML and matplotlib (no Gradio here, so
tests read it without a browser): a drawing's top 3 per model, test images with each model's
prediction and confidence, confusion matrices.

    python -m pytest -q tests/experiments/demo/test_demo_classify.py
"""

from __future__ import annotations

import base64
import html
import io

import numpy as np
from PIL import Image

from experiments.demo.classify import Classifier, confusion, top_k

THUMB_PX = 56  # a 28x28 image shown at twice its size, pixels kept sharp


def top3_markdown(models: list[Classifier], image: np.ndarray | None, names: list[str]) -> str:
    """A table: one row per loaded model, its three most probable classes for `image`.

    Args:
      image: uint8 [28, 28, 1] (None: nothing drawn yet).
    """
    if not models:
        return "No model loaded: load a result folder or checkpoint above."
    if image is None:
        return "Draw an item on the canvas: each loaded model's top 3 appear here."
    rows = ["| model | 1st | 2nd | 3rd |", "|---|---|---|---|"]
    for model in models:
        best = top_k(model.probabilities(image[None])[0], names)
        rows.append(f"| {model.name} | " + " | ".join(f"**{n}** {p:.0%}" if i == 0 else f"{n} {p:.0%}"
                                                      for i, (n, p) in enumerate(best)) + " |")
    return "\n".join(rows)


def _data_uri(image: np.ndarray) -> str:
    buf = io.BytesIO()
    Image.fromarray(image[..., 0]).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_images_html(images: np.ndarray, labels: np.ndarray, probabilities: dict[str, np.ndarray],
                     names: list[str]) -> str:
    """A table: a test image per column, its label, then each model's prediction and confidence
    (green when right, red when wrong).

    Args:
      probabilities: model name -> float [N, 10] for these N images.
    """
    style = f"width:{THUMB_PX}px;height:{THUMB_PX}px;image-rendering:pixelated"
    head = "".join(f'<td><img src="{_data_uri(im)}" style="{style}" alt="{html.escape(names[y])}"></td>'
                   for im, y in zip(images, labels))
    truth = "".join(f"<td>{html.escape(names[y])}</td>" for y in labels)
    rows = [f"<tr><th>image</th>{head}</tr>", f"<tr><th>label</th>{truth}</tr>"]
    for name, probs in probabilities.items():
        cells = []
        for p, y in zip(probs, labels):
            k = int(np.argmax(p))
            colour = "#1a7f37" if k == y else "#cf222e"
            cells.append(f'<td style="color:{colour}">{html.escape(names[k])}<br>{p[k]:.0%}</td>')
        rows.append(f"<tr><th>{html.escape(name)}</th>{''.join(cells)}</tr>")
    return f'<table class="test-images" style="font-size:0.85em">{"".join(rows)}</table>'


def confusion_figure(labels: np.ndarray, probabilities: dict[str, np.ndarray], names: list[str]):
    """One confusion matrix per model (rows: true class, columns: predicted; each row as
    fractions of that class), titled with the model's test accuracy."""
    import matplotlib  # only the confusion figure draws with matplotlib (the page starts without it)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): the backend is chosen before pyplot loads

    n = max(1, len(probabilities))
    fig, axes = plt.subplots(1, n, figsize=(4.2 * n, 4.2), squeeze=False)
    for ax, (name, probs) in zip(axes[0], probabilities.items()):
        predicted = probs.argmax(-1)
        counts = confusion(labels, predicted, len(names))
        rates = counts / np.maximum(counts.sum(1, keepdims=True), 1)
        ax.imshow(rates, cmap="Blues", vmin=0, vmax=1)
        ax.set_title(f"{name}\ntest accuracy {np.mean(predicted == labels):.2%}", fontsize=8)
        ax.set_xticks(range(len(names)), names, rotation=90, fontsize=7)
        ax.set_yticks(range(len(names)), names, fontsize=7)
        ax.set_xlabel("predicted", fontsize=8)
        ax.set_ylabel("true", fontsize=8)
    fig.tight_layout()
    plt.close(fig)
    return fig
