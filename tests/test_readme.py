"""The Python blocks of README.md and README_cn.md run as written.

A block is marked by an HTML comment on the line before its fence:

* ``<!-- runnable: offline -->``: runs as it is, on the embedded models (nothing downloaded);
* ``<!-- runnable: weights -->``: loads real weights by id. It runs against tiny pipelines saved to a temporary
  folder: the assignments ``model_id = ...``, ``controlnet_id = ...`` and ``sdxl_id = ...`` are pointed there, and
  ``steps = ...`` and ``size = ...`` made small; nothing else changes.

Each block runs in a fresh namespace, in a fresh working directory, so a block that leans on an earlier one (a
missing import, a ``pipe`` defined elsewhere) fails here.
"""

import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
READMES = ("README.md", "README_cn.md")
BLOCK = re.compile(r"<!-- runnable: (offline|weights) -->\n```python\n(.*?)```", re.S)
FENCE = re.compile(r"(?:<!-- runnable: (?:offline|weights) -->\n)?```python\n(.*?)```", re.S)
# the assignments a "weights" block is run with, by variable name (folders are filled in by the fixture)
SMALL = {"steps": "2", "size": "32"}  # two steps: img2img at strength 0.6 runs int(2 * 0.6) = 1
WEIGHTS = ("model_id", "controlnet_id", "sdxl_id")


def blocks(readme):
    """``[(kind, code, line)]`` of the marked blocks of ``readme``."""
    text = open(os.path.join(REPO, readme), encoding="utf-8").read()
    return [(m.group(1), m.group(2), text.count("\n", 0, m.start()) + 2) for m in BLOCK.finditer(text)]


CASES = [(readme, kind, code, line) for readme in READMES for kind, code, line in blocks(readme)]


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory):
    """Tiny pipelines saved as a user would save real ones: SD (the ControlNet preset's UNet is the same), the
    ControlNet on its own, and SDXL."""
    from ppdiffusers_tome.presets import preset_pipeline

    root = tmp_path_factory.mktemp("weights")
    preset_pipeline("tiny").save_pretrained(str(root / "sd"))
    preset_pipeline("tiny-controlnet").controlnet.save_pretrained(str(root / "controlnet"))
    preset_pipeline("tiny-sdxl").save_pretrained(str(root / "sdxl"))
    return {"model_id": repr(str(root / "sd")), "controlnet_id": repr(str(root / "controlnet")),
            "sdxl_id": repr(str(root / "sdxl"))}


def substitute(code, values):
    """``code`` with each top-level ``name = ...`` of ``values`` assigned its value instead; every name must occur."""
    for name, value in values.items():
        code, count = re.subn(rf"^{name} = [^\n#]*?(\s*#[^\n]*)?$", f"{name} = {value}\\1", code, flags=re.M)
        assert count <= 1, f"{name} is assigned {count} times"
    return code


def test_both_readmes_have_the_runnable_quick_start():
    """Offline first, then real weights, for SD and ControlNet; img2img and SDXL with real weights; the same set
    in both languages."""
    for readme in READMES:
        found = blocks(readme)
        kinds = [kind for kind, _, _ in found]
        assert kinds[0] == "offline" and "weights" in kinds, readme
        offline = "\n".join(code for kind, code, _ in found if kind == "offline")
        weights = "\n".join(code for kind, code, _ in found if kind == "weights")
        assert 'preset_pipeline("tiny")' in offline and 'preset_pipeline("tiny-controlnet")' in offline, readme
        for name in ("StableDiffusionPipeline.from_pretrained(model_id",
                     "ControlNetModel.from_pretrained(controlnet_id", "StableDiffusionImg2ImgPipeline",
                     "StableDiffusionXLPipeline.from_pretrained(sdxl_id"):
            assert name in weights, (readme, name)
        assert "/path/to" not in offline + weights, readme
    assert [k for k, _, _ in blocks("README.md")] == [k for k, _, _ in blocks("README_cn.md")]


def test_every_python_block_with_imports_is_marked_runnable():
    """A block that imports something is a program a reader will paste: it must be one of the tested ones. (The
    migration table, PyTorch's tomesd on the left, is the exception; fragments without imports are not programs.)"""
    for readme in READMES:
        text = open(os.path.join(REPO, readme), encoding="utf-8").read()
        for match in FENCE.finditer(text):
            code = match.group(1)
            if re.search(r"^(import|from) \w", code, re.M) and "import tomesd" not in code:
                assert match.group(0).startswith("<!-- runnable"), (readme, code[:200])


def test_blocks_import_the_package_before_paddle():
    """Imported first, Paddle prints "No ccache found"; the package, imported before it, keeps that quiet (as the
    examples do). So each block's first import of paddle, ppdiffusers or the package is the package."""
    for readme in READMES:
        for _, code, line in blocks(readme):
            names = [name for name in re.findall(r"^(?:import|from) (\w+)", code, re.M)
                     if name in ("paddle", "ppdiffusers", "ppdiffusers_tome")]
            assert names[0] == "ppdiffusers_tome", f"{readme}:{line} imports {names[0]} first"


def test_weights_blocks_name_real_model_ids():
    for readme in READMES:
        for kind, code, _ in blocks(readme):
            if kind == "weights":
                ids = re.findall(rf"^(?:{'|'.join(WEIGHTS)}) = \"([^\"]+)\"", code, re.M)
                assert ids and all(re.fullmatch(r"[\w.-]+/[\w.-]+", i) for i in ids), (readme, ids)


@pytest.mark.parametrize("readme,kind,code,line", CASES, ids=[f"{r}:{line}" for r, _, _, line in CASES])
def test_readme_block_runs(readme, kind, code, line, tiny_folders, tmp_path, monkeypatch):
    if kind == "weights":
        used = {name: value for name, value in tiny_folders.items() if re.search(rf"^{name} = ", code, re.M)}
        code = substitute(code, {**used, **{k: v for k, v in SMALL.items() if re.search(rf"^{k} = ", code, re.M)}})
        assert used, f"{readme}:{line} loads no model by a variable of {WEIGHTS}"
        assert re.search(r"^steps = 2$", code, re.M), f"{readme}:{line} does not take its steps from `steps`"
    monkeypatch.chdir(tmp_path)  # files the block saves land here
    try:
        exec(compile(code, f"{readme}:{line}", "exec"), {"__name__": "__readme__"})
    finally:  # the CPU block gives Paddle every core: back to the suite's setting for the tests that follow
        from ppdiffusers_tome.tools.measure import set_threads

        set_threads(int(os.environ.get("FLAGS_paddle_num_threads", "1")))
