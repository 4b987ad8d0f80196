"""The synthetic shapes dataset (ppdiffusers_tome/shapes/dataset.py): deterministic from (seed, index), captions that
say what the labels say, objects and backgrounds in the colours they are named after, and enough variety."""

import re

import numpy as np
import pytest

from research.shapes import dataset
from research.shapes.dataset import (
    BACKGROUND_RGB,
    COLOUR_RGB,
    POSITIONS,
    batch,
    label_indices,
    object_mask,
    sample,
)

INDICES = range(60)

ONE = re.compile(r"^a (small|large) (\w+) (\w+) at the ([a-z ]+) on a (\w+) background$")
TWO = re.compile(r"^a (small|large) (\w+) (\w+) (left of|right of|above|below) a (small|large) (\w+) (\w+) "
                 r"on a (\w+) background$")


def pixels(image):
    return np.asarray(image, dtype=np.float64)


def test_same_seed_and_index_give_identical_pixels_caption_and_labels_in_any_order():
    first = [sample(i, seed=3) for i in (5, 1, 9)]
    again = [sample(i, seed=3) for i in (9, 5, 1)]  # another order: nothing depends on what was drawn before
    for (image, caption, labels), (image2, caption2, labels2) in zip(first, [again[1], again[2], again[0]]):
        assert np.array_equal(pixels(image), pixels(image2))
        assert caption == caption2
        assert labels == labels2


def test_different_index_or_seed_gives_a_different_image():
    base, caption, _ = sample(0, seed=0)
    for other, other_caption, _ in (sample(1, seed=0), sample(0, seed=1)):
        assert not np.array_equal(pixels(base), pixels(other))
    captions = {sample(i, seed=0)[1] for i in INDICES}
    assert len(captions) > 55  # practically every caption differs


def test_image_size_mode_and_errors():
    image, _, _ = sample(2, size=48)
    assert image.size == (48, 48) and image.mode == "RGB"
    with pytest.raises(ValueError, match="seed and index must be >= 0"):
        sample(-1)
    with pytest.raises(ValueError, match="size must be >= 16"):
        sample(0, size=8)


@pytest.mark.parametrize("index", INDICES)
def test_caption_says_what_the_labels_say(index):
    _, caption, labels = sample(index, seed=0)
    objects = labels["objects"]
    assert labels["n_objects"] == len(objects) in (1, 2)
    first = objects[0]
    assert (labels["shape"], labels["colour"], labels["size"], labels["position"]) == (
        first["shape"], first["colour"], first["size"], first["position"])
    if len(objects) == 1:
        match = ONE.match(caption)
        assert match, caption
        assert match.groups() == (first["size"], first["colour"], first["shape"], first["position"],
                                  labels["background"])
        assert labels["position_known"]
    else:
        match = TWO.match(caption)
        assert match, caption
        second = objects[1]
        size, colour, shape, relation, size2, colour2, shape2, background = match.groups()
        assert (size, colour, shape, size2, colour2, shape2, background) == (
            first["size"], first["colour"], first["shape"], second["size"], second["colour"], second["shape"],
            labels["background"])
        dx = second["column"] - first["column"]
        dy = second["row"] - first["row"]
        expected = ("left of" if dx > 0 else "right of") if dx else ("above" if dy > 0 else "below")
        assert relation == expected
        assert first["position"] != second["position"]
        assert (first["shape"], first["colour"]) != (second["shape"], second["colour"])
        assert not labels["position_known"]
    for obj in objects:
        assert obj["colour"] != labels["background"]
        assert POSITIONS[obj["row"] * 3 + obj["column"]] == obj["position"]
    assert set(caption.split()) <= set(dataset.VOCABULARY)


@pytest.mark.parametrize("index", INDICES)
def test_objects_and_background_have_their_named_colours(index):
    image, _, labels = sample(index, seed=0)
    rgb = pixels(image)
    masks = [object_mask(labels, k) for k in range(labels["n_objects"])]
    covered = np.zeros(rgb.shape[:2], dtype=bool)
    for k in reversed(range(len(masks))):  # later objects are drawn on top: only what stays visible counts
        inside = (masks[k] == 1.0) & ~covered
        assert inside.sum() >= 8, "every object shows a solid interior"
        mean = rgb[inside].mean(axis=0)
        np.testing.assert_allclose(mean, COLOUR_RGB[labels["objects"][k]["colour"]], atol=1.0)
        covered |= masks[k] > 0
    background = rgb[~covered].mean(axis=0)
    named = np.asarray(BACKGROUND_RGB[labels["background"]], dtype=np.float64)
    assert np.abs(background - named).max() < 30, (background, named)
    nearest = min(BACKGROUND_RGB, key=lambda name: np.linalg.norm(background - BACKGROUND_RGB[name]))
    assert nearest == labels["background"]


def test_shapes_are_antialiased():
    image, _, labels = sample(0, seed=0)
    edge = object_mask(labels, 0)
    assert ((edge > 0) & (edge < 1)).any(), "the supersampled edge has partial coverage"


def test_the_stream_covers_every_label_and_relation():
    seen = {key: set() for key in ("shape", "colour", "position", "background", "size")}
    relations, counts = set(), set()
    for index in range(300):
        _, caption, labels = sample(index, seed=0)
        for key in seen:
            seen[key].add(labels[key])
        counts.add(labels["n_objects"])
        relations.update(r for r in ("left of", "right of", "above", "below") if f" {r} " in caption)
    assert seen["shape"] == set(dataset.SHAPES) and len(dataset.SHAPES) >= 4
    assert seen["colour"] == set(dataset.COLOURS) and len(dataset.COLOURS) >= 6
    assert seen["position"] == set(POSITIONS) and len(POSITIONS) == 9
    assert seen["background"] == set(dataset.BACKGROUNDS)
    assert seen["size"] == set(dataset.SIZES)
    assert counts == {1, 2} and relations == {"left of", "right of", "above", "below"}


def test_named_colours_are_well_separated():
    values = np.asarray(list(COLOUR_RGB.values()), dtype=np.float64)
    distances = np.linalg.norm(values[:, None] - values[None], axis=-1)
    assert distances[~np.eye(len(values), dtype=bool)].min() > 100


def test_batch_is_float_in_range_with_the_label_indices():
    indices = [4, 0, 7, 11]
    images, captions, targets = batch(indices, seed=2, size=32)
    assert images.dtype == np.float32 and images.shape == (4, 3, 32, 32)
    assert images.min() >= -1.0 and images.max() <= 1.0 and images.std() > 0.1
    for row, index in enumerate(indices):
        image, caption, labels = sample(index, seed=2, size=32)
        np.testing.assert_allclose(images[row], pixels(image).transpose(2, 0, 1) / 127.5 - 1.0, atol=1e-6)
        assert captions[row] == caption
        for key, value in label_indices(labels).items():
            assert targets[key][row] == value
    assert all(t.dtype == np.int64 for t in targets.values())
    with pytest.raises(ValueError, match="at least one image"):
        batch([])


def test_two_object_images_have_only_a_background_target():
    for index in range(40):
        _, _, labels = sample(index, seed=0)
        targets = label_indices(labels)
        if labels["n_objects"] == 2:
            assert targets["shape"] == targets["colour"] == targets["position"] == -1
        else:
            assert min(targets.values()) >= 0
        assert dataset.BACKGROUNDS[targets["background"]] == labels["background"]
