"""Arguments of apply_tome that are arrays, tensors, huge or numpy scalars: refused by name (leaving the model as it
was) or applied as plain values."""

import numpy as np
import paddle
import pytest

import ppdiffusers_tome
from ppdiffusers_tome.testing import tiny_unet
from ppdiffusers_tome.tome.patch import get_patch

# items 1, 5, 6, 7, 9: threads, a retry after a fault, early exceptions, non-finite timesteps ----------------------
from tests.unet_calls import hook_tables, unet_output


# arrays and tensors at apply_tome ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(max_downsample=paddle.to_tensor([1, 2])), r"^max_downsample must be 'auto' or one of \(1, 2, 4, 8\)"),
        (dict(max_downsample=np.array([1, 2])), r"^max_downsample must be 'auto' or one of \(1, 2, 4, 8\)"),
        (dict(method=paddle.to_tensor([1, 2])), r"^method must be one of \('tome', 'todo'\)"),
        (dict(method=np.array(["todo"])), r"^method must be one of \('tome', 'todo'\)"),
        (dict(method="todo", downsample_mode=np.array(["average", "nearest"])), r"^downsample_mode must be one of"),
        (dict(sx=10**4), r"^sx must be an integer >= 1 and <= 64"),
        (dict(sy=2**40), r"^sy must be an integer >= 1 and <= 64"),
        (dict(ratio=paddle.to_tensor(0.5)), r"^ratio must be a number in \[0, 0.75\)"),
    ],
)
def test_array_tensor_and_huge_arguments_are_refused_by_name_and_leave_the_model_as_it_was(kwargs, message):
    unet = ppdiffusers_tome.apply_tome(tiny_unet(), ratio=0.3)
    patch, hooks = get_patch(unet), hook_tables(unet)
    with pytest.raises(ValueError, match=message):
        ppdiffusers_tome.apply_tome(unet, **kwargs)
    assert get_patch(unet) is patch and hook_tables(unet) == hooks


def test_numpy_scalars_are_applied_as_plain_values():
    unet = tiny_unet()
    ppdiffusers_tome.apply_tome(unet, ratio=np.float64(0.5), sx=np.int64(2), max_downsample=np.int32(1), seed=np.uint8(4))
    reference = ppdiffusers_tome.apply_tome(tiny_unet(), ratio=0.5, sx=2, max_downsample=1, seed=4)
    assert ppdiffusers_tome.tome_config(unet) == ppdiffusers_tome.tome_config(reference)
    np.testing.assert_array_equal(unet_output(unet), unet_output(reference))
