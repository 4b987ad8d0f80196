"""The Arguments tables of README.md and README_cn.md against ToMeConfig: the same rows in both, exactly
ToMeConfig's fields, the defaults of the dataclass, and allowed values that ToMeConfig really accepts (and whose
neighbours it really refuses), so that a change of the code without the docs, or of one README without the other,
fails here.

Table format (the same in both READMEs): the first markdown table after the marker comment
``<!-- arguments-table -->``, columns ``argument | default | allowed | description``. The argument cell holds the field
names in backticks; the default cell one backticked Python literal per name; in the allowed cell every backticked
span is one of the forms in :func:`accepted_forms` (text outside backticks is free prose, in either language).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import math
import re
from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np
import pytest

from ppdiffusers_tome.api import apply_tome
from ppdiffusers_tome.tome.config import ToMeConfig

ROOT = Path(__file__).resolve().parents[1]
READMES = ("README.md", "README_cn.md")
MARKER = "<!-- arguments-table -->"
FIELDS = {field.name: field.default for field in dataclasses.fields(ToMeConfig)}
STRIDES = [(2, 2), (4, 2), (1, 1), (8, 8)]  # where the allowed ranges that depend on sx, sy are probed
NEEDS = {"match_order": {"match_window": 16}}  # the other options a field's values are only valid with


def code_spans(cell: str) -> List[str]:
    return re.findall(r"`([^`]+)`", cell)


def arguments_table(readme: str) -> Dict[str, Tuple[object, List[str]]]:
    """``{field: (default, allowed spans)}`` from the Arguments table of ``readme``, in table order."""
    text = (ROOT / readme).read_text(encoding="utf-8")
    assert text.count(MARKER) == 1, f"{readme}: expected one {MARKER} before the Arguments table"
    lines = text.split(MARKER, 1)[1].strip().splitlines()
    rows = []
    for line in lines:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    assert len(rows) > 2 and set(rows[1][0]) <= {"-", " "}, f"{readme}: no markdown table after {MARKER}"
    assert all(len(row) == 4 for row in rows), f"{readme}: every row needs 4 cells (argument|default|allowed|...)"
    table: Dict[str, Tuple[object, List[str]]] = {}
    for names_cell, default_cell, allowed_cell, _ in rows[2:]:
        names, defaults = code_spans(names_cell), code_spans(default_cell)
        assert names and len(defaults) == len(names), f"{readme}: row {names_cell!r}: one default per argument"
        for name, default in zip(names, defaults):
            assert name not in table, f"{readme}: {name} listed twice"
            table[name] = (ast.literal_eval(default), code_spans(allowed_cell))
    return table


TABLES: Dict[str, Dict[str, Tuple[object, List[str]]]] = {}


def table_of(readme: str) -> Dict[str, Tuple[object, List[str]]]:
    if readme not in TABLES:
        TABLES[readme] = arguments_table(readme)
    return TABLES[readme]


def accepts(**kwargs) -> bool:
    for name in list(kwargs):
        kwargs = {**NEEDS.get(name, {}), **kwargs}
    try:
        ToMeConfig(**kwargs)
    except ValueError:
        return False
    return True


def evaluate(expression: str, sx: int, sy: int) -> float:
    """A bound written in the table (``64``, ``max(2, sx, sy)``, ``1 - 1/(sx*sy)``) at strides ``sx``, ``sy``."""
    return eval(expression.replace("∞", "math.inf"), {"max": max, "math": math}, {"sx": sx, "sy": sy})  # noqa: S307


def check_form(name: str, span: str) -> List[object]:
    """Check that ToMeConfig accepts what ``span`` allows for ``name`` and refuses its neighbours; return the
    literal values it names (for the completeness check of choices)."""
    ratio = re.fullmatch(r"(\S+) <= ratio < (.+)", span)
    integers = re.fullmatch(r"int in \[(.+), (.+)\]", span) or re.fullmatch(r"int >= (\S+)()", span)
    if ratio:
        assert name == "ratio", span
        for sx, sy in STRIDES:
            low, high = evaluate(ratio.group(1), sx, sy), evaluate(ratio.group(2), sx, sy)
            assert accepts(ratio=low, sx=sx, sy=sy) and not accepts(ratio=low - 1e-3, sx=sx, sy=sy), (span, sx, sy)
            assert not accepts(ratio=high + 1e-3, sx=sx, sy=sy), (span, sx, sy)
            if high > low:
                assert accepts(ratio=high - 1e-6, sx=sx, sy=sy) and accepts(ratio=(low + high) / 2, sx=sx, sy=sy)
                assert not accepts(ratio=high, sx=sx, sy=sy), (span, sx, sy)
            # (with 1 x 1 cells the range is empty: then only 0, "no merging", is allowed; the table says so)
        return []
    if integers:
        for sx, sy in STRIDES:
            strides = dict(ratio=0.0) if name in ("sx", "sy") else dict(sx=sx, sy=sy, ratio=0.0)  # 0 fits any cell
            low = int(evaluate(integers.group(1), sx, sy))
            high = evaluate(integers.group(2), sx, sy) if integers.group(2) else math.inf
            assert accepts(**{name: low}, **strides) and not accepts(**{name: low - 1}, **strides), (name, span, sx)
            assert not accepts(**{name: low + 0.5}, **strides) and not accepts(**{name: str(low)}, **strides)
            if high < math.inf:
                assert accepts(**{name: int(high)}, **strides) and not accepts(**{name: int(high) + 1}, **strides)
            else:
                assert accepts(**{name: low + 10**6}, **strides), (name, span)
            if name in ("sx", "sy"):
                break
        return []
    if span == "bool":
        assert accepts(**{name: True}) and accepts(**{name: False}) and accepts(**{name: np.bool_(True)})
        assert not any(accepts(**{name: value}) for value in (0, 1, "True", None)), name
        return [True, False]
    if span in ("(start, end)", "[start, end]"):
        assert name == "ratio"
        pair = (0.6, 0.2) if span.startswith("(") else [0.6, 0.2]
        assert ToMeConfig(ratio=pair).ratio == (0.6, 0.2) and ToMeConfig(ratio=pair).ratio_at(0.5) == pytest.approx(0.4)
        assert not accepts(ratio=type(pair)([0.6])) and not accepts(ratio=type(pair)([0.6, 0.9]))
        return []
    if span == "callable(progress)":
        assert name == "ratio" and ToMeConfig(ratio=lambda p: 0.5 * p).ratio_at(0.5) == 0.25
        assert not accepts(ratio=lambda p: 0.9)  # every value is checked against the range
        return []
    if span in ("[i, j, ...]", "(i, j, ...)", "range(...)"):
        assert name == "recompute_every"
        steps = {"[": [0, 5], "(": (0, 5), "r": range(0, 10, 5)}[span[0]]
        assert ToMeConfig(recompute_every=steps).recompute_every == (0, 5)
        empty, negative = {"[": ([], [-1]), "(": ((), (-1,)), "r": (range(0), range(-1, 1))}[span[0]]
        assert not accepts(recompute_every=empty) and not accepts(recompute_every=negative)
        return []
    value = ast.literal_eval(span)  # a single allowed value
    assert getattr(ToMeConfig(**{name: value}, **NEEDS.get(name, {})), name) == value, (name, span)
    return [value]


@pytest.mark.parametrize("readme", READMES)
def test_the_arguments_table_lists_exactly_the_fields_of_tomeconfig_with_their_defaults(readme):
    table = table_of(readme)
    assert list(table) == list(FIELDS), f"{readme}: the table must list ToMeConfig's fields, in their order"
    for name, (default, _) in table.items():
        assert default == FIELDS[name] and type(default) is type(FIELDS[name]), (readme, name, default)


def test_apply_tome_takes_the_same_arguments_with_the_same_defaults():
    """``apply_tome(obj, config=None, *, <every field of ToMeConfig with its default>)``, as help() shows it."""
    parameters = inspect.signature(apply_tome).parameters
    assert list(parameters)[:2] == ["obj", "config"] and parameters["config"].default is None
    assert {name: parameters[name].default for name in list(parameters)[2:]} == FIELDS


def test_both_readmes_have_the_same_arguments_table():
    assert table_of("README.md") == table_of("README_cn.md")


@pytest.mark.parametrize("name", list(FIELDS))
def test_the_allowed_values_are_those_tomeconfig_enforces(name):
    spans = table_of("README.md")[name][1]
    assert spans, f"{name}: no allowed values in the table"
    choices = [value for span in spans for value in check_form(name, span)]
    if choices and not any(re.match(r"int |bool$", span) for span in spans):
        # a closed list of values: nothing near them is accepted
        strings = [c for c in choices if isinstance(c, str)]
        others = [f"{c}x" for c in strings] + [c.upper() for c in strings] + ["", "none"]
        others += [i for i in range(-1, 17) if i not in choices] + [2.0 if 2 in choices else 2.5]
        accepted = [value for value in others if accepts(**{name: value})]
        assert not accepted, f"{name}: ToMeConfig accepts {accepted}, which the table does not list"


def test_a_changed_default_or_range_would_fail(monkeypatch):
    """The checks above can fail: a table with a wrong range or default is caught."""
    with pytest.raises(AssertionError):
        check_form("sx", "int in [1, 32]")
    with pytest.raises(AssertionError):
        check_form("ratio", "0 <= ratio < 1 - 1/(2*sx*sy)")
    with pytest.raises(AssertionError):
        check_form("seed", "int >= 1")
    changed = {name: (FIELDS[name] if name != "min_tokens" else 1, []) for name in FIELDS}
    monkeypatch.setitem(TABLES, "README.md", changed)
    with pytest.raises(AssertionError):
        test_the_arguments_table_lists_exactly_the_fields_of_tomeconfig_with_their_defaults("README.md")
