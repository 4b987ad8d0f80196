"""The README figure (``figure`` command) is reproducible, and labelled rows of images (figure.side_by_side, the
demo's PNG) stay readable however small the images are."""

import os

import numpy as np
import pytest
from PIL import Image

from ppdiffusers_tome import merge
from ppdiffusers_tome.bench.demo import demo_grid
from ppdiffusers_tome.cli import main
from ppdiffusers_tome.figure import MIN_TILE, draw_plan_figure, row_layout, scene_tokens, side_by_side
from ppdiffusers_tome.merge import bipartite_soft_matching_random2d

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMITTED = os.path.join(ROOT, "docs", "tome_plan.png")


def pixels(path):
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"))


# the README figure -------------------------------------------------------------------------------------------------
def test_two_renders_of_the_figure_are_byte_identical(tmp_path):
    for name in ("a.png", "b.png"):
        assert main(["figure", "--grid", "12", "--output", str(tmp_path / name)]) == 0
    assert (tmp_path / "a.png").read_bytes() == (tmp_path / "b.png").read_bytes()


def test_committed_figure_is_a_fresh_render_with_the_documented_defaults(tmp_path):
    """README: ``bash run.sh figure --output docs/tome_plan.png``. Compared as decoded pixels, so another zlib
    that compresses differently does not matter; the pixels must be the same."""
    fresh = tmp_path / "tome_plan.png"
    assert main(["figure", "--output", str(fresh)]) == 0
    committed, drawn = pixels(COMMITTED), pixels(fresh)
    assert committed.shape == drawn.shape
    assert np.array_equal(committed, drawn), f"{int((committed != drawn).any(-1).sum())} pixels differ"


def test_figure_png_carries_no_metadata(tmp_path):
    path = tmp_path / "plan.png"
    assert main(["figure", "--grid", "8", "--output", str(path)]) == 0
    with Image.open(path) as image:
        assert not getattr(image, "text", {})  # no tEXt/iTXt chunks (software, creation time)
    assert b"tIME" not in path.read_bytes()


def test_figure_draws_the_same_pixels_on_the_gpu_branch():
    """The GPU kernels round means differently; the figure always uses the CPU ones, so a GPU machine (or a test
    that forced the GPU branch) draws the committed figure too."""
    cpu, _ = draw_plan_figure(ratio=0.5, grid=12, cell=3)
    previous, merge.DEVICE_OVERRIDE = merge.DEVICE_OVERRIDE, "gpu"
    try:
        gpu, _ = draw_plan_figure(ratio=0.5, grid=12, cell=3)
        assert merge.DEVICE_OVERRIDE == "gpu"  # restored to what the caller had
    finally:
        merge.DEVICE_OVERRIDE = previous
    assert np.array_equal(np.asarray(cpu), np.asarray(gpu))


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
    assert grid.size == layout.size and min(layout.tile) >= MIN_TILE
    assert layout.labels == ["vanilla", "ToMe 0.30", "ToMe 0.50", "|diff| x4 (0.50)"]  # none shortened


# the figure's panels, recomputed from a real plan -----------------------------------------------------------------
GAP, LABEL = 10, 18  # figure.py's layout: gap between panels, title strip above them


def panel(image, index, grid, cell):
    """Panel ``index`` of a figure, one pixel per token (the centre of each cell)."""
    side = grid * cell
    left = GAP + index * (side + GAP)
    pixels = np.asarray(image.convert("RGB"))[LABEL : LABEL + side, left : left + side]
    return pixels[cell // 2 :: cell, cell // 2 :: cell].astype(int)


def test_scene_tokens_are_an_rgb_grid_in_the_unit_range_with_flat_areas_and_edges():
    tokens = scene_tokens(16)
    assert tokens.shape == (16, 16, 3) and 0 <= tokens.min() and tokens.max() <= 1
    colours = len(np.unique(tokens.reshape(-1, 3).round(6), axis=0))
    assert 16 < colours < 16 * 16  # a gradient and shapes, but repeated colours (the sun, the lake) too


def test_figure_reports_the_plan():
    _, info = draw_plan_figure(ratio=0.5, grid=12, cell=2)
    assert info == {"tokens": 144, "dst": 36, "merged": 72, "grid": 12, "ratio": 0.5}
    _, none = draw_plan_figure(ratio=0.0, grid=12, cell=2)
    assert none["merged"] == 0


def test_figure_panels_show_the_tokens_and_their_round_trip_through_the_plan():
    grid, cell = 12, 6
    image, _ = draw_plan_figure(ratio=0.5, grid=grid, cell=cell, seed=3)
    assert image.size == (3 * grid * cell + 4 * GAP, grid * cell + LABEL + GAP)
    tokens = (np.clip(scene_tokens(grid), 0, 1) * 255).round().astype("uint8").astype(int)  # rounded, as drawn
    np.testing.assert_array_equal(panel(image, 0, grid, cell), tokens)
    # the third panel is unmerge(merge(tokens)) of the same plan (seed 3), recomputed here
    import paddle

    metric = paddle.to_tensor(scene_tokens(grid).reshape(1, -1, 3).astype("float32"))
    plan = bipartite_soft_matching_random2d(metric, grid, grid, 2, 2, 72, generator=3)
    expected = (np.clip(plan.unmerge(plan.merge(metric)).numpy().reshape(grid, grid, 3), 0, 1) * 255).round().astype("uint8")
    np.testing.assert_array_equal(panel(image, 2, grid, cell), expected.astype(int))
    assert (panel(image, 2, grid, cell) != tokens).any()  # merging changed some tokens
    # the plan panel: every merged src has exactly its dst's colour
    plan_panel = panel(image, 1, grid, cell)
    for pos, into in zip(plan.merged_pos.numpy()[0], plan.merged_into.numpy()[0]):
        np.testing.assert_array_equal(plan_panel[pos // grid, pos % grid], plan_panel[into // grid, into % grid])


def test_at_ratio_zero_the_round_trip_panel_equals_the_tokens():
    image, info = draw_plan_figure(ratio=0.0, grid=8, cell=4)
    assert info["merged"] == 0
    # the tokens panel is drawn from float64 colours, the round trip from the float32 tensor: one 8-bit step apart
    # at most where a colour sits on a rounding boundary
    assert np.abs(panel(image, 2, 8, 4) - panel(image, 0, 8, 4)).max() <= 1


def test_figure_never_changes_the_process_wide_device_override(monkeypatch):
    """Another thread running a model while the figure is drawn must keep its own kernel choice: the figure asks for
    the CPU kernels on its plan only."""
    seen, real = [], merge.bipartite_soft_matching_random2d

    def spy(*args, **kwargs):
        seen.append(merge.DEVICE_OVERRIDE)
        return real(*args, **kwargs)

    monkeypatch.setattr(merge, "DEVICE_OVERRIDE", "gpu")
    monkeypatch.setattr(merge, "bipartite_soft_matching_random2d", spy)
    draw_plan_figure(ratio=0.5, grid=8, cell=2)
    assert seen == ["gpu"]
