"""force_kernels reaches code that Paddle's AST conversion converted earlier: a converted function keeps a copy of
its module's globals taken at its first conversion, so the switch must not be a rebound global."""

import numpy as np
import paddle

from ppdiffusers_tome.ops.runtime import device_kind, force_kernels


def _kind_code(x):
    # 1.0 where the merge core would run its GPU kernels for x, else 0.0 (device_kind is converted with this function)
    if device_kind(x) == "gpu":
        return x * 0.0 + 1.0
    return x * 0.0


def _convert_and_run(x):
    # a new StaticFunction every time, so the program is traced again (its converted callees come from Paddle's cache)
    def kind_of(y):
        return _kind_code(y)
    return float(paddle.jit.to_static(kind_of, full_graph=True)(x).numpy()[0])


def test_the_kernel_family_switch_reaches_code_converted_before_in_either_order():
    x = paddle.to_tensor(np.array([0.25, -1.5], dtype="float32"))
    assert _convert_and_run(x) == 0.0  # converted first outside the switch
    with force_kernels("gpu"):
        assert _convert_and_run(x) == 1.0
    assert _convert_and_run(x) == 0.0
    with force_kernels("gpu"):
        assert _convert_and_run(x) == 1.0
        with force_kernels("cpu"):
            assert _convert_and_run(x) == 0.0
