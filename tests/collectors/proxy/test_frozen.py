"""Frozen JSON values: equal to and written as the plain value, refusing every in-place change, copied plain."""

from __future__ import annotations

import copy
import json
import pickle

import orjson
import pytest

from collectors.proxy.frozen import FrozenDict, FrozenList, freeze

VALUE = {"b": [1, {"c": None, "d": [True, 2.5]}], "a": "x", "t": ({"u": 1},)}


def test_a_frozen_copy_equals_and_is_written_as_the_value() -> None:
    frozen = freeze(VALUE)
    assert frozen == VALUE and repr(frozen) == repr(VALUE) and list(frozen) == ["b", "a", "t"]
    assert json.dumps(frozen) == json.dumps(VALUE) and orjson.dumps(frozen) == orjson.dumps(VALUE)
    assert isinstance(frozen["b"], FrozenList) and isinstance(frozen["b"][1], FrozenDict)
    assert isinstance(frozen["t"], tuple) and isinstance(frozen["t"][0], FrozenDict)
    assert frozen["b"] is not VALUE["b"]  # a copy: nothing shared with what may change


@pytest.mark.parametrize("change", [
    lambda v: v.__setitem__("a", 1), lambda v: v.pop("a"), lambda v: v.popitem(), lambda v: v.clear(),
    lambda v: v.update(a=1), lambda v: v.setdefault("z", 1), lambda v: v.__delitem__("a"),
    lambda v: v.__ior__({"a": 1}), lambda v: v["b"].append(1), lambda v: v["b"].extend([1]),
    lambda v: v["b"].insert(0, 1), lambda v: v["b"].pop(), lambda v: v["b"].remove(1), lambda v: v["b"].sort(),
    lambda v: v["b"].reverse(), lambda v: v["b"].clear(), lambda v: v["b"].__setitem__(0, 2),
    lambda v: v["b"].__delitem__(0), lambda v: v["b"].__iadd__([1]), lambda v: v["b"].__imul__(2),
    lambda v: v["b"][1]["d"].append(1), lambda v: v["t"][0].update(u=2)])
def test_every_in_place_change_raises(change: object) -> None:
    frozen = freeze(VALUE)
    with pytest.raises(TypeError, match="cannot be changed"):
        change(frozen)  # type: ignore[operator]
    assert frozen == VALUE


def test_copies_are_plain_and_changeable() -> None:
    frozen = freeze(VALUE)
    for plain in (copy.deepcopy(frozen), pickle.loads(pickle.dumps(frozen))):
        assert plain == VALUE and type(plain) is dict and type(plain["b"]) is list and type(plain["b"][1]) is dict
        plain["b"][1]["d"].append(3)
    shallow = copy.copy(frozen)
    assert type(shallow) is dict and shallow == VALUE
    shallow["a"] = "y"
    assert frozen["a"] == "x"
