"""The plan figure of the docs (``python -m research.figure``) is reproducible and drawn from a real plan."""

import os
import re

import numpy as np
from PIL import Image

from ppdiffusers_tome.ops import bipartite_soft_matching_random2d
from ppdiffusers_tome.testing import gpu_kernels
from research.figure import draw_plan_figure, main, scene_tokens

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMITTED = os.path.join(ROOT, "docs", "tome_plan.png")


def pixels(path):
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"))


# the figure -------------------------------------------------------------------------------------------------
def test_the_script_imports_the_package_before_paddle():
    """Imported first, Paddle prints "No ccache found" (``python -m research.figure`` did); the package, imported
    before it, keeps that quiet."""
    with open(os.path.join(ROOT, "research", "figure.py"), encoding="utf-8") as f:
        names = [name for name in re.findall(r"^\s*(?:import|from) (\w+)", f.read(), re.M)
                 if name in ("paddle", "ppdiffusers", "ppdiffusers_tome")]
    assert names[0] == "ppdiffusers_tome", names


def test_two_renders_of_the_figure_are_byte_identical(tmp_path):
    for name in ("a.png", "b.png"):
        assert main(["--grid", "12", "--output", str(tmp_path / name)]) == 0
    assert (tmp_path / "a.png").read_bytes() == (tmp_path / "b.png").read_bytes()


def test_committed_figure_is_a_fresh_render_with_the_documented_defaults(tmp_path):
    """``bash run.sh python -m research.figure --output docs/tome_plan.png``. Compared as decoded pixels, so another zlib
    that compresses differently does not matter; the pixels must be the same."""
    fresh = tmp_path / "tome_plan.png"
    assert main(["--output", str(fresh)]) == 0
    committed, drawn = pixels(COMMITTED), pixels(fresh)
    assert committed.shape == drawn.shape
    assert np.array_equal(committed, drawn), f"{int((committed != drawn).any(-1).sum())} pixels differ"


def test_figure_png_carries_no_metadata(tmp_path):
    path = tmp_path / "plan.png"
    assert main(["--grid", "8", "--output", str(path)]) == 0
    with Image.open(path) as image:
        assert not getattr(image, "text", {})  # no tEXt/iTXt chunks (software, creation time)
    assert b"tIME" not in path.read_bytes()


def test_figure_draws_the_same_pixels_on_the_gpu_branch():
    """The GPU kernels round means differently; the figure always uses the CPU ones, so a GPU machine (or a test
    that forced the GPU branch) draws the committed figure too."""
    cpu, _ = draw_plan_figure(ratio=0.5, grid=12, cell=3)
    with gpu_kernels():
        gpu, _ = draw_plan_figure(ratio=0.5, grid=12, cell=3)
    assert np.array_equal(np.asarray(cpu), np.asarray(gpu))


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


def test_a_folder_as_output_is_refused_before_drawing(tmp_path, capsys):
    import pytest

    with pytest.raises(SystemExit) as done:
        main(["--output", str(tmp_path)])
    assert done.value.code == 2 and "is a folder" in capsys.readouterr().err
