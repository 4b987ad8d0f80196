"""The device cache: safe for threads planning at many shapes, bounded in entries and bytes, and clearable."""

import numpy as np
import paddle
import pytest

import ppdiffusers_tome
import ppdiffusers_tome.ops as merge_module
from ppdiffusers_tome.ops import (
    bipartite_soft_matching_random2d,
    cache as cache_module,
)


# the device cache: threads, a bound in bytes, clearing ---------------------------------------------------------------
def test_the_device_cache_is_safe_for_threads_planning_at_many_shapes(monkeypatch):
    import threading
    import time
    from collections import OrderedDict

    class Yielding(OrderedDict):
        """The cache's table, letting other threads run between a lookup and its use (as a thread switch can)."""

        def __contains__(self, key):
            found = super().__contains__(key)
            time.sleep(0)
            return found

        def move_to_end(self, *args, **kwargs):
            time.sleep(0)
            return super().move_to_end(*args, **kwargs)

    merge_module.clear_table_cache()
    monkeypatch.setattr(cache_module.CACHE, "size", 4)  # evictions all the time
    monkeypatch.setattr(cache_module.CACHE, "items", Yielding())
    errors, start = [], threading.Barrier(4)
    shapes = [(h, w) for h in (4, 6, 8) for w in (4, 6, 8)]

    def hammer(k):
        start.wait()
        try:
            rng = np.random.default_rng(k)
            for i in range(40):  # plans at many shapes, as four services with different image sizes make them
                h, w = shapes[(i + k) % len(shapes)]
                x = paddle.to_tensor(rng.standard_normal((1 + i % 2, h * w, 8)).astype("float32"))
                plan = bipartite_soft_matching_random2d(x, w, h, 2, 2, h * w // 4, no_rand=True)
                assert plan.merge(x).shape == [x.shape[0], h * w - h * w // 4, 8]
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=hammer, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors[:3]
    assert len(cache_module.CACHE.items) <= 4
    assert cache_module.CACHE.bytes == sum(cache_module._nbytes(v) for v in cache_module.CACHE.items.values())
    merge_module.clear_table_cache()  # (the test's table goes)


def test_the_device_cache_is_bounded_in_bytes_and_can_be_cleared(monkeypatch):
    import ppdiffusers_tome

    ppdiffusers_tome.clear_table_cache()
    assert ppdiffusers_tome.table_cache_info()["entries"] == 0 and ppdiffusers_tome.table_cache_info()["bytes"] == 0
    limit = 2**20
    monkeypatch.setattr(cache_module.CACHE, "max_bytes", limit)
    rng = np.random.default_rng(0)
    expected = {}
    for batch in range(1, 17):  # activation-sized buffers of a growing batch: [B, 256, 320] float32, B * 160 KiB
        x = paddle.to_tensor(rng.standard_normal((batch, 256, 320)).astype("float32"))
        plan = bipartite_soft_matching_random2d(x, 16, 16, 2, 2, 128, no_rand=True)
        expected[batch] = (x, plan, plan.merge(x).numpy())
        info = ppdiffusers_tome.table_cache_info()
        assert info["bytes"] <= limit and info["max_bytes"] == limit, info
    assert info["entries"] > 0
    sizes = [cache_module._nbytes(value) for value in cache_module.CACHE.items.values()]
    assert sum(sizes) == info["bytes"] and max(sizes) <= limit
    freed = ppdiffusers_tome.clear_table_cache()
    assert freed == info["bytes"] > 0
    assert ppdiffusers_tome.table_cache_info()["entries"] == 0 and ppdiffusers_tome.table_cache_info()["bytes"] == 0
    for x, plan, merged in expected.values():  # plans made before the clear still merge, and the same
        np.testing.assert_array_equal(plan.merge(x).numpy(), merged)
    assert merge_module.DEFAULT_CACHE_BYTES == cache_module.DeviceCache().max_bytes == 64 * 2**20


def test_the_old_names_of_the_table_cache_warn_and_still_work():
    ppdiffusers_tome.table_cache_info()
    with pytest.warns(DeprecationWarning, match="clear_table_cache"):
        freed = ppdiffusers_tome.clear_cache()
    with pytest.warns(DeprecationWarning, match="table_cache_info"):
        info = ppdiffusers_tome.cache_info()
    assert freed >= 0 and info == ppdiffusers_tome.table_cache_info() and info["entries"] == 0
