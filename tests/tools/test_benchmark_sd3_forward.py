"""benchmarks/sd3_forward.py: the FLOP ceilings (ToDo's included), its configurations, and the eager operators of one
SD3 block call per configuration (``--ops-per-block``), with a bound on what ToMe and ToDo add on the GPU kernels."""

import json

import pytest

from ppdiffusers_tome.testing import tiny_sd3_transformer
from tests.benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def sd3_forward():
    return load_benchmark("sd3_forward")


@pytest.fixture(scope="module")
def tiny_rows(sd3_forward):
    """Operator counts of the tiny SD3 transformer's first (inner) block at 128 px: 64 image tokens, 7 text tokens.
    The counts do not depend on the sizes (the 512² and 1024² rows of docs/gpu.md section 9 are the same)."""
    rows = sd3_forward.block_op_rows(tiny_sd3_transformer(), 128, text_tokens=7)
    return {(row["kernels"], row["configuration"]): row for row in rows}


def test_todo_is_a_timed_configuration_with_its_own_flop_ceiling(sd3_forward):
    assert sd3_forward.CONFIGS["ToDo, factor 2"] == {"method": "todo"}
    todo = sd3_forward.flop_ceiling(4096, 384, 0.0, False, factor=2)
    assert 1.0 < todo < sd3_forward.flop_ceiling(4096, 384, 0.5, True)  # queries and the MLP stay full
    assert sd3_forward.flop_ceiling(4096, 384, 0.0, False) == 1.0


def test_a_tome_sd3_block_on_gpu_kernels_adds_at_most_45_operators_and_todo_3(tiny_rows):
    # Measured with 0.13.0 (Paddle 3.3, GPU kernels forced, a block call after another block of the same call):
    # vanilla 87 operators; ToMe 0.5 on the attention adds 42: the plan (cosine similarity of the normed image tokens
    # split into src and dst: 2 p_norm, divide, matmul, argmax, argsort, take_along_axis x3, a where_ over the
    # non-finite scores, the dst counts with index_add) plus the merge before the attention (gather, index_add_,
    # divide_, reshapes) and the unmerge after it (gather, scatter, reshapes); with the MLP too, 51 (the same plan,
    # a second merge and unmerge). ToDo adds 3: reshape, strided slice, reshape (the joint attention it runs instead
    # of the processor issues the processor's own operators).
    vanilla = tiny_rows["gpu", "vanilla"]["ops"]
    assert vanilla > 50  # a real block call was counted (the test can fail)
    assert tiny_rows["gpu", "ToMe 0.5, attention"]["added"] <= 45
    assert tiny_rows["gpu", "ToMe 0.5, attention + MLP"]["added"] <= 54
    assert tiny_rows["gpu", "ToDo, factor 2"]["added"] <= 3
    for kind in ("gpu", "cpu"):
        for name in ("ToMe 0.5, attention", "ToMe 0.5, attention + MLP", "ToDo, factor 2"):
            assert tiny_rows[kind, name]["added"] > 0 and tiny_rows[kind, name]["merges_per_call"] >= 1
    assert tiny_rows["gpu", "ToDo, factor 2"]["by_name"].get("strided_slice") == 1


@pytest.mark.parametrize("part", ["attention", "attention + MLP"])
def test_with_one_plan_per_call_a_later_sd3_block_adds_at_most_half_what_a_plan_per_block_adds(tiny_rows, part):
    # a block call after the one that planned: only the merge and unmerge of the shared plan (9 operators, 18 with
    # the MLP, on the GPU kernels when this test was written), against 42 and 51 with a plan of its own
    own = tiny_rows["gpu", f"ToMe 0.5, {part}"]
    shared = tiny_rows["gpu", f"ToMe 0.5, {part}, one plan per call"]
    assert 0 < shared["added"] <= own["added"] / 2, (shared["added"], own["added"])
    assert shared["first_block_ops"] > shared["ops"]  # the first block of a call made the plan


def test_ops_per_block_mode_times_nothing_and_writes_json(sd3_forward, tmp_path, monkeypatch):
    monkeypatch.setattr(sd3_forward, "narrow_sd3", lambda layers, width: tiny_sd3_transformer(num_layers=layers))
    monkeypatch.setattr(sd3_forward, "measure", lambda *args: pytest.fail("--ops-per-block must not time"))
    out = tmp_path / "ops.json"
    sd3_forward.main(["--ops-per-block", "--sizes", "64", "--width", "64", "--output", str(out)])
    written = json.loads(out.read_text())
    assert {(row["kernels"], row["configuration"]) for row in written["rows"]} == {
        (kind, name) for kind in ("gpu", "cpu") for name in sd3_forward.OPS_CONFIGS}
    assert all(row["image_tokens"] == 16 for row in written["rows"])


def test_loop_only_times_the_denoising_loop_with_peak_memory_and_no_forward_table(sd3_forward, monkeypatch, tmp_path):
    timed = []
    monkeypatch.setattr(sd3_forward, "measure", lambda *args: pytest.fail("the forward table ran"))
    monkeypatch.setattr(sd3_forward, "LOOP_CONFIGS", {"vanilla": {}, "cache 3": dict(cache=dict(interval=3))})
    real_denoise = sd3_forward.denoise
    monkeypatch.setattr(sd3_forward, "denoise", lambda *args: timed.append(args[1:]) or real_denoise(*args))
    output = tmp_path / "loop.json"
    result = sd3_forward.main(["--sizes", "64", "--layers", "3", "--width", "64", "--loop-steps", "3", "--loop-only",
                               "--seeds", "1", "--output", str(output)])
    assert result["rows"] == [] and [row["configuration"] for row in result["loop"]] == ["vanilla", "cache 3"]
    assert timed == [(64, 3, 0), (64, 3, 0)]
    written = json.loads(output.read_text())["loop"]
    assert written[1]["speedup"] > 0 and written[1]["rel_l2_per_seed"][0] > 0  # the cache moved the latents
    assert written[0]["rel_l2_per_seed"] == [0.0]
    assert all(row["peak_added_mib"] >= 0 and row["peak_kind"] == "cpu_peak_rss" for row in written)
    with pytest.raises(SystemExit):
        sd3_forward.main(["--loop-only"])  # nothing to time


def test_the_loop_times_every_setting_the_sd3_tables_report(sd3_forward):
    loop = sd3_forward.LOOP_CONFIGS
    assert loop["vanilla"] == {}
    for ratio in (0.3, 0.5):
        assert loop[f"ToMe {ratio}, attention"] == {"tome": {"ratio": ratio}}
        assert loop[f"ToMe {ratio}, attention + MLP"] == {"tome": {"ratio": ratio, "merge_mlp": True}}
    assert loop["ToDo, factor 2"] == {"tome": {"method": "todo"}}
    assert loop["cache 3"] == {"cache": {"interval": 3}}
    assert loop["ToMe 0.5, attention, + cache 3"] == {"tome": {"ratio": 0.5}, "cache": {"interval": 3}}


def test_the_forward_table_records_speed_distance_and_peak_memory_per_configuration(sd3_forward, monkeypatch, tmp_path):
    monkeypatch.setattr(sd3_forward, "CONFIGS", {"vanilla": None, "ToDo, factor 2": dict(method="todo")})
    output = tmp_path / "forward.json"
    result = sd3_forward.main(["--sizes", "64", "--layers", "3", "--width", "64", "--rounds", "1", "--seeds", "2",
                               "--output", str(output)])
    rows = {row["configuration"]: row for row in json.loads(output.read_text())["rows"]}
    assert list(rows) == ["vanilla", "ToDo, factor 2"] and result["loop"] == []
    assert rows["vanilla"]["rel_l2"] == 0 and rows["ToDo, factor 2"]["rel_l2"] > 0  # ToDo ran, vanilla is vanilla
    for row in rows.values():
        assert row["speedup"] > 0 and row["peak_added_mib"] >= 0 and row["peak_kind"] == "cpu_peak_rss"
