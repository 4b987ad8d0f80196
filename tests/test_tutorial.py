"""The Chinese notebook tutorial (docs/tutorial_cn.ipynb) runs end to end, offline, and says what it claims.

The notebook is executed here without Jupyter: its code cells run in order in one namespace, as a kernel would run
them (the value of a cell's last expression is kept, as Jupyter would display it; printed text is captured). Every
code cell ends with assertions of its own; this test checks the outputs and the variables the cells leave behind.
"""

import ast
import contextlib
import io
import json
import os
import re
import time

import numpy as np
import pytest
from PIL import Image

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "docs", "tutorial_cn.ipynb")


def load_notebook():
    with open(NOTEBOOK, encoding="utf-8") as f:
        return json.load(f)


def source(cell):
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def run_cell(code, namespace, name):
    """Run one code cell like a kernel: every statement, then the last one's value if it is an expression."""
    tree = ast.parse(code, filename=name)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(tree, name, "exec"), namespace)
        value = eval(compile(ast.Expression(last.value), name, "eval"), namespace) if last is not None else None
    return printed.getvalue(), value


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """The notebook run once from its first cell to its last: (namespace, [(stdout, value) per code cell], s)."""
    cwd = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("tutorial"))  # whatever it writes lands in a temporary folder
    try:
        namespace = {"__name__": "__main__"}
        outputs = []
        start = time.perf_counter()
        cells = [c for c in load_notebook()["cells"] if c["cell_type"] == "code"]
        for index, cell in enumerate(cells):
            outputs.append(run_cell(source(cell), namespace, f"tutorial_cn.ipynb code cell {index + 1}"))
        return namespace, outputs, time.perf_counter() - start
    finally:
        os.chdir(cwd)


def test_notebook_is_committed_without_outputs_and_is_valid_nbformat_4():
    notebook = load_notebook()
    assert notebook["nbformat"] == 4 and notebook["metadata"]["kernelspec"]["language"] == "python"
    code = [c for c in notebook["cells"] if c["cell_type"] == "code"]
    assert len(code) >= 8
    for cell in code:
        assert cell["outputs"] == [] and cell["execution_count"] is None  # no stored outputs, no images
        assert not re.search(r"^\s*[!%]", source(cell), re.M)  # plain Python: no shell escapes or magics


def test_notebook_is_a_chinese_tutorial_covering_the_brief():
    text = "\n".join(source(c) for c in load_notebook()["cells"] if c["cell_type"] == "markdown")
    assert len(re.findall(r"[\u4e00-\u9fff]", text)) > 1500  # written in Chinese, at length
    code = "\n".join(source(c) for c in load_notebook()["cells"] if c["cell_type"] == "code")
    for topic in ("pip install", "apply_tome", "tome_status", "ControlNet", "ratio", "ToDo", "demo", "remove_tome"):
        assert topic in text, topic
    for call in ('preset_pipeline("tiny")', 'preset_pipeline("tiny-controlnet")', 'method="todo"',
                 "tome_status(", "remove_tome()", '"demo"'):
        assert call in code, call


def test_notebook_runs_end_to_end_with_tome_on_close_to_vanilla_and_removable(executed):
    ns, outputs, seconds = executed
    vanilla, with_tome = ns["vanilla"], ns["with_tome"]
    assert vanilla.shape == (64, 64, 3) and vanilla.std() > 0.05  # a real (noise) image, not a blank one
    assert ns["status"]["unet"]["active"] == "ppdiffusers_tome" and ns["status"]["unet"]["blocks"] > 0
    assert not np.array_equal(with_tome, vanilla)
    assert 20 < ns["psnr_tome"] < float("inf") and np.abs(with_tome - vanilla).max() < 0.5
    assert np.array_equal(ns["restored"], vanilla)  # remove_tome restores vanilla bit for bit
    assert ns["stats"]["merges"] > 0
    printed = "".join(out for out, _ in outputs)
    assert "'active': 'ppdiffusers_tome'" in printed and "与原图逐位相同： True" in printed
    row = next(value for _, value in outputs if isinstance(value, Image.Image))  # the cell that shows the images
    assert row.width >= 3 * 128
    assert seconds < 300, f"the notebook took {seconds:.0f} s; it should run in a few minutes at most"


def test_notebook_controlnet_ratio_todo_and_demo_sections(executed):
    ns, outputs, _ = executed
    assert {name: item["active"] for name, item in ns["cn_status"].items()} == {
        "unet": "ppdiffusers_tome", "controlnet": "ppdiffusers_tome"}
    assert np.array_equal(ns["cn_restored"], ns["cn_vanilla"]) and not np.array_equal(ns["cn_tome"], ns["cn_vanilla"])
    fidelity = ns["fidelity"]
    assert sorted(fidelity) == [0.3, 0.5, 0.7] and fidelity[0.3] > fidelity[0.7] > 20
    assert ns["rejected"] is True
    assert ns["todo_status"]["settings"]["method"] == "todo" and 20 < ns["psnr_todo"] < float("inf")
    record = ns["demo_record"]
    assert [(row["method"], row["cache"]) for row in record["results"]] == [
        ("vanilla", None), ("tome", None), ("tome", None), ("tome", 3)]  # ToMe 0.3, 0.5, 0.5 + step cache
    assert os.path.isfile(os.path.join(ns["demo_dir"], "demo.png"))
    printed = "".join(out for out, _ in outputs)
    # the demo's table, and the cell that reads its results.json
    assert "speed-up" in printed and "PSNR dB" in printed and "每次计时" in printed


def test_notebook_shapes_section_draws_captions_the_classifier_reads_back(executed):
    from tests.test_shapes_shipped import BACKGROUND_THRESHOLD

    ns, outputs, _ = executed
    assert ns["vanilla_shapes"].shape == (4, 64, 64, 3) and ns["tome_shapes"].shape == (4, 64, 64, 3)
    assert not np.array_equal(ns["vanilla_shapes"], ns["tome_shapes"])  # ToMe really ran
    for scores in (ns["vanilla_scores"], ns["tome_scores"]):
        assert scores["background"] >= BACKGROUND_THRESHOLD, scores  # 4 images: the head the model has learnt
    sheet = [value for _, value in outputs if isinstance(value, Image.Image)][-1]
    assert sheet.size == (512, 256)
    printed = "".join(out for out, _ in outputs)
    assert "ToMe 0.5：" in printed and ns["prompts"][0] in printed


def test_readmes_point_to_the_notebook():
    with open(os.path.join(ROOT, "README_cn.md"), encoding="utf-8") as f:
        assert "docs/tutorial_cn.ipynb" in f.read()
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    examples = readme.split("## Examples", 1)[1].split("\n## ", 1)[0]
    assert "docs/tutorial_cn.ipynb" in examples and readme.count("](docs/tutorial_cn.ipynb)") == 1  # one link
