"""Strict conversion of token lists (Python lists, numpy or Arrow arrays) to Arrow list columns.

Token lists are converted strictly: a float, bool or null among token ids is an error,
never silently made an integer (a typed `pa.array(values, list<int32>)` turns 1.5 into 1,
and numpy's astype wraps 2**32 to 0). A column of Python lists goes through Arrow's type
inference in one call, which keeps ints, floats, bools and nulls apart at C speed; a
column of numpy (or Arrow) arrays is checked per row by dtype and concatenated once.
Either way the range of token ids is checked before they are narrowed to int32. Short lists
of plain ints or plain floats (a captured turn's) skip the inference: their element types are
checked exactly, then numpy converts them (`_from_exact_lists`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from trajstore.arrow_columns import INT32_MAX, numpy_column

# The list columns and what their elements must be.
ELEMENT = {"prompt_ids": "int", "output_ids": "int", "output_logprobs": "float", "output_mask": "bool",
           "teacher_logprobs": "float", "support_sizes": "int", "support_ids": "int"}

_NOUN = {"int": "integers", "float": "numbers", "bool": "booleans"}
_INT32_LIST = pa.list_(pa.int32())
_NUMPY = {"int": np.int64, "float": np.float32, "bool": np.bool_}


def _arrow_type_ok(typ: pa.DataType, element: str) -> bool:
    if pa.types.is_null(typ):  # the lists are all empty
        return True
    if element == "int":
        return pa.types.is_integer(typ)
    if element == "float":
        return pa.types.is_integer(typ) or pa.types.is_floating(typ)
    return pa.types.is_boolean(typ)


def _dtype_ok(dtype: np.dtype, element: str) -> bool:
    if element == "int":
        return dtype.kind in "iu"
    if element == "float":
        return dtype.kind in "iuf"
    return dtype.kind in "biuf"  # a numpy mask may be 0/1 numbers: nonzero is trainable


def _bad_item(values: Sequence[Any], element: str) -> str:
    """Why a Python list is not a list of `element`s, naming the first offending item."""
    allowed: tuple[type, ...] = {
        "int": (int, np.integer), "float": (int, float, np.integer, np.floating), "bool": (bool, np.bool_),
    }[element]
    for j, x in enumerate(values):
        if not isinstance(x, allowed) or (element != "bool" and isinstance(x, (bool, np.bool_))):
            return f"must hold {_NOUN[element]} (item {j} is {x!r})"
    return f"must hold token ids between 0 and {INT32_MAX}"  # only ints left: one is beyond 64 bits


def row_array(value: Any, element: str) -> tuple[np.ndarray | None, str]:
    """One row's list as a flat numpy array, or (None, why it is not a list of `element`s)."""
    if isinstance(value, (pa.Array, pa.ChunkedArray)):
        if value.null_count:
            return None, f"must hold {_NOUN[element]}, not nulls"
        if not _arrow_type_ok(value.type, element):
            return None, f"must hold {_NOUN[element]}, not {value.type} values"
        if pa.types.is_null(value.type):
            return np.empty(0, _NUMPY[element]), ""
        return value.to_numpy(zero_copy_only=False), ""
    if isinstance(value, (list, tuple)):
        if not value:
            return np.empty(0, _NUMPY[element]), ""
        if len(value) > LONG_LISTS:  # a slice at a time (see `_in_slices`); anything odd goes the checked way below
            sliced = _in_slices(value)
            if sliced is not None and _dtype_ok(sliced.dtype, element):
                return sliced, ""
        try:
            arr = pa.array(value)  # inference, not a typed conversion: see above
        except (pa.ArrowException, TypeError, ValueError, OverflowError):
            return None, _bad_item(value, element)
        if arr.null_count or not _arrow_type_ok(arr.type, element):
            return None, _bad_item(value, element)
        return arr.to_numpy(zero_copy_only=False), ""
    try:
        arr = np.asarray(value)  # numpy arrays, and whatever speaks the array protocol
    except (TypeError, ValueError, RuntimeError) as exc:
        return None, f"must be a list of {_NOUN[element]} ({exc})"
    if arr.ndim != 1:
        return None, f"must be a flat list, not a {arr.ndim}-d array"
    if arr.size == 0:  # np.array([]) is float64; an empty list has no elements to be wrong
        return np.empty(0, _NUMPY[element]), ""
    if not _dtype_ok(arr.dtype, element):
        return None, f"must hold {_NOUN[element]}, not {arr.dtype} values"
    if arr.dtype == np.uint64:  # with signed rows it would concatenate to float64
        if element == "int" and arr.max() > INT32_MAX:
            return None, f"must hold token ids between 0 and {INT32_MAX}"
        arr = arr.astype(np.int64)
    return arr, ""


def _id_range_problems(name: str, flat: np.ndarray, lengths: np.ndarray) -> list[tuple[int, str]]:
    """Rows whose token ids fall outside [0, INT32_MAX] (checked before narrowing to int32)."""
    if not flat.size or (flat.min() >= 0 and flat.max() <= INT32_MAX):
        return []
    rows = np.repeat(np.arange(len(lengths)), lengths)
    problems = [(int(r), f"{name} holds negative token ids; token ids are >= 0")
                for r in np.unique(rows[flat < 0])]
    problems += [(int(r), f"{name} cannot be stored as {_INT32_LIST}: token ids must be between 0 and {INT32_MAX}")
                 for r in np.unique(rows[flat > INT32_MAX])]
    return problems


def _from_python(name: str, values: list[Any], typ: pa.ListType,
                 element: str) -> tuple[pa.Array | None, list[tuple[int, str]]]:
    """A column of Python lists (or None) in one inference call; (None, []) if it needs a closer look."""
    try:
        arr = pa.array(values)  # inference, not a typed conversion: see above
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        return None, []
    if arr.null_count == len(arr):
        return pa.nulls(len(arr), typ), []
    if not pa.types.is_list(arr.type) or not _arrow_type_ok(arr.type.value_type, element):
        return None, []
    flat = arr.values  # the child array: a fresh array has no offset, and null rows hold no values
    if flat.null_count:
        return None, []
    if element == "int" and len(flat):
        ids = flat.to_numpy()  # a view of the int64 buffer, not a copy
        if ids.min() < 0 or ids.max() > INT32_MAX:
            lengths = pc.list_value_length(arr).fill_null(0).to_numpy()
            return None, _id_range_problems(name, ids, lengths)
        if not arr.null_count:  # in range: narrowing in numpy is twice as fast as Arrow's cast
            return pa.ListArray.from_arrays(arr.offsets, pa.array(ids.astype(np.int32)), type=typ), []
    try:
        return arr.cast(typ), []
    except (pa.ArrowException, OverflowError):  # e.g. an int logprob float32 cannot hold exactly
        return None, []


def _from_rows(name: str, values: list[Any], typ: pa.ListType,
               element: str) -> tuple[pa.Array | None, list[tuple[int, str]]]:
    """A column row by row (numpy or Arrow arrays, or mixed input): checked per row, concatenated once."""
    parts: list[np.ndarray] = []
    lengths = np.zeros(len(values), dtype=np.int64)
    nulls = np.zeros(len(values), dtype=bool)
    problems: list[tuple[int, str]] = []
    for i, value in enumerate(values):
        if value is None:
            nulls[i] = True
            continue
        arr, why = row_array(value, element)
        if arr is None:
            problems.append((i, f"{name} cannot be stored as {typ}: it {why}"))
            continue
        parts.append(arr)
        lengths[i] = len(arr)
    if problems:
        return None, problems
    if nulls.all():
        return pa.nulls(len(values), typ), []
    return _assemble(name, parts, lengths, nulls, typ, element)


def _from_numpy(name: str, values: list[Any], typ: pa.ListType,
                element: str) -> tuple[pa.Array | None, list[tuple[int, str]]]:
    """A column of 1-d numpy arrays of one acceptable dtype (what an engine hands back), checked in bulk."""
    dtypes = {v.dtype for v in values}
    if len(dtypes) != 1 or not all(v.ndim == 1 for v in values):
        return None, []
    dtype = dtypes.pop()
    if not _dtype_ok(dtype, element) or dtype == np.uint64:
        return None, []
    lengths = np.fromiter(map(len, values), dtype=np.int64, count=len(values))
    return _assemble(name, values, lengths, None, typ, element)


def _assemble(name: str, parts: list[np.ndarray], lengths: np.ndarray, nulls: np.ndarray | None,
              typ: pa.ListType, element: str) -> tuple[pa.Array | None, list[tuple[int, str]]]:
    """One list column from checked rows: range-check token ids, narrow, and build the offsets."""
    total = int(lengths.sum())
    if total > INT32_MAX:
        return None, [(0, f"{name}: one append holds {total} values, more than a column can; append fewer events at once")]
    flat = np.concatenate(parts) if parts else np.empty(0, _NUMPY[element])
    if element == "int":
        problems = _id_range_problems(name, flat, lengths)
        if problems:
            return None, problems
        flat = flat.astype(np.int32, copy=False)
    elif element == "float":
        with np.errstate(over="ignore"):  # beyond float32 becomes -inf, as Arrow's conversion does
            flat = flat.astype(np.float32, copy=False)
    else:
        flat = flat.astype(np.bool_, copy=False)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    mask = pa.array(nulls) if nulls is not None and nulls.any() else None
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat), type=typ, mask=mask), []


# Converting Python ints holds the GIL for the whole call (tens of milliseconds for a million ids): lists longer
# than this in all are converted a slice at a time, so that other threads (a server's event loop) run in between.
LONG_LISTS = 1 << 16


def _in_slices(values: list[Any] | tuple[Any, ...]) -> np.ndarray | None:
    """`values` as numpy, converted a `LONG_LISTS` slice at a time by pyarrow's strict inference (the interpreter may
    switch threads between slices); None when a slice does not convert or the slices disagree on the type (mixed
    or wrong values: the whole-column conversion then names the problem)."""
    try:
        parts = pa.chunked_array([pa.array(values[i:i + LONG_LISTS]) for i in range(0, len(values), LONG_LISTS)])
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        return None
    if parts.null_count or not (pa.types.is_integer(parts.type) or pa.types.is_floating(parts.type)
                                or pa.types.is_boolean(parts.type)):
        return None
    return np.concatenate([chunk.to_numpy(zero_copy_only=False) for chunk in parts.chunks])


# What a column of short Python lists may hold for `_from_exact_lists` to take it: exactly these types, so that
# numpy's typed conversion (which would turn True into 1, 1.5 into 1 and "7" into 7) sees nothing it could bend.
_EXACT = {"int": (frozenset({int}), np.int32), "float": (frozenset({float}), np.float32)}


def _from_exact_lists(rows: list[list[Any] | tuple[Any, ...] | None], typ: pa.ListType,
                      element: str) -> pa.Array | None:
    """A column of short Python lists of plain ints (or plain floats), converted by numpy; None if it needs more.

    The capture proxy stores one turn per call, whose lists are a few hundred plain ints and floats: Arrow's
    inference, checks and cast cost five times more than this for them. Only such lists are taken: no other
    type (bools, numpy scalars, ints among logprobs), no id outside [0, INT32_MAX]; anything else returns None
    and goes the checked way, which names the problem. The result is what that way stores, value for value
    (floats are rounded to float32 as Arrow's cast rounds them, beyond its range to infinity).
    """
    allowed, dtype = _EXACT[element]
    present = [v for v in rows if v is not None]
    if not present:
        return None
    flat = present[0] if len(present) == 1 else [x for v in present for x in v]
    if not allowed.issuperset(map(type, flat)):
        return None
    if element == "int":
        try:
            values = np.array(flat, dtype=dtype)
        except OverflowError:  # beyond int32
            return None
        if values.size and values.min() < 0:
            return None
    else:
        with np.errstate(over="ignore"):  # beyond float32 becomes infinity, as Arrow's cast makes it
            values = np.array(flat, dtype=dtype)
    offsets = np.fromiter(itertools.accumulate((0 if v is None else len(v) for v in rows), initial=0), np.int32,
                          len(rows) + 1)
    validity = None if len(present) == len(rows) else pa.array([v is not None for v in rows]).buffers()[1]
    child = numpy_column(values, typ.value_type)
    return pa.Array.from_buffers(typ, len(rows), [validity, pa.py_buffer(offsets)],
                                 null_count=len(rows) - len(present), children=[child])


def list_column(name: str, values: list[Any], typ: pa.ListType) -> tuple[pa.Array | None, list[tuple[int, str]]]:
    """Convert one token/logprob/mask column strictly; returns (column, []) or (None, problems).

    The fast paths answer only when the whole column is clean; anything else (mixed input,
    a bad row) goes row by row, which names each offending row.
    """
    element = ELEMENT[name]
    python_lists = all(v is None or type(v) is list or type(v) is tuple for v in values)
    total = sum(len(v) for v in values if v is not None) if python_lists else 0
    if python_lists and total > LONG_LISTS:
        sliced = [v if v is None else _in_slices(v) for v in values]
        if all(v is not None for v, given in zip(sliced, values) if given is not None):  # else: as one, below
            values = sliced
    if all(type(v) is np.ndarray for v in values):
        arr, problems = _from_numpy(name, values, typ, element)
        if arr is not None or problems:
            return arr, problems
    elif python_lists:
        arr = _from_exact_lists(values, typ, element) if element in _EXACT and total <= LONG_LISTS else None
        if arr is not None:
            return arr, []
        arr, problems = _from_python(name, values, typ, element)
        if arr is not None or problems:
            return arr, problems
    return _from_rows(name, values, typ, element)
