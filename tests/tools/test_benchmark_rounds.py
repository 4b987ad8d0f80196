"""benchmarks/rounds.py: several rounds of one bench command combined, each method's speed-ups and their range."""

import json
import subprocess
import sys

from tests.benchmark_scripts import BENCHMARKS


def write_round(folder, speedups):
    folder.mkdir()
    cells = [{"label": label, "speedup": speedup, "seconds_per_image": 10.0 / speedup, "rel_l2": 0.05 * index,
              "ops_per_block": 60 + index} for index, (label, speedup) in enumerate(speedups.items())]
    (folder / "results.json").write_text(json.dumps({"command": "bench ...", "environment": {"paddle": "3.3.1"},
                                                      "settings": {"steps": 20}, "cells": cells}))


def test_the_rounds_are_combined_with_each_methods_range(tmp_path):
    write_round(tmp_path / "r1", {"vanilla": 1.0, "tome@0.5": 1.88, "builtin@0.5": 1.84})
    write_round(tmp_path / "r2", {"vanilla": 1.0, "tome@0.5": 1.66, "builtin@0.5": 1.52})
    out = tmp_path / "combined.json"
    done = subprocess.run([sys.executable, f"{BENCHMARKS}/rounds.py", str(tmp_path / "r1"), str(tmp_path / "r2"),
                           "--output", str(out)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    summary = json.loads(out.read_text())["summary"]
    assert summary["tome@0.5"]["speedups"] == [1.88, 1.66]
    assert (summary["builtin@0.5"]["min"], summary["builtin@0.5"]["max"]) == (1.52, 1.84)
    assert "1.66-1.88x" in done.stdout and "1.52-1.84x" in done.stdout
