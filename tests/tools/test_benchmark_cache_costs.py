"""The pure parts of ``benchmarks/cache_costs.py``: FLOPs at a larger size from two counts, and the cost of a run of
steps with and without a cache."""

import pytest

from tests.benchmark_scripts import load_benchmark


def test_flops_at_a_larger_side_follow_exactly_from_a_constant_a_quadratic_and_a_quartic_term():
    costs = load_benchmark("cache_costs")
    counted = {side: 5e9 + 3.0 * side**2 + 0.5 * side**4 for side in (8, 16, 32)}
    assert costs.extrapolate(counted, 128) == pytest.approx(5e9 + 3.0 * 128**2 + 0.5 * 128**4, rel=1e-9)
    flat = {side: 2e6 + 7.0 * side**2 for side in (8, 16, 32)}
    assert costs.extrapolate(flat, 64) == pytest.approx(2e6 + 7.0 * 64**2, rel=1e-9)
    with pytest.raises(ValueError, match="three sizes"):
        costs.extrapolate({16: 1.0, 32: 2.0}, 64)


def test_steps_cost_one_full_call_and_the_rest_cached_only_with_a_cache():
    costs = load_benchmark("cache_costs")
    assert costs.per_steps(10, 10, None, 3) == 30 and costs.per_steps(10, 2, 3, 3) == 14


def test_inputs_carry_sdxls_added_conditioning_and_a_branch_the_layout_lacks_is_skipped(tmp_path, capsys):
    import json

    from ppdiffusers_tome.tools.tiny import tiny_sdxl_unet, tiny_unet

    costs = load_benchmark("cache_costs")
    args, kwargs = costs.inputs_at(tiny_unet(), 64)
    assert kwargs == {} and [list(a.shape) for a in args][0] == [2, 4, 8, 8]
    sdxl = tiny_sdxl_unet()
    args, kwargs = costs.inputs_at(sdxl, 64)
    assert set(kwargs["added_cond_kwargs"]) == {"text_embeds", "time_ids"}
    assert list(sdxl(*args, **kwargs).sample.shape) == [2, 4, 8, 8]  # the call SDXL's UNet needs
    output = tmp_path / "costs.json"
    costs.main(["--preset", "tiny-sdxl", "--resolutions", "64", "96", "128", "--extrapolate", "256",
                "--output", str(output)])
    data = json.loads(output.read_text())
    # the tiny layout has one layer per down block: DeepCache's branch 1 (layers=2) does not exist there
    assert "cache 3, layers 2" in data["skipped"] and "layers must be in [1, 1]" in data["skipped"]["cache 3, layers 2"]
    rows = {row["config"]: row for row in data["rows"]}
    whole = rows["cache 3, whole level"]
    assert rows["cache 3, layers 1"]["ops_cached"] < whole["ops_cached"] < rows["vanilla"]["ops_full"]
    assert rows["cache 3, layers 1"]["sizes"]["256"]["flop_speedup"] > whole["sizes"]["256"]["flop_speedup"]
