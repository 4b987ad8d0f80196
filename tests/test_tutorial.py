"""The Chinese notebook tutorial (docs/tutorial_cn.ipynb) runs end to end, offline, where a reader runs it, and says
what it claims.

A reader opens the notebook in Jupyter, whose kernel starts in ``docs/`` with that folder (not the repository root)
on ``sys.path``, and may have installed the package from a wheel, without ``research/``, ``benchmarks/`` and the
rest of the clone. So the notebook runs here in a separate interpreter started the same way: working directory
``docs/``, ``python -I`` (no ``PYTHONPATH``, no script folder, no user site; the repository's editable install maps
the package name only, as a wheel does), ``""`` put first on ``sys.path`` as Jupyter's kernel does, and every import
of the repository's other top-level folders refused, so a cell that needs the clone fails here even where an
install does expose it. The kernel's behaviour is imitated without Jupyter: the code cells run in order in one
namespace, the value of a cell's last expression is kept (as Jupyter would display it) and printed text is
captured. Every code cell ends with assertions of its own; the tests check the outputs and the variables the cells
leave behind.
"""

import json
import os
import pickle
import re
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
NOTEBOOK = os.path.join(DOCS, "tutorial_cn.ipynb")
# the repository's top-level folders that are not the package: neither a wheel nor `pip install -e .` provides them
REPOSITORY_ONLY = ("research", "benchmarks", "tests", "examples")


def load_notebook():
    with open(NOTEBOOK, encoding="utf-8") as f:
        return json.load(f)


def source(cell):
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


# The kernel: run in a fresh interpreter (`python -I -c KERNEL notebook result repository_only...`) in docs/.
# It imports nothing of Paddle's before the first cell, so Paddle's import-time warnings show as a reader sees them.
KERNEL = r"""
import ast, contextlib, importlib.abc, io, json, os, pickle, sys, time

notebook, result, blocked = sys.argv[1], sys.argv[2], set(sys.argv[3:])


class RepositoryOnly(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {name!r} (a folder of the repository, not of the package: "
                                      "a reader's kernel cannot import it)", name=name)
        return None


sys.meta_path.insert(0, RepositoryOnly())
sys.path.insert(0, "")  # what Jupyter's kernel puts first: its working directory, the notebook's folder
path_before = list(sys.path)


def run_cell(code, namespace, name):
    tree = ast.parse(code, filename=name)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(tree, name, "exec"), namespace)
        value = eval(compile(ast.Expression(last.value), name, "eval"), namespace) if last is not None else None
    return printed.getvalue(), value


def picklable(value):
    try:
        pickle.dumps(value)
        return True
    except Exception:
        return False


with open(notebook, encoding="utf-8") as f:
    cells = [cell for cell in json.load(f)["cells"] if cell["cell_type"] == "code"]
namespace = {"__name__": "__main__"}
outputs = []
start = time.perf_counter()
for index, cell in enumerate(cells):
    code = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
    printed, value = run_cell(code, namespace, f"tutorial_cn.ipynb code cell {index + 1}")
    outputs.append((printed, value if picklable(value) else repr(value)))
seconds = time.perf_counter() - start
kept = {name: value for name, value in namespace.items()
        if not name.startswith("_") and not callable(value) and type(value).__module__.split(".")[0]
        in ("builtins", "numpy", "PIL") and picklable(value)}
modules = {name: getattr(module, "__file__", None) for name, module in list(sys.modules.items())}
with open(result, "wb") as f:
    pickle.dump({"namespace": kept, "outputs": outputs, "seconds": seconds, "cwd": os.getcwd(),
                 "path": path_before, "modules": modules}, f)
"""


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """The notebook run once from its first cell to its last, in docs/, by a kernel that sees only the installed
    package: a dict with the kept variables (``namespace``), ``[(stdout, value)]`` per code cell (``outputs``),
    ``seconds``, the kernel's ``cwd``, ``path`` and ``modules`` (name: file), and its ``stderr``."""
    work = tmp_path_factory.mktemp("tutorial")
    result = work / "result.pickle"
    before = sorted(os.listdir(DOCS))
    env = dict(os.environ, TMPDIR=str(work))  # the demo's temporary folder lands here (-I ignores PYTHON* only)
    done = subprocess.run([sys.executable, "-I", "-c", KERNEL, NOTEBOOK, str(result), *REPOSITORY_ONLY],
                          cwd=DOCS, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"the notebook failed in docs/:\n{done.stderr[-4000:]}"
    with open(result, "rb") as f:
        record = pickle.load(f)
    record.update(stderr=done.stderr, docs_after=sorted(os.listdir(DOCS)), docs_before=before)
    return record


def test_notebook_runs_where_a_reader_runs_it_without_the_repository(executed):
    """Kernel in docs/, the repository root not on sys.path, nothing imported from the clone but the package, and
    nothing written into docs/."""
    assert os.path.realpath(executed["cwd"]) == os.path.realpath(DOCS)
    assert not any(entry and os.path.realpath(entry) == os.path.realpath(ROOT) for entry in executed["path"])
    from_clone = {name: file for name, file in executed["modules"].items()
                  if file and os.path.realpath(file).startswith(os.path.realpath(ROOT) + os.sep)
                  and not os.path.realpath(file).startswith(os.path.join(os.path.realpath(ROOT), ".venv") + os.sep)}
    # an editable install loads the package from the clone, a wheel from site-packages; nothing else may come from it
    assert all(name.split(".")[0] == "ppdiffusers_tome" for name in from_clone), sorted(from_clone)
    assert "ppdiffusers_tome.tools.shapes" in executed["modules"]
    assert not any(name.split(".")[0] in REPOSITORY_ONLY for name in executed["modules"])
    assert executed["docs_after"] == executed["docs_before"]


def test_the_kernel_refuses_the_repositorys_other_folders(tmp_path):
    """The guard of the kernel above can fail: `import research` there raises, even though research/ exists."""
    assert os.path.isdir(os.path.join(ROOT, "research"))
    notebook = tmp_path / "probe.ipynb"
    notebook.write_text(json.dumps({"cells": [{"cell_type": "code", "source": ["import research"]}]}))
    done = subprocess.run([sys.executable, "-I", "-c", KERNEL, str(notebook), str(tmp_path / "r"), *REPOSITORY_ONLY],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)  # even from the repository root
    assert done.returncode != 0 and "No module named 'research'" in done.stderr, done.stderr[-2000:]


def test_the_package_is_imported_before_paddle_so_paddle_stays_quiet(executed):
    """Paddle warns "No ccache found" when it is imported first; the package, imported first, keeps that quiet."""
    first = source(next(c for c in load_notebook()["cells"] if c["cell_type"] == "code"))
    imports = [m for m in re.findall(r"^(?:import|from) (\w+)", first, re.M) if m in ("paddle", "ppdiffusers",
                                                                                      "ppdiffusers_tome")]
    assert imports[0] == "ppdiffusers_tome", imports
    assert "No ccache found" not in executed["stderr"]


def test_notebook_is_committed_without_outputs_and_is_valid_nbformat_4():
    notebook = load_notebook()
    assert notebook["nbformat"] == 4 and notebook["metadata"]["kernelspec"]["language"] == "python"
    code = [c for c in notebook["cells"] if c["cell_type"] == "code"]
    assert len(code) >= 8
    for cell in code:
        assert cell["outputs"] == [] and cell["execution_count"] is None  # no stored outputs, no images
        assert not re.search(r"^\s*[!%]", source(cell), re.M)  # plain Python: no shell escapes or magics


def test_every_cell_has_its_own_id_as_nbformat_4_5_asks():
    """nbconvert warned that cells had no ids (an nbformat 4.5 notebook without them, five cells added later)."""
    notebook = load_notebook()
    assert (notebook["nbformat"], notebook["nbformat_minor"]) >= (4, 5)
    ids = [cell.get("id") for cell in notebook["cells"]]
    assert all(isinstance(id_, str) and re.fullmatch(r"[a-zA-Z0-9_-]{1,64}", id_) for id_ in ids), ids
    assert len(set(ids)) == len(ids), ids


def test_the_jupyter_install_line_brings_ipywidgets_and_keeps_the_pins():
    """Without ipywidgets, tqdm (ppdiffusers' progress bars) prints "IProgress not found" under the first code cell in
    Jupyter; the install line adds it, with constraints.txt so that the pinned set stays as it is."""
    text = "\n".join(source(c) for c in load_notebook()["cells"] if c["cell_type"] == "markdown")
    line = next(line for line in text.splitlines() if "-m pip install notebook" in line)
    assert "ipywidgets" in line.split() and "-c constraints.txt" in line, line
    assert "IProgress not found" in text  # and the notebook says what the line means


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
    ns, outputs, seconds = executed["namespace"], executed["outputs"], executed["seconds"]
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
    ns, outputs = executed["namespace"], executed["outputs"]
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
    # the demo's table, and the cell that reads its results.json, naming the cached row as such
    assert "speed-up" in printed and "PSNR dB" in printed and "每次计时" in printed
    assert "tome + cache 3" in printed and "ToMe 0.5 + cache 3 " in printed
    assert len(re.findall(r"^ToMe 0\.5 +speed-up", printed, re.M)) == 1  # one plain ToMe 0.5 line, not two


def test_notebook_shapes_section_draws_backgrounds_it_reads_back_from_the_pixels(executed):
    ns, outputs = executed["namespace"], executed["outputs"]
    assert ns["vanilla_shapes"].shape == (4, 64, 64, 3) and ns["tome_shapes"].shape == (4, 64, 64, 3)
    assert not np.array_equal(ns["vanilla_shapes"], ns["tome_shapes"])  # ToMe really ran
    assert len(set(ns["named"])) == 4  # four different backgrounds
    assert ns["vanilla_read"] == ns["named"] and ns["tome_read"] == ns["named"]  # every background read back
    sheet = [value for _, value in outputs if isinstance(value, Image.Image)][-1]
    assert sheet.size == (512, 256)
    printed = "".join(out for out, _ in outputs)
    assert "ToMe 0.5 读出" in printed and ns["prompts"][0] in printed


def test_the_background_reading_can_fail():
    """The notebook's pixel check reads each background by its colour, whatever the shape on it: on drawn images it
    names the right one of the six, so a model that drew the wrong background would fail the notebook's assertion."""
    cells = [source(c) for c in load_notebook()["cells"] if c["cell_type"] == "code"]
    reading = next(code for code in cells if "def read_background" in code)
    namespace = {"np": np}
    exec(reading.split("\nnamed = ", 1)[0], namespace)  # BACKGROUNDS and read_background only
    backgrounds, read = namespace["BACKGROUNDS"], namespace["read_background"]
    rng = np.random.default_rng(0)
    for name, rgb in backgrounds.items():
        image = np.clip(np.array(rgb) / 255 + rng.normal(0, 0.03, (64, 64, 3)), 0, 1)  # the colour, with noise
        image[8:40, 20:52] = (0.9, 0.1, 0.1)  # a large red object inside the border
        assert read(image) == name
    assert len(backgrounds) == 6


def test_readmes_point_to_the_notebook():
    with open(os.path.join(ROOT, "README_cn.md"), encoding="utf-8") as f:
        assert "docs/tutorial_cn.ipynb" in f.read()
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    examples = readme.split("## Examples", 1)[1].split("\n## ", 1)[0]
    assert "docs/tutorial_cn.ipynb" in examples and readme.count("](docs/tutorial_cn.ipynb)") == 1  # one link
