"""figure.py: the README figure (tokens | plan | unmerge(merge(tokens))) drawn from a real plan, and side_by_side."""

import numpy as np
from PIL import Image

from ppdiffusers_tome.figure import draw_plan_figure, scene_tokens, side_by_side
from ppdiffusers_tome.merge import bipartite_soft_matching_random2d

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
    tokens = (np.clip(scene_tokens(grid), 0, 1) * 255).astype("uint8").astype(int)
    np.testing.assert_array_equal(panel(image, 0, grid, cell), tokens)
    # the third panel is unmerge(merge(tokens)) of the same plan (seed 3), recomputed here
    import paddle

    metric = paddle.to_tensor(scene_tokens(grid).reshape(1, -1, 3).astype("float32"))
    plan = bipartite_soft_matching_random2d(metric, grid, grid, 2, 2, 72, generator=3)
    expected = (np.clip(plan.unmerge(plan.merge(metric)).numpy().reshape(grid, grid, 3), 0, 1) * 255).astype("uint8")
    np.testing.assert_array_equal(panel(image, 2, grid, cell), expected.astype(int))
    assert (panel(image, 2, grid, cell) != tokens).any()  # merging changed some tokens
    # the plan panel: every merged src has exactly its dst's colour
    plan_panel = panel(image, 1, grid, cell)
    for pos, into in zip(plan.merged_pos.numpy()[0], plan.merged_into.numpy()[0]):
        np.testing.assert_array_equal(plan_panel[pos // grid, pos % grid], plan_panel[into // grid, into % grid])


def test_at_ratio_zero_the_round_trip_panel_equals_the_tokens():
    image, info = draw_plan_figure(ratio=0.0, grid=8, cell=4)
    assert info["merged"] == 0
    np.testing.assert_array_equal(panel(image, 2, 8, 4), panel(image, 0, 8, 4))


def test_side_by_side_puts_each_image_under_its_label():
    red, blue = Image.new("RGB", (10, 6), (255, 0, 0)), Image.new("RGB", (10, 6), (0, 0, 255))
    strip = side_by_side([red, blue], ["a", "b"])
    assert strip.size == (20, 20)
    pixels = np.asarray(strip)
    assert (pixels[14:, :10] == (255, 0, 0)).all() and (pixels[14:, 10:] == (0, 0, 255)).all()
    assert (pixels[:14] != 255).any()  # the labels were written
