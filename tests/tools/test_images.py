"""Labelled rows of images (``tools.images.side_by_side``, the demo's PNG) stay readable however small the images
are."""

import numpy as np
import pytest
from PIL import Image

from ppdiffusers_tome.tools.bench.demo import demo_grid
from ppdiffusers_tome.tools.images import MIN_TILE, SCALE_HEIGHT, row_layout, side_by_side


# labelled rows -----------------------------------------------------------------------------------------------------
def _overlap(a, b):
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


LABELS = [
    ["stripes", "square", "vanilla", "ToMe 0.5"],  # multi_controlnet.py's row, which used to run together
    ["vanilla", "ToMe 0.30", "ToMe 0.50", "|diff| x4 (0.50)"],  # the demo's row
    ["vanilla", "a label far too long to fit above a single small tile of the row"],
]


@pytest.mark.parametrize("labels", LABELS)
@pytest.mark.parametrize("side", [16, 32, 64, 200])
def test_labels_do_not_overlap_and_tiles_have_a_minimum_size(labels, side):
    layout = row_layout([(side, side)] * len(labels), labels)
    assert min(layout.tile) >= MIN_TILE and layout.tile[0] == side * layout.scale
    assert layout.font_size >= 8
    for i, (text, tile) in enumerate(zip(layout.text_boxes, layout.tile_boxes)):
        assert text[3] <= layout.label_height <= tile[1]  # the label sits in its own row, above its tile
        assert tile[0] <= text[0] and text[2] <= tile[2]  # and inside its tile's column
        assert text[2] > text[0] and text[3] > text[1]
        for other in layout.text_boxes[i + 1:] + layout.tile_boxes:
            assert not _overlap(text, other)
    for a, b in zip(layout.tile_boxes, layout.tile_boxes[1:]):
        assert b[0] > a[2]  # a gap between tiles


def test_side_by_side_enlarges_small_images_with_nearest_neighbour_and_draws_only_in_the_label_boxes():
    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 256, (32, 32, 3), dtype=np.uint8) for _ in range(4)]
    labels = LABELS[0]
    row = np.asarray(side_by_side([Image.fromarray(a) for a in arrays], labels))
    layout = row_layout([(32, 32)] * 4, labels)
    assert row.shape[:2] == layout.size[::-1] and layout.scale == 4
    for array, (left, top, right, bottom) in zip(arrays, layout.tile_boxes):
        assert np.array_equal(row[top:bottom, left:right], array.repeat(4, 0).repeat(4, 1))
    ink = (row[:layout.label_height] < 128).any(-1)
    assert ink.any()
    inside = np.zeros_like(ink)
    for left, top, right, bottom in layout.text_boxes:
        inside[top:bottom, left:right] = True
    assert not (ink & ~inside).any()  # every dark pixel of the label row belongs to one label's box
    for left, top, right, bottom in layout.text_boxes:  # and every label drew something
        assert ink[top:bottom, left:right].any()


def test_side_by_side_keeps_large_images_as_they_are():
    image = Image.fromarray(np.random.default_rng(1).integers(0, 256, (160, 200, 3), dtype=np.uint8))
    layout = row_layout([image.size], ["vanilla"])
    row = np.asarray(side_by_side([image], ["vanilla"]))
    assert layout.scale == 1 and np.array_equal(row[layout.label_height:], np.asarray(image))


def test_side_by_side_refuses_mismatched_labels():
    with pytest.raises(ValueError, match="one label per image"):
        side_by_side([Image.new("RGB", (8, 8))], ["a", "b"])


def test_demo_grid_of_32_px_images_is_readable():
    rng = np.random.default_rng(2)
    images = [rng.uniform(0, 1, (32, 32, 3)) for _ in range(3)]
    rows = [{"method": "vanilla", "ratio": 0.0}, {"method": "tome", "ratio": 0.3}, {"method": "tome", "ratio": 0.5}]
    grid = demo_grid(rows, images)
    layout = row_layout([(32, 32)] * 4, ["vanilla", "ToMe 0.30", "ToMe 0.50", "|diff| x4 (0.50)"])
    assert grid.size[0] == layout.size[0] and min(layout.tile) >= MIN_TILE
    assert layout.labels == ["vanilla", "ToMe 0.30", "ToMe 0.50", "|diff| x4 (0.50)"]  # none shortened
    # the row itself is unchanged above the scale bar
    row = np.asarray(side_by_side([Image.fromarray((np.clip(t, 0, 1) * 255).round().astype("uint8"))
                                   for t in images + [np.clip(np.abs(images[-1] - images[0]) * 4, 0, 1)]],
                                  layout.labels))
    np.testing.assert_array_equal(np.asarray(grid)[: layout.size[1]], row)


def test_the_difference_panel_has_a_scale_bar_and_the_caption_is_drawn():
    rng = np.random.default_rng(3)
    images = [rng.uniform(0, 1, (32, 32, 3)) for _ in range(2)]
    rows = [{"method": "vanilla", "ratio": 0.0}, {"method": "tome", "ratio": 0.5}]
    plain, captioned = demo_grid(rows, images), demo_grid(rows, images, "a caption long enough to need two lines "
                                                                         "in a row of three tiles of 128 px each")
    layout = row_layout([(32, 32)] * 3, ["vanilla", "ToMe 0.50", "|diff| x4 (0.50)"])
    left, _, right, bottom = layout.tile_boxes[-1]
    ramp = np.asarray(plain.convert("L"))[bottom + 3 + SCALE_HEIGHT // 2, left + 1: right - 1].astype(int)
    assert ramp[0] < 10 and ramp[-1] > 245 and (np.diff(ramp) >= 0).all()  # black at 0, white at 1/4 and above
    under_first = np.asarray(plain.convert("L"))[bottom + 3: bottom + 3 + SCALE_HEIGHT, 2: left - 10]
    assert (under_first == 255).all()  # the bar sits under the difference panel only
    extra = np.asarray(captioned.convert("L"))[plain.size[1]:]
    assert captioned.size[1] > plain.size[1] and (extra < 128).any()  # the caption's lines are drawn below


