"""ToDo's key/value downsampling against a numpy reference, in every dtype."""

import numpy as np
import paddle
import pytest

from ppdiffusers_tome.ops import (
    DownsamplePlan,
    downsample_tokens,
)
from tests.numpy_reference import (
    reference_downsample,
)


# ToDo's key/value downsampling -------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["nearest", "average"])
@pytest.mark.parametrize("h, w, factor", [(8, 8, 2), (16, 12, 4), (9, 11, 2), (7, 5, 3), (4, 4, 8)])
def test_downsample_tokens_matches_numpy_reference(mode, h, w, factor):
    x = np.random.default_rng(h * w + factor).standard_normal((2, h * w, 5)).astype("float32")
    got = downsample_tokens(paddle.to_tensor(x), h, w, factor, mode)
    expected = reference_downsample(x, h, w, factor, mode)
    assert list(got.shape) == list(expected.shape)
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("mode", ["nearest", "average"])
def test_downsample_tokens_keeps_half_dtypes(dtype, mode):
    x = paddle.to_tensor(np.random.default_rng(1).standard_normal((1, 36, 4)).astype("float32"))
    half = downsample_tokens(x.astype(dtype), 6, 6, 2, mode)
    full = downsample_tokens(x.astype(dtype).astype("float32"), 6, 6, 2, mode)
    assert half.dtype == x.astype(dtype).dtype
    tol = 1e-2 if dtype == "bfloat16" else 1e-3
    np.testing.assert_allclose(half.astype("float32").numpy(), full.numpy(), rtol=tol, atol=tol)


def test_downsample_plan_counts_its_keys_and_rejects_bad_input():
    plan = DownsamplePlan(num_tokens=99, batch_size=1, grid_h=9, grid_w=11, factor=2, mode="average")
    assert plan.kv_tokens == 5 * 6 and not plan.is_identity
    assert list(plan.keys_values(paddle.randn([1, 99, 3])).shape) == [1, 30, 3]
    with pytest.raises(ValueError, match="mode must be one of"):
        DownsamplePlan(4, 1, 2, 2, 2, mode="bilinear")
    with pytest.raises(ValueError, match=r"x must be \[batch, h\*w=16, channels\]"):
        downsample_tokens(paddle.randn([1, 15, 3]), 4, 4, 2)
    x = paddle.randn([1, 16, 3])
    assert downsample_tokens(x, 4, 4, 1) is x
