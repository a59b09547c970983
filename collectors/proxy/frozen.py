"""JSON values that refuse to be changed: what several calls share must stay as the first one made it. Pure.

The wire adapters translate an agent's tool list once and hand the very same translation to every
call that sends that list again (`collectors.proxy.chat.template_tools`). A caller that changed it
in place (appended a tool, edited a schema) would change every later call's tools, and the tool
list of turns already answered. `freeze` copies a JSON value into `FrozenDict` / `FrozenList`:
plain `dict` / `list` subclasses (so `isinstance`, `==`, `json.dumps`, orjson, jinja's `tojson`
and `repr` treat them exactly as the plain values, and a chat template renders them to the same
text) whose every in-place change raises `TypeError`. A copy is the caller's own again:
`copy.copy`, `copy.deepcopy` and pickle give plain, changeable dicts and lists.
"""

from __future__ import annotations

import copy
from typing import Any, NoReturn

_SHARED = "this JSON value is shared by every call that sent the same tools and cannot be changed: change a copy " \
          "(copy.deepcopy gives a plain one)"


def _refuse(self: Any, *args: Any, **kwargs: Any) -> NoReturn:
    raise TypeError(_SHARED)


class FrozenDict(dict[str, Any]):
    """A dict whose in-place changes raise `TypeError` (module docstring)."""

    __slots__ = ()
    __setitem__ = __delitem__ = __ior__ = clear = pop = popitem = setdefault = update = _refuse

    def __copy__(self) -> dict[str, Any]:
        return dict(self)

    def __deepcopy__(self, memo: dict[int, Any]) -> dict[str, Any]:
        return {key: copy.deepcopy(value, memo) for key, value in self.items()}

    def __reduce__(self) -> tuple[Any, ...]:
        return dict, (dict(self),)


class FrozenList(list[Any]):
    """A list whose in-place changes raise `TypeError` (module docstring)."""

    __slots__ = ()
    __setitem__ = __delitem__ = __iadd__ = __imul__ = append = clear = extend = insert = pop = remove = reverse = \
        sort = _refuse

    def __copy__(self) -> list[Any]:
        return list(self)

    def __deepcopy__(self, memo: dict[int, Any]) -> list[Any]:
        return [copy.deepcopy(value, memo) for value in self]

    def __reduce__(self) -> tuple[Any, ...]:
        return list, (list(self),)


def freeze(value: Any) -> Any:
    """A frozen copy of the JSON value `value`: its dicts and lists at any depth (tuples stay tuples, of frozen
    items; strings and numbers are kept: they cannot change). It equals `value`."""
    if isinstance(value, dict):
        frozen = FrozenDict()
        for key, item in value.items():  # dict.__setitem__: the class's own refuses
            dict.__setitem__(frozen, key, freeze(item))
        return frozen
    if isinstance(value, list):
        return FrozenList(freeze(item) for item in value)
    if isinstance(value, tuple):  # immutable itself, not what it holds
        return tuple(freeze(item) for item in value)
    return value
