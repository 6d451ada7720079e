"""Hypothesis: the canonical form items are fingerprinted by (msgspec's sorted compact JSON, see
hotloop.pipeline.items) is a function of the value alone, and the nesting bound is exact."""

from __future__ import annotations

import json
import random
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hotloop.pipeline import items as itemlib

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

text = st.text(st.characters(codec="utf-8"), max_size=40)
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=False, allow_infinity=False), text
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=5), st.dictionaries(text, inner, max_size=5)),
    max_leaves=30,
)


def _shuffled(obj: Any, rnd: random.Random) -> Any:
    """The same value with every dict's insertion order shuffled."""
    if isinstance(obj, dict):
        keys = list(obj)
        rnd.shuffle(keys)
        return {k: _shuffled(obj[k], rnd) for k in keys}
    if isinstance(obj, list):
        return [_shuffled(v, rnd) for v in obj]
    return obj


def _floats(obj: Any) -> list[float]:
    if type(obj) is float:
        return [obj]
    if isinstance(obj, dict):
        return [f for v in obj.values() for f in _floats(v)]
    if isinstance(obj, list):
        return [f for v in obj for f in _floats(v)]
    return []


@SETTINGS
@given(json_values, st.integers(0, 2**32))
def test_canonical_form_is_compact_sorted_json_of_the_value(obj: Any, seed: int) -> None:
    data = itemlib._canonical(obj)
    assert itemlib._canonical(_shuffled(obj, random.Random(seed))) == data  # insertion order is not seen
    assert json.loads(data) == obj
    # compact and sorted: json.dumps' layout, up to float spelling (msgspec writes 1e16, json 1e+16)
    ref = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    assert data == ref or any("e" in repr(f) for f in _floats(obj))


@SETTINGS
@given(st.integers(0, 300), st.integers(0, 2))
def test_nesting_bound_is_exact(depth: int, shape: int) -> None:
    obj: Any = "leaf"
    for i in range(depth):
        obj = [obj] if (i + shape) % 3 else {"k": obj}
    assert itemlib.too_deep(obj) is (depth > itemlib.MAX_DEPTH)
    assert itemlib.too_deep(("wide", [obj, 1], {"a": [], "b": obj})) is (depth + 2 > itemlib.MAX_DEPTH)
