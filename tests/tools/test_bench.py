"""The benchmark engine (ppdiffusers_tome/bench/) and the ``bench`` command on tiny presets."""

import contextlib
import json
import os

import numpy as np
import paddle
import pytest
from PIL import Image

import ppdiffusers_tome
from ppdiffusers_tome.presets import preset_pipeline
from ppdiffusers_tome.tome.patch import get_patch
from ppdiffusers_tome.tools import bench
from ppdiffusers_tome.tools.bench import runner, timesplit
from ppdiffusers_tome.tools.cli import main
from tests.unet_calls import unet_inputs

QUICK = ["--resolutions", "32", "--steps", "1", "--repeats", "1", "--warmup", "0", "--threads", "1"]
CELL_KEYS = {
    "resolution", "batch", "method", "ratio", "label", "options", "status", "reason", "seconds_per_image", "unet_seconds", "speedup",
    "peak_memory_bytes", "added_memory_bytes", "memory_kind", "psnr_db", "rel_l2", "fraction_of_bound",
    "plans_reused_share", "runs_seconds", "ops", "merging_blocks", "ops_per_block", "attention", "merges",
}


def load(folder):
    with open(folder / "results.json", encoding="utf-8") as f:
        return json.load(f)


def test_bench_fills_every_cell_and_writes_json_and_plots(tmp_path, capsys):
    args = ["bench", "--arch", "tiny", *QUICK, "--batch-sizes", "1", "2", "--ratios", "0.3", "0.5",
            "--compare-builtin", "--output", str(tmp_path)]
    assert main(args) == 0
    out = capsys.readouterr().out
    data = load(tmp_path)
    cells = data["cells"]
    labels = {(c["batch"], c["method"], c["ratio"]) for c in cells}
    expected_methods = [("vanilla", 0.0)] + [(m, r) for m in ("tome", "tome-efficient", "bound", "builtin") for r in (0.3, 0.5)]
    assert labels == {(b, m, r) for b in (1, 2) for m, r in expected_methods}
    for cell in cells:
        assert set(cell) == CELL_KEYS
        if cell["method"] == "tome-efficient":
            assert cell["status"] == "n/a" and "efficient attention" in cell["reason"]  # no such kernel on CPU
            continue
        assert cell["status"] == "ok"
        assert cell["seconds_per_image"] > 0 and cell["unet_seconds"] > 0 and cell["speedup"] > 0
        assert cell["peak_memory_bytes"] > 0 and cell["memory_kind"] == "cpu_peak_rss"
        if cell["method"] == "vanilla":
            assert cell["psnr_db"] == "inf" and cell["rel_l2"] == 0.0
        else:
            assert 0 < cell["rel_l2"] < 1 and 5 < cell["psnr_db"] < 100
        if cell["method"] in ("tome", "builtin"):
            assert cell["fraction_of_bound"] > 0
    env = data["environment"]
    assert env["threads"] == 1 and env["dtype"] == "float32" and env["device"] == "cpu" and env["paddle"]
    assert set(data["time_split"]) == {"vanilla", "tome@0.3", "tome@0.5", "builtin@0.3", "builtin@0.5"}
    split = data["time_split"]
    assert split["vanilla"]["matching"] == 0.0 and split["tome@0.5"]["matching"] > 0 and split["builtin@0.5"]["matching"] > 0
    for part in split.values():
        assert part["attention"] > 0 and part["rest"] > 0
        assert abs(part["attention"] + part["matching"] + part["rest"] - part["total"]) < 1e-6
    for path in data["plots"]:
        with Image.open(path) as png:
            png.verify()
    pareto = sorted(os.path.basename(p) for p in data["plots"] if "pareto" in p)
    assert len(data["plots"]) == 5 and pareto == ["pareto_32_b1.png", "pareto_32_b2.png"]
    table = out.split("seconds per image (speed-up vs vanilla):")[1].split("\n\n")[0]
    assert table.count("32x32") == 2 and "n/a" in table and "tome@0.5" in table and "builtin@0.3" in table
    pareto = out.split("Pareto: no other configuration is both faster and closer):")[1]
    assert "vanilla" in pareto and "yes" in pareto


def test_out_of_memory_is_reported_in_its_cell_and_the_grid_goes_on(tmp_path, monkeypatch, capsys):
    real = bench.Runner._measure_once

    def measure(self, size, batch):
        if size == 64 and get_patch(self.pipe.unet) is None:  # vanilla at 64 px "runs out of memory"
            raise MemoryError("simulated")
        if size == 64 and batch == 2:
            raise RuntimeError("ResourceExhaustedError: Out of memory error on CPU (simulated)")
        return real(self, size, batch)

    monkeypatch.setattr(bench.Runner, "_measure_once", measure)
    args = ["bench", "--arch", "tiny", *QUICK, "--resolutions", "32", "64", "--batch-sizes", "1", "2",
            "--methods", "vanilla", "tome", "--no-time-split", "--output", str(tmp_path)]
    assert main(args) == 0
    cells = {(c["resolution"], c["batch"], c["method"]): c for c in load(tmp_path)["cells"]}
    assert cells[(64, 1, "vanilla")]["status"] == "OOM" and cells[(64, 2, "vanilla")]["status"] == "OOM"
    assert cells[(64, 2, "tome")]["status"] == "OOM"
    assert cells[(64, 1, "tome")]["status"] == "ok" and cells[(64, 1, "tome")]["speedup"] is None
    assert all(c["status"] == "ok" for (size, _, _), c in cells.items() if size == 32)
    assert "OOM" in capsys.readouterr().out


def test_other_errors_are_not_swallowed(monkeypatch, tmp_path):
    def measure(self, size, batch):
        raise ZeroDivisionError("a real bug")

    monkeypatch.setattr(bench.Runner, "_measure_once", measure)
    with pytest.raises(ZeroDivisionError):
        main(["bench", "--arch", "tiny", *QUICK, "--no-time-split", "--no-plots", "--output", str(tmp_path)])


@pytest.mark.parametrize("arch", ["tiny-sdxl", "tiny-controlnet"])
def test_unet_only_mode_on_sdxl_and_controlnet_layouts(arch, tmp_path):
    args = ["bench", "--arch", arch, *QUICK, "--unet-only", "--methods", "vanilla", "tome", "bound",
            "--no-time-split", "--no-plots", "--output", str(tmp_path)]
    assert main(args) == 0
    cells = {c["method"]: c for c in load(tmp_path)["cells"]}
    assert cells["tome"]["status"] == "ok" and cells["tome"]["psnr_db"] is None  # no image in UNet-only mode
    assert 0 < cells["tome"]["rel_l2"] < 1 and 0 < cells["bound"]["rel_l2"]
    assert load(tmp_path)["settings"]["max_downsample"] == "auto"  # SDXL's 2x level is found on its own


def test_bench_rejects_bad_input_clearly(tmp_path, capsys):
    with pytest.raises(SystemExit) as done:  # (the parser refuses it, naming the option)
        main(["bench", "--arch", "tiny", *QUICK, "--ratios", "0.9", "--output", str(tmp_path)])
    assert done.value.code == 2 and "argument --ratios: must be a number in [0, 0.75)" in capsys.readouterr().err
    assert main(["bench", "--arch", "tiny", *QUICK, "--dtype", "float16", "--output", str(tmp_path)]) == 2
    assert "needs a GPU" in capsys.readouterr().err


def test_bound_truncates_without_matching_and_pads_back():
    plan = bench.TruncationPlan(num_tokens=10, batch_size=2, r=4)
    x = paddle.randn([2, 10, 3])
    merged = plan.merge(x)
    np.testing.assert_array_equal(merged.numpy(), x.numpy()[:, :6])
    back = plan.unmerge(merged).numpy()
    np.testing.assert_array_equal(back[:, :6], x.numpy()[:, :6])
    assert (back[:, 6:] == 0).all()


def test_bound_method_merges_in_the_same_blocks_as_tome():
    pipe = preset_pipeline("tiny")
    inputs = unet_inputs(pipe.unet)
    counts = {}
    for method in (bench.Method("tome", 0.5), bench.Method("bound", 0.5)):
        bench.configure(pipe, method, max_downsample=1)
        with paddle.no_grad():
            pipe.unet(*inputs)
        counts[method.name] = (get_patch(pipe.unet).merged_blocks, get_patch(pipe.unet).counters.merges)
        ppdiffusers_tome.remove_tome(pipe)
    assert counts["tome"] == counts["bound"] == (3, 3)
    assert get_patch(pipe.unet) is None


def test_method_list_always_starts_with_vanilla():
    settings = bench.BenchSettings(methods=("tome", "bound"), ratios=(0.3, 0.6))
    assert [m.label for m in bench.method_list(settings)] == ["vanilla", "tome@0.3", "tome@0.6", "bound@0.3", "bound@0.6"]
    with pytest.raises(ValueError, match="--methods must be among"):
        bench.method_list(bench.BenchSettings(methods=("fast",)))


def test_out_of_memory_detection():
    assert bench.is_out_of_memory(MemoryError())
    assert bench.is_out_of_memory(RuntimeError("(ResourceExhausted) Out of memory error on GPU 0"))
    assert not bench.is_out_of_memory(ValueError("shape mismatch"))


def test_bench_on_a_local_sdxl_folder_merges_at_the_2x_level(tmp_path):
    preset_pipeline("tiny-sdxl").save_pretrained(str(tmp_path / "sdxl"))
    args = ["bench", "--model", str(tmp_path / "sdxl"), *QUICK, "--unet-only", "--methods", "vanilla", "tome",
            "--no-time-split", "--no-plots", "--output", str(tmp_path / "out")]
    assert main(args) == 0
    data = load(tmp_path / "out")
    assert data["settings"]["max_downsample"] == "auto"
    assert {c["method"]: c for c in data["cells"]}["tome"]["rel_l2"] > 0  # something was merged


def test_time_split_cleans_up_when_it_fails(monkeypatch):
    pipe = preset_pipeline("tiny")
    before = [(len(m._forward_pre_hooks), len(m._forward_post_hooks)) for m in pipe.unet.sublayers(include_self=True)]

    def explode(*args, **kwargs):
        raise RuntimeError("inputs failed")

    monkeypatch.setattr(timesplit, "DenoiserInputs", explode)  # where time_split looks it up
    settings = bench.BenchSettings(resolutions=[32], ratios=[0.5])
    with pytest.raises(RuntimeError, match="inputs failed"):
        bench.time_split(pipe, settings, 32, 1, bench.Method("tome", 0.5))
    after = [(len(m._forward_pre_hooks), len(m._forward_post_hooks)) for m in pipe.unet.sublayers(include_self=True)]
    assert after == before and get_patch(pipe.unet) is None


def test_variants_expand_over_ratios_validate_and_deduplicate():
    settings = bench.BenchSettings(
        methods=("vanilla", "tome", "todo"), ratios=(0.3, 0.5),
        variants=("tome:recompute_every=5", "tome:ratio=(0.6,0.2)", "todo:downsample_factor=2",
                  "todo:downsample_factor=4,downsample_mode=average"),
    )
    labels = [m.label for m in bench.method_list(settings)]
    assert labels == ["vanilla", "tome@0.3", "tome@0.5", "todo", "tome@0.3[k=5]", "tome@0.5[k=5]",
                      "tome[ratio=0.6-0.2]", "todo[f=2]", "todo[f=4,mode=average]"]
    with pytest.raises(ValueError, match="downsample_factor must be an integer in"):
        bench.parse_variant("todo:downsample_factor=16")
    with pytest.raises(ValueError, match="unknown option 'speed'"):
        bench.parse_variant("tome:speed=2")
    old_default = bench.BenchSettings(methods=("vanilla",), ratios=(0.5,), variants=("tome:max_downsample=1",))
    assert [m.label for m in bench.method_list(old_default)] == ["vanilla", "tome@0.5[level=1]"]
    with pytest.raises(ValueError, match="before ':' must be tome"):
        bench.parse_variant("bound:ratio=0.5")
    with pytest.raises(ValueError, match="act across denoising steps"):
        bench.method_list(bench.BenchSettings(unet_only=True, variants=("tome:recompute_every=2",)))


def test_pareto_front_keeps_only_unbeaten_configurations():
    def cell(label, speedup, psnr, method="tome"):
        return bench.Cell(512, 1, method, 0.5, label=label, speedup=speedup, psnr_db=psnr)

    cells = [cell("vanilla", 1.0, float("inf"), "vanilla"), cell("a", 1.5, 30.0), cell("b", 1.4, 25.0),
             cell("c", 2.0, 20.0), cell("bound", 3.0, 5.0, "bound")]
    assert {c.label for c in bench.pareto_front(cells)} == {"vanilla", "a", "c"}
    table = bench.format_pareto(cells)
    assert "bound" not in table and table.index("| c ") < table.index("| a ")  # fastest first


# honest speed-ups: one run says so, noisy cells warn, a configuration that merges nothing is vanilla -----------------
def synthetic(label, speedup, psnr, rel_l2, runs, method="tome", merges=None, size=512):
    """A measured cell without measuring: ``speedup`` and ``runs`` (seconds of each timed run) as given."""
    return bench.Cell(size, 1, method, 0.5, label=label, speedup=speedup, psnr_db=psnr, rel_l2=rel_l2,
                      seconds_per_image=sorted(runs)[len(runs) // 2], runs_seconds=list(runs), merges=merges)


def sdxl_like_cells(runs=3):
    """An SDXL bench: ``tome@0.5[level=1]`` merged nothing (SDXL has no transformer block at the
    first level) yet timed 1.33x faster than vanilla on a busy machine."""
    return [
        synthetic("vanilla", 1.0, float("inf"), 0.0, [4.0] * runs, method="vanilla"),
        synthetic("tome@0.5[level=1]", 1.33, float("inf"), 0.0, [3.0] * runs, merges=0),
        synthetic("tome@0.5", 1.2, 28.0, 0.05, [3.3] * runs, merges=140),
        synthetic("builtin@0.5", 1.25, float("inf"), 0.0, [3.2] * runs, method="builtin"),  # not counted: same output
        synthetic("bound@0.5", 2.0, 5.0, 0.5, [2.0] * runs, method="bound", merges=140),
    ]


def test_a_configuration_that_merges_nothing_is_reported_as_vanillas_twin():
    cells = sdxl_like_cells()
    assert [c.label for c in cells if bench.merges_nothing(c)] == ["tome@0.5[level=1]", "builtin@0.5"]
    front = {c.label for c in bench.pareto_front(cells)}
    assert front == {"vanilla", "tome@0.5"}  # vanilla stays on the front; its twins take no place of their own
    pareto = bench.format_pareto(cells)
    assert "1.33x" not in pareto and "1.25x" not in pareto
    twin_row = next(line for line in pareto.splitlines() if "tome@0.5[level=1]" in line)
    assert twin_row.count("= vanilla") == 2 and "yes" not in twin_row  # speed-up and Pareto column
    lines = [line for line in pareto.splitlines() if "512x512" in line]
    assert "tome@0.5 " in lines[0] and "vanilla" in lines[1]  # ranked with vanilla, after the real speed-up
    for table in (bench.format_grid_table(cells, [bench.Method("vanilla"), bench.Method("tome", 0.5),
                                                  bench.Method("tome", 0.5, {"max_downsample": 1})]),
                  bench.format_details(cells)):
        assert "1.33" not in table and "+33" not in table and "= vanilla" in table
    assert bench.effective_speedup(cells[1]) == 1.0 and bench.effective_speedup(cells[2]) == 1.2


def test_merging_something_is_never_vanillas_twin():
    counted = synthetic("tome@0.5", 1.2, float("inf"), 0.0, [3.0], merges=3)  # merged, rounding to the same image
    uncounted = synthetic("builtin@0.5", 1.2, 40.0, 1e-4, [3.0], method="builtin")
    vanilla = synthetic("vanilla", 1.0, float("inf"), 0.0, [3.0], method="vanilla")
    assert not any(bench.merges_nothing(c) for c in (counted, uncounted, vanilla))


def test_pareto_plot_names_a_twin_beside_vanilla(tmp_path):
    paths = bench.write_pareto_plot(sdxl_like_cells(), str(tmp_path))
    assert len(paths) == 1
    with Image.open(paths[0]) as png:
        png.verify()


def test_a_single_run_speedup_says_it_is_one_run():
    cells = sdxl_like_cells(runs=1)
    pareto = bench.format_pareto(cells)
    assert "1.20x (1 run)" in pareto and "1.00x (1 run)" not in pareto  # vanilla's 1.00x is no measurement
    grid = bench.format_grid_table(cells, [bench.Method("vanilla"), bench.Method("tome", 0.5)])
    assert "(+20.0%, 1 run)" in grid
    assert "1.20x (1 run)" in bench.format_details(cells)
    note = bench.single_run_note(cells)
    assert note and "--repeats 3" in note
    steady = sdxl_like_cells(runs=3)
    assert "1 run" not in bench.format_pareto(steady) and bench.single_run_note(steady) is None


def test_bench_warns_on_noisy_cells_like_the_demo():
    cells = sdxl_like_cells()
    assert bench.noise_warnings(cells) == []
    cells[0].runs_seconds = [3.0, 4.0, 6.0]  # vanilla timed on a busy machine
    cells[2].runs_seconds = [3.2, 3.3, 3.4]
    other = synthetic("vanilla", 1.0, float("inf"), 0.0, [4.0, 4.1, 4.0], method="vanilla", size=768)
    warnings = bench.noise_warnings(cells + [other])
    assert len(warnings) == 1 and warnings[0].startswith("WARNING: 512x512 batch 1:")
    text = warnings[0]
    assert "vanilla 3.00-6.00 s" in text and "tome@0.5 lies between 0.88x and 1.88x" in text
    assert "not meaningful" in text and "more --repeats" in text
    assert "[level=1] lies" not in text and "bound@0.5 lies" not in text  # no speed-up range for twins or bound


def test_bench_prints_twins_notes_and_warnings(tmp_path, capsys, monkeypatch):
    """End to end on the tiny preset: a ratio too small to merge one token (``tome@0.001``) is vanilla's twin in
    the tables and results.json, and ``--repeats 1`` is said to be one run."""
    args = ["bench", "--arch", "tiny", *QUICK, "--methods", "vanilla", "tome", "--ratios", "0.001", "0.5",
            "--no-time-split", "--no-plots", "--no-op-count", "--output", str(tmp_path)]
    assert main(args) == 0
    out = capsys.readouterr().out
    data = load(tmp_path)
    cells = {c["label"]: c for c in data["cells"]}
    assert cells["tome@0.001"]["merges"] == 0 and cells["tome@0.5"]["merges"] > 0
    assert cells["vanilla"]["merges"] is None
    assert data["vanilla_twins"] == ["tome@0.001 32x32 batch 1"]
    assert "ONE timed run per configuration" in out and "(1 run)" in out and "NOTE: one timed run" in out
    assert "= vanilla: the configuration merged nothing" in out
    twin_row = next(line for line in out.split("Pareto: no other")[1].splitlines() if "tome@0.001" in line)
    assert "= vanilla" in twin_row and "x (1 run)" not in twin_row
    assert any("one timed run" in w for w in data["warnings"])


def test_bench_measures_cache_reuse_in_pipeline_mode(tmp_path):
    args = ["bench", "--arch", "tiny", "--resolutions", "32", "--steps", "4", "--repeats", "1", "--warmup", "0",
            "--threads", "1", "--methods", "vanilla", "tome", "todo", "--variants", "tome:recompute_every=4",
            "--no-time-split", "--no-plots", "--output", str(tmp_path)]
    assert main(args) == 0
    cells = {c["label"]: c for c in load(tmp_path)["cells"]}
    assert cells["tome@0.5[k=4]"]["plans_reused_share"] == pytest.approx(0.75)  # steps 1-3 reuse step 0's plans
    assert cells["tome@0.5"]["plans_reused_share"] == 0.0 and cells["todo"]["plans_reused_share"] is None
    assert cells["tome@0.5[k=4]"]["options"] == {"recompute_every": 4} and 5 < cells["todo"]["psnr_db"] < 100


def test_results_json_round_trips_to_cells_and_draws_a_pareto_plot(tmp_path):
    args = ["bench", "--arch", "tiny", "--resolutions", "32", "--steps", "2", "--repeats", "1", "--warmup", "0",
            "--threads", "1", "--methods", "vanilla", "tome", "todo", "--no-time-split", "--output", str(tmp_path)]
    assert main(args) == 0
    data = load(tmp_path)
    cells = bench.load_cells(data)
    assert [c.label for c in cells] == ["vanilla", "tome@0.5", "todo"] and cells[0].psnr_db == float("inf")
    assert str(tmp_path / "pareto_32_b1.png") in data["plots"]
    (tmp_path / "again").mkdir()
    paths = bench.write_pareto_plot(cells, str(tmp_path / "again"))
    assert len(paths) == 1
    with Image.open(paths[0]) as png:
        png.verify()


# the GPU path and the ops/block column -------------------------------------------------------------------------------
def test_device_gpu_refuses_a_cpu_only_build_at_once(tmp_path, monkeypatch, capsys):
    assert not paddle.is_compiled_with_cuda()  # this suite runs on the CPU build

    def never(*args, **kwargs):
        raise AssertionError("a pipeline was built before the device was checked")

    monkeypatch.setattr("ppdiffusers_tome.tools.presets.preset_pipeline", never)
    args = ["bench", "--device", "gpu", "--dtype", "float16", "--arch", "tiny", *QUICK, "--output", str(tmp_path)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "--device gpu needs a CUDA build of PaddlePaddle" in err and "paddlepaddle-gpu" in err
    assert "is_compiled_with_cuda() is False" in err and not (tmp_path / "results.json").exists()


def test_device_gpu_refuses_a_cuda_build_without_a_gpu(monkeypatch):
    monkeypatch.setattr(paddle, "is_compiled_with_cuda", lambda: True)
    monkeypatch.setattr(paddle.device.cuda, "device_count", lambda: 0)
    with pytest.raises(bench.DeviceUnavailable, match=r"sees no GPU \(paddle.device.cuda.device_count\(\) is 0\)"):
        bench.select_device("gpu")
    with pytest.raises(ValueError, match="--device must be one of cpu, gpu; got 'tpu'"):
        bench.select_device("tpu")
    assert isinstance(bench.select_device("cpu"), bench.CpuDevice) and paddle.get_device() == "cpu"


class FakeCuda:
    """Stand-ins for the CUDA functions that record when they are called among the UNet's forwards."""

    def __init__(self):
        self.log = []
        self.peaks = iter(range(1000, 10**6, 1000))  # each window reports a new peak: 1000, 2000, ...
        self.reported = []

    def device(self):
        return bench.CudaDevice(synchronize=lambda: self.log.append("sync"), reset_peak=lambda: self.log.append("reset"),
                                max_memory=self.max_memory, allocated=lambda: 100)

    def max_memory(self):
        self.reported.append(next(self.peaks))
        self.log.append("max")
        return self.reported[-1]


def test_gpu_branch_synchronises_every_timed_run_and_reads_the_allocator(monkeypatch):
    fake = FakeCuda()
    pipe = preset_pipeline("tiny")
    pipe.unet.register_forward_pre_hook(lambda layer, args: fake.log.append("forward"))
    pipe.unet.register_forward_post_hook(lambda layer, args, out: fake.log.append("done"))
    real_clock = runner.time.perf_counter
    monkeypatch.setattr(runner.time, "perf_counter", lambda: fake.log.append("clock") or real_clock())
    settings = bench.BenchSettings(resolutions=[32], methods=("vanilla", "tome"), repeats=2, warmup=1, unet_only=True,
                                   count_ops=False)
    cells = {c.label: c for c in bench.run_grid(pipe, settings, device=fake.device())}
    windows = [w.split() for w in " ".join(fake.log).split("max")[:-1]]
    assert len(windows) == 6  # 2 methods x (1 warm-up + 2 timed runs), each one memory window
    for window in windows:
        assert window[:2] == ["sync", "reset"] and window.count("forward") == window.count("done") == 1
        clocks = [i for i, token in enumerate(window) if token == "clock"]
        assert all(window[i - 1] == "sync" for i in clocks)  # every clock read waits for the device first
        assert clocks[0] < window.index("forward") and clocks[-1] > window.index("done")
        assert window[-1] == "sync"  # and the peak is read after a last synchronize
    for label, cell in cells.items():
        assert cell.status == "ok" and cell.memory_kind == "gpu_max_allocated"
        assert cell.peak_memory_bytes in fake.reported and cell.added_memory_bytes == cell.peak_memory_bytes - 100
    # the larger of a method's two timed peaks is kept: windows 2-3 are vanilla's and tome's 1st, 5-6 their 2nd
    assert cells["vanilla"].peak_memory_bytes == 5000 and cells["tome@0.5"].peak_memory_bytes == 6000


def test_ops_per_block_column_on_a_tiny_preset(tmp_path, capsys):
    from ppdiffusers_tome.tools.measure import count_ops

    args = ["bench", "--arch", "tiny", *QUICK, "--unet-only", "--methods", "vanilla", "tome", "todo", "--compare-builtin",
            "--no-time-split", "--no-plots", "--output", str(tmp_path)]
    assert main(args) == 0
    out = capsys.readouterr().out
    cells = {c["method"]: c for c in load(tmp_path)["cells"]}
    # an independent count of a vanilla forward with the bench's own inputs
    pipe = preset_pipeline("tiny")
    inputs = bench.DenoiserInputs(pipe, 32, 1, 0)
    with paddle.no_grad():
        inputs.run()
        direct = count_ops(inputs.run).total
    assert cells["vanilla"]["ops"] == direct and cells["vanilla"]["ops_per_block"] is None
    assert cells["vanilla"]["merging_blocks"] == 0
    for name in ("tome", "todo", "builtin"):
        cell = cells[name]
        assert cell["merging_blocks"] == 3, name  # the tiny UNet's three blocks at the 1x level
        assert cell["ops"] > direct
        assert cell["ops_per_block"] == pytest.approx((cell["ops"] - direct) / 3)
    assert cells["tome"]["attention"] == "AttnProcessor"  # no efficient attention kernel on the CPU build
    details = out.split("\n\n")[1]
    assert details.splitlines()[0].rstrip().endswith("ops/block")
    tome_row = next(line for line in details.splitlines() if "| tome@0.5 " in line)
    assert tome_row.rstrip().endswith(f"{cells['tome']['ops_per_block']:.1f}")
    assert main(args[:-2] + ["--no-op-count", "--output", str(tmp_path / "none")]) == 0
    assert all(c["ops"] is None and c["ops_per_block"] is None for c in load(tmp_path / "none")["cells"])


def test_runner_wraps_every_run_and_keeps_what_the_demo_needs():
    """The demo runs on the Runner: ``around_run`` is entered around every run (its step bar), and
    ``Runner.outputs`` keeps each method's decoded images and forward times."""
    pipe = preset_pipeline("tiny")
    settings = bench.BenchSettings(resolutions=[32], steps=1, repeats=2, warmup=1, count_ops=False)
    entered = []

    @contextlib.contextmanager
    def around(method, repeat):
        entered.append((method.label, repeat))
        yield

    runner = bench.Runner(pipe, settings, around_run=around)
    methods = bench.method_list(settings)
    cells = {c.label: c for c in runner.run_cell(32, 1, methods)}
    assert entered == [(m.label, r) for r in range(3) for m in methods]  # warm-up, then two timed runs, interleaved
    vanilla, tome = runner.outputs["vanilla"], runner.outputs["tome@0.5"]
    assert tome.images.shape == (1, 32, 32, 3) and len(tome.forward_seconds) == 2  # timed runs only
    mse = np.mean((vanilla.images - tome.images) ** 2)  # PSNR of the kept images, computed here in float64
    assert mse > 0 and cells["tome@0.5"].psnr_db == pytest.approx(10 * np.log10(1.0 / mse))
    assert cells["tome@0.5"].unet_seconds == pytest.approx(np.median([np.median(r) for r in tome.forward_seconds]))


def test_demo_says_a_single_run_is_one_run(tmp_path, capsys):
    args = ["demo", "--preset", "tiny", "--resolution", "32", "--steps", "1", "--threads", "1", "--ratios", "0.5",
            "--repeats", "1", "--output", str(tmp_path)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "ONE timed run per configuration" in out and "median of" not in out
    tome_row = next(line for line in out.splitlines() if line.startswith("tome "))
    assert "x (1 run)" in tome_row
    assert "NOTE: one timed run per method (--repeats 1)" in out
    assert any("one timed run" in w for w in load(tmp_path)["warnings"])


def test_demo_table_shows_a_ratio_that_merges_nothing_as_vanilla():
    from ppdiffusers_tome.tools.bench.demo import format_demo_table, noise_warning

    base = {"ratio": 0.0, "seconds_per_image": 4.0, "unet_seconds": 0.1, "peak_memory_bytes": 2**20,
            "added_memory_bytes": 2**20, "max_abs_diff": 0.0, "psnr_db": float("inf")}
    rows = [{**base, "method": "vanilla", "speedup": 1.0, "runs_seconds": [4.0, 6.0, 4.1], "merges_nothing": False},
            {**base, "method": "tome", "ratio": 0.001, "speedup": 1.33, "runs_seconds": [3.0, 3.1, 3.0],
             "merges_nothing": True}]
    table = format_demo_table(rows)
    assert "1.33x" not in table and "= vanilla" in table
    text = noise_warning(rows)
    assert "vanilla 4.00-6.00 s" in text and "lies between" not in text  # no speed-up range for vanilla's twin
