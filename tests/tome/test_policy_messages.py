"""The policy's one-line explanation (``Decision.why``): its numbers are printed so that the comparison it states
reads true, also right at the threshold."""

import re

import paddle
import pytest

from ppdiffusers_tome.tome.config import ToMeConfig
from ppdiffusers_tome.tome.policy import Policy

COMPARISON = re.compile(r"batch \* tokens\*\*2 = ([^\s:]+)(?: \([^)]*\))? (<|>=) min_work = ([^\s:]+)")


def stated(why):
    """The two numbers and the operator that ``why`` states, read back as numbers."""
    found = COMPARISON.search(why)
    assert found, why
    return float(found.group(1)), found.group(2), float(found.group(3))


@pytest.mark.parametrize("kernels", ["cpu", "gpu"])
@pytest.mark.parametrize("batch,tokens", [(2, 256), (2, 11585), (1, 4096)])
def test_the_stated_comparison_is_true_one_below_at_and_one_above_the_threshold(kernels, batch, tokens):
    work = batch * tokens**2
    hidden = paddle.static.InputSpec([batch, tokens, 8], "float32")  # (only its shape is read)
    for min_work, operator in ((work + 1, "<"), (work, ">="), (work - 1, ">=")):
        why = Policy(ToMeConfig(min_work=min_work)).choose_plan(hidden, kernels).why()
        left, shown, right = stated(why)
        assert shown == operator, why
        assert (left, right) == (work, min_work), why  # every digit, so the two sides never print alike
        assert (left < right) if shown == "<" else (left >= right), why


def test_large_numbers_also_show_their_power_of_ten():
    why = Policy(ToMeConfig()).choose_plan(paddle.static.InputSpec([2, 4096, 8], "float32"), "gpu").why()
    assert f"batch * tokens**2 = {2 * 4096**2} (3.36e+07) < min_work = {2**26} (6.71e+07)" in why
