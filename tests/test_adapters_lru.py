"""LRUCache (adapters/lru.py): the one LRU class a tier uses for its CPU cache and its device slots."""

import pytest

from adapters.lru import LRUCache


def _cache(capacity=2):
    removed = []
    cache = LRUCache(capacity, on_remove=lambda key, value: removed.append((key, value)))
    return cache, removed


def test_keys_iterate_least_recently_used_first_and_touch_moves_to_the_end():
    cache, _ = _cache(capacity=5)
    for key in "abc":
        cache.put(key, key.upper())
    assert list(cache) == ["a", "b", "c"] and len(cache) == 3 and "b" in cache and "z" not in cache
    cache.touch("a")
    assert list(cache) == ["b", "c", "a"]
    cache.put("b", "B2")  # a put of a known key replaces its value and makes it the most recent
    assert list(cache) == ["c", "a", "b"] and cache.values() == ["C", "A", "B2"]


def test_touch_of_an_absent_key_raises():
    cache, _ = _cache()
    with pytest.raises(KeyError):
        cache.touch("a")


def test_trim_evicts_least_recently_used_first_through_the_hook():
    cache, removed = _cache(capacity=2)
    for key in "abcd":
        cache.put(key, key.upper())
    cache.touch("a")  # order b, c, d, a
    assert cache.trim(keep=lambda key: False) == ["b", "c"]
    assert removed == [("b", "B"), ("c", "C")] and list(cache) == ["d", "a"]
    assert cache.trim(keep=lambda key: False) == [] and len(removed) == 2  # at capacity: nothing more


def test_trim_skips_kept_entries_and_may_stay_over_capacity():
    cache, removed = _cache(capacity=1)
    for key in "abcd":
        cache.put(key, None)
    pinned = {"a", "c"}
    assert cache.trim(keep=lambda key: key in pinned) == ["b", "d"]
    assert list(cache) == ["a", "c"] and [key for key, _ in removed] == ["b", "d"]  # over capacity: all kept


def test_victims_choose_without_removing():
    cache, removed = _cache(capacity=0)
    for key in "abc":
        cache.put(key, None)
    assert cache.victims(2, keep=lambda key: key == "a") == ["b", "c"]
    assert cache.victims(5, keep=lambda key: False) == ["a", "b", "c"]
    assert cache.victims(0, keep=lambda key: False) == [] and cache.victims(-1, keep=lambda key: False) == []
    assert list(cache) == ["a", "b", "c"] and removed == []


def test_pop_and_discard_call_the_hook_once_and_discard_ignores_absent_keys():
    cache, removed = _cache()
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.pop("a") == 1 and removed == [("a", 1)]
    cache.discard("b")
    cache.discard("b")
    cache.discard("never")
    assert removed == [("a", 1), ("b", 2)] and len(cache) == 0
    with pytest.raises(KeyError):
        cache.pop("a")


def test_the_hook_may_read_the_cache_and_iteration_survives_pops():
    """The slot pool's hook runs after the entry left; iterating a snapshot lets a caller pop as it goes."""
    seen = []
    cache = LRUCache(0, on_remove=lambda key, value: seen.append(key in cache))
    for key in "abc":
        cache.put(key, None)
    for key in cache:
        cache.pop(key)
    assert seen == [False, False, False] and len(cache) == 0


def test_negative_capacity_is_refused():
    with pytest.raises(ValueError, match="capacity"):
        LRUCache(-1)
