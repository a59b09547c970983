"""Arrow columns built straight from their buffers: what Arrow's conversion of Python values stores, without its
per-call machinery, which is most of the cost of the few values of one appended event (a captured turn's
columns are converted once per model call).
"""

from __future__ import annotations

import functools
import itertools
from datetime import datetime, timedelta, timezone

import numpy as np
import pyarrow as pa

INT32_MAX = 2**31 - 1
_INT32 = pa.int32()
_STRING = pa.string()


@functools.lru_cache(maxsize=2048)
def nulls(n: int, typ: pa.DataType) -> pa.Array:
    """An all-null column (Arrow arrays are immutable, so the common small ones are shared)."""
    return pa.nulls(n, typ)


def numpy_column(values: np.ndarray, typ: pa.DataType) -> pa.Array:
    """A 1-d numpy array of `typ`'s width as a column without nulls, sharing its buffer: cheaper than `pa.array`,
    whose conversion machinery is most of the cost of a column of a few values."""
    return pa.Array.from_buffers(typ, len(values), [None, pa.py_buffer(values)])


_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_MICROSECOND = timedelta(microseconds=1)


def time_column(times: list[datetime], typ: pa.TimestampType) -> pa.Array:
    """UTC times as microseconds since 1970 in exact integer arithmetic: the values Arrow's conversion of
    datetimes stores, at a fraction of its cost (it looks the time zone up for every call)."""
    return numpy_column(np.array([(t - _EPOCH) // _MICROSECOND for t in times], dtype=np.int64), typ)


def string_columns(strings: list[tuple[str, list[str | None]]], n: int) -> dict[str, pa.Array]:
    """Columns of `n` strings each, built as one string array and sliced apart: a dozen conversions of one value
    cost more than the one of a dozen values. The array is made from the texts' UTF-8 bytes directly: what Arrow's
    conversion stores, without its setup per call (a lone surrogate raises UnicodeEncodeError all the same)."""
    if not strings:
        return {}
    texts = [v for _, values in strings for v in values]
    data = [b"" if v is None else v.encode() for v in texts]
    offsets = np.fromiter(itertools.accumulate(map(len, data), initial=0), np.int64, len(data) + 1)
    if offsets[-1] >= INT32_MAX:  # over 2 GiB, more than one string array holds: column by column
        return {name: pa.array(values, _STRING) for name, values in strings}
    validity = None if None not in texts else pa.array([v is not None for v in texts]).buffers()[1]
    flat = pa.Array.from_buffers(_STRING, len(texts), [validity, pa.py_buffer(offsets.astype(np.int32)),
                                                       pa.py_buffer(b"".join(data))], null_count=texts.count(None))
    return {name: flat.slice(k * n, n) for k, (name, _) in enumerate(strings)}


def lengths(column: pa.ListArray) -> np.ndarray:
    """Per row: the list's length (0 for a null row), from the offsets, without a compute call."""
    if column.null_count == len(column):
        return np.zeros(len(column), dtype=np.int32)
    offsets = column.offsets.to_numpy()
    return (offsets[1:] - offsets[:-1]).astype(np.int32, copy=False)


def count_column(counts: np.ndarray, of: pa.Array) -> pa.Array:
    """Counts as an int32 column, null where the list they count is null (events without tokens)."""
    if not of.null_count:
        return numpy_column(counts.astype(np.int32, copy=False), _INT32)
    if of.null_count == len(of):
        return nulls(len(of), _INT32)
    return pa.array(counts, _INT32, mask=of.is_null().to_numpy(zero_copy_only=False))
