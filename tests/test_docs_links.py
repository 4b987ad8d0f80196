"""The user docs as a reader of a clone meets them: READMEs short enough to be guides, every relative link resolving
inside the repository, nothing pointing outside it, and no install line naming another version than the package's.
"""

import re
from pathlib import Path

import pytest

import ppdiffusers_tome

ROOT = Path(__file__).resolve().parents[1]
READMES = ["README.md", "README_cn.md"]
DOCS = READMES + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def text(doc):
    return (ROOT / doc).read_text(encoding="utf-8")


@pytest.mark.parametrize("readme", READMES)
def test_readmes_are_guides_of_at_most_400_lines(readme):
    assert len(text(readme).splitlines()) <= 400


@pytest.mark.parametrize("doc", DOCS)
def test_every_relative_link_resolves_inside_the_repository(doc):
    broken = []
    for target in LINK.findall(text(doc)):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # an address or an anchor of the same page
        path = (ROOT / doc).parent / target.split("#")[0]
        if not path.resolve().is_relative_to(ROOT) or not path.exists():
            broken.append(target)
    assert not broken, f"{doc}: {broken}"


@pytest.mark.parametrize("doc", DOCS)
def test_nothing_points_outside_the_repository(doc):
    """No path of the machine the docs were written on (the shared reference folder beside the checkout, a home
    or work directory): a reader of a clone cannot open it."""
    found = re.findall(r"\.\./shared\S*|/work/\S+|/root/\S+|/home/\S+", text(doc))
    assert not found, f"{doc}: {found}"


@pytest.mark.parametrize("doc", DOCS)
def test_install_lines_name_this_version(doc):
    wheels = set(re.findall(r"ppdiffusers_tome-(\d+\.\d+\.\d+)-py3", text(doc)))
    assert wheels <= {ppdiffusers_tome.__version__}, f"{doc} names wheels {wheels}"


def test_the_link_check_can_fail(tmp_path):
    assert LINK.findall("see [the guide](docs/nowhere.md) and [x](https://example.org)") == [
        "docs/nowhere.md", "https://example.org"]
