"""The core's one bounded cache (``core/bounded_cache.py``) and the σ²_H ceiling (``core/layout.py``)."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from lightning_bnp.core.bounded_cache import BoundedCache
from lightning_bnp.core.layout import variance_ceiling


def test_a_full_cache_drops_its_earliest_entry_and_a_lookup_does_not_refresh_it() -> None:
    cache: BoundedCache[str, int] = BoundedCache(2)
    cache["a"], cache["b"] = 1, 2
    assert cache["a"] == 1  # a lookup: "a" stays the earliest
    cache["b"] = 3  # an existing key: nothing dropped
    assert dict(cache) == {"a": 1, "b": 3}
    cache["c"] = 4
    assert dict(cache) == {"b": 3, "c": 4}


def test_get_or_make_builds_once_per_key() -> None:
    cache: BoundedCache[int, list[int]] = BoundedCache(4)
    made: list[int] = []
    first = cache.get_or_make(1, lambda: made.append(1) or [1])
    assert cache.get_or_make(1, lambda: made.append(2) or [2]) is first and made == [1]


@pytest.mark.parametrize("clone", [copy.deepcopy, lambda c: pickle.loads(pickle.dumps(c))])
def test_a_copy_keeps_its_size_and_entries(clone: object) -> None:
    cache: BoundedCache[int, int] = BoundedCache(2)
    cache[1], cache[2] = 1, 2
    other = clone(cache)  # type: ignore[operator]
    assert type(other) is BoundedCache and other.size == 2 and dict(other) == {1: 1, 2: 2}
    other[3] = 3
    assert dict(other) == {2: 2, 3: 3}


def test_a_size_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="`size` must be at least 1, got 0"):
        BoundedCache(0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_the_ceiling_leaves_room_for_q2_up_to_2_to_the_24(dtype: torch.dtype) -> None:
    ceiling = torch.tensor(variance_ceiling(dtype), dtype=torch.float64)
    assert ceiling * 2.0**24 <= torch.finfo(dtype).max
    assert torch.isfinite(torch.tensor(variance_ceiling(dtype), dtype=dtype) * 2.0**23)
