"""The canvas -> 28x28 preprocessing of the demo: the datasets' own recipes (trim, scale,
centre, negate), and a drawing classified like the dataset's item by a committed model.

    python -m pytest -q tests/experiments/demo/test_demo_drawing.py
"""

from __future__ import annotations

import numpy as np
import pytest

from experiments.demo import drawing

CANVAS = 280


def canvas(*boxes: tuple[int, int, int, int], rgba: bool = False) -> np.ndarray:
    """A white canvas (or a transparent layer) with black filled boxes (top, bottom, left, right)."""
    if rgba:
        img = np.zeros((CANVAS, CANVAS, 4), np.uint8)  # transparent: nothing drawn
        for t, b, l, r in boxes:
            img[t:b, l:r] = (0, 0, 0, 255)
    else:
        img = np.full((CANVAS, CANVAS, 3), 255, np.uint8)
        for t, b, l, r in boxes:
            img[t:b, l:r] = 0
    return img


def trousers(top: int, left: int, height: int, leg: int, gap: int) -> list[tuple[int, int, int, int]]:
    """Two legs joined at the waist, drawn as three strokes."""
    right = left + 2 * leg + gap
    return [(top, top + height, left, left + leg), (top, top + height, right - leg, right),
            (top, top + leg, left, right)]


def test_empty_canvas_gives_nothing():
    assert drawing.to_input(None, "fashion_mnist") is None
    assert drawing.to_input({"composite": None, "layers": []}, "mnist") is None
    assert drawing.to_input(canvas(), "fashion_mnist") is None
    assert drawing.to_input(canvas(rgba=True), "mnist") is None


def test_ink_is_negated_whatever_the_canvas_sends():
    box = (100, 180, 120, 160)
    white, layer = drawing.ink(canvas(box)), drawing.ink(canvas(box, rgba=True))
    np.testing.assert_array_equal(white, layer)
    assert white[140, 140] == 1 and white[10, 10] == 0
    editor = {"background": None, "layers": [], "composite": canvas(box, rgba=True)}
    np.testing.assert_array_equal(drawing.ink(editor), white)


def test_fashion_recipe_trims_scales_the_longest_edge_to_28_and_centres():
    tall = drawing.to_input(canvas((40, 240, 120, 160)), "fashion_mnist")[..., 0]
    assert tall.shape == (28, 28) and tall.dtype == np.uint8
    rows, cols = np.flatnonzero(tall.any(1)), np.flatnonzero(tall.any(0))
    assert rows[0] == 0 and rows[-1] == 27  # the longest edge spans the image
    assert abs((cols[0] + cols[-1]) / 2 - 13.5) <= 1  # centred across
    assert tall[14, 14] == 255 and tall[14, 0] == 0   # light item on black
    # Where and how large it is drawn does not matter: the same item, small in a corner.
    small = drawing.to_input(canvas((10, 60, 10, 20)), "fashion_mnist")[..., 0]
    np.testing.assert_allclose(small.astype(float), tall.astype(float), atol=40)


def test_mnist_recipe_fits_20x20_and_centres_the_mass():
    one = drawing.to_input(canvas((30, 250, 180, 200)), "mnist")[..., 0].astype(float)
    rows, cols = np.flatnonzero(one.any(1)), np.flatnonzero(one.any(0))
    assert rows[-1] - rows[0] + 1 == drawing.MNIST_BOX  # a "1": its height is the 20-pixel box
    assert cols[-1] - cols[0] + 1 < 5
    r, c = np.indices(one.shape)
    assert abs((r * one).sum() / one.sum() - 13.5) <= 0.5
    assert abs((c * one).sum() / one.sum() - 13.5) <= 0.5
    # An L-shape: its centre of mass, not its box, is what lands in the middle.
    ell = drawing.to_input(canvas((20, 260, 20, 60), (220, 260, 20, 200)), "mnist")[..., 0].astype(float)
    assert abs((r * ell).sum() / ell.sum() - 13.5) <= 0.5
    assert abs((c * ell).sum() / ell.sum() - 13.5) <= 0.5
    rows, cols = np.flatnonzero(ell.any(1)), np.flatnonzero(ell.any(0))
    assert max(rows[-1] - rows[0], cols[-1] - cols[0]) + 1 == drawing.MNIST_BOX


@pytest.fixture(scope="module")
def fashion_model():
    from experiments.demo import classify
    from experiments.demo.models import Models

    models = Models("fashion_mnist")
    found = models.bundled()
    assert found, "the committed Fashion-MNIST model (figures/data/demo) is missing"
    return classify.load_classifier(found[0], "fashion_mnist"), classify.class_names("fashion_mnist")


@pytest.mark.parametrize("top,left,height,leg,gap", [
    (40, 100, 200, 20, 30),   # large, centred
    (10, 10, 80, 10, 10),     # small, in the top left corner
    (120, 150, 150, 25, 20),  # low and to the right
])
def test_drawn_trousers_are_classified_as_trousers(fashion_model, top, left, height, leg, gap):
    """Two legs joined at the waist, wherever and however large they are drawn, are what the
    committed model calls Trouser: the recipe gives the dataset's framing."""
    model, names = fashion_model
    image = drawing.to_input(canvas(*trousers(top, left, height, leg, gap)), "fashion_mnist")
    best = names[int(np.argmax(model.probabilities(image[None])[0]))]
    assert best == "Trouser"


def test_drawn_trousers_look_like_the_datasets_trousers(fashion_model):
    """Without a model: the drawing's nearest class mean of the real test images is Trouser
    (skipped when Fashion-MNIST is not prepared on this machine)."""
    from experiments.demo.models import check_offline
    from jaxpar import data as datalib
    from jaxpar.config import DataConfig
    from jaxpar.errors import DataError

    try:
        check_offline("fashion_mnist")  # no download from a test
    except DataError as e:
        pytest.skip(str(e))
    images, labels = datalib.load_splits(DataConfig(val_size=0), seed=0).test
    _, names = fashion_model
    drawn = drawing.to_input(canvas(*trousers(40, 100, 200, 20, 30)), "fashion_mnist").ravel() / 255.0
    means = np.stack([images[labels == k].reshape(-1, 784).mean(0) / 255.0 for k in range(10)])
    cosine = means @ drawn / (np.linalg.norm(means, axis=1) * np.linalg.norm(drawn))
    assert names[int(np.argmax(cosine))] == "Trouser"
