"""The ratio check's messages: strides of 1 in both directions leave ratio 0 only, and the error says so."""

import pytest

from ppdiffusers_tome.tome.config import ToMeConfig, check_ratio


@pytest.mark.parametrize("ratio", [0.5, 0.1, -0.2])
def test_strides_of_one_say_that_only_ratio_zero_is_allowed(ratio):
    with pytest.raises(ValueError) as raised:
        ToMeConfig(ratio=ratio, sx=1, sy=1)
    message = str(raised.value)
    assert "[0, 0)" not in message  # an empty range reads as a contradiction
    assert message.startswith("ratio must be 0:") and "sx=1, sy=1 allow only ratio 0" in message
    assert f"got {ratio}" in message


def test_strides_of_one_accept_ratio_zero():
    assert ToMeConfig(ratio=0, sx=1, sy=1).ratio == 0
    assert check_ratio(0, 1, 1) == 0.0


def test_a_non_number_with_strides_of_one_names_the_one_allowed_value():
    with pytest.raises(ValueError) as raised:
        check_ratio("half", 1, 1)
    message = str(raised.value)
    assert "[0, 0)" not in message and "must be the number 0" in message and "allow only ratio 0" in message


def test_a_scheduled_ratio_with_strides_of_one_names_the_progress_and_the_one_allowed_value():
    with pytest.raises(ValueError, match=r"^ratio\(progress=0\.500\) must be 0: strides sx=1, sy=1 allow only"):
        check_ratio(0.3, 1, 1, "(progress=0.500)")


def test_other_strides_keep_their_range_in_the_message():
    with pytest.raises(ValueError, match=r"must be in \[0, 0\.5\) for sx=2, sy=1"):
        check_ratio(0.6, 2, 1)
