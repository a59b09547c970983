"""Typed events, their validation, and their conversion to Arrow columns.

An event is either one of the frozen dataclasses below (`Turn`, `Reward`, `Status`,
`Checkpoint`, `Metric`, `Teacher`) or a plain dict shaped like a JSON line of `trajstore ingest`. Both
are validated once, at the store's edge: `to_columns` (what `Writer.prepare` and `Writer.append` call, through `trajstore.prepared`) checks a
whole call at once and reports every problem; it never returns a partial batch. Building a
typed event checks nothing, so a token list is read once on its way to the log. Checks that are O(1) per event run in Python; checks over token lists
(non-negative ids, logprob range, element types) run vectorized on the Arrow columns
(`trajstore.tokens` converts the lists strictly), so validation stays far cheaper than the
fsync that follows it. The JSON columns' text is `trajstore.json_text`'s.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, ClassVar, Union

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from trajstore import ids, requests, routes, versions
from trajstore.arrow_columns import (
    INT32_MAX,
    count_column,
    lengths,
    nulls,
    numpy_column,
    string_columns,
    time_column,
)
from trajstore.errors import InvalidEventError
from trajstore.json_text import json_text
from trajstore.schema import (
    COLUMNS,
    COUNT_COLUMNS,
    EVENT_SCHEMA,
    FINISH_REASONS,
    JSON_COLUMNS,
    KINDS,
    STATUSES,
    WRITER_COLUMNS,
)
from trajstore.tokens import ELEMENT, list_column, row_array

TokenList = Union[Sequence[int], np.ndarray, pa.Array]
FloatList = Union[Sequence[float], np.ndarray, pa.Array]

# Fields each kind must carry (besides `kind`); everything else is optional.
REQUIRED: dict[str, tuple[str, ...]] = {
    "turn": ("group_id", "rollout_id", "segment_id", "turn_index", "policy_version",
             "prompt_ids", "output_ids", "output_logprobs"),
    "reward": ("group_id", "rollout_id", "reward"),
    "status": ("group_id", "rollout_id", "status"),
    "checkpoint": ("policy_version", "step"),
    "metric": ("step", "metrics"),
    "teacher": ("group_id", "rollout_id", "segment_id", "turn_index", "policy_version", "teacher",
                "teacher_logprobs"),
}
SUPPLIABLE: frozenset[str] = frozenset(COLUMNS) - WRITER_COLUMNS - COUNT_COLUMNS
_ID_FIELDS = ("event_id", "run", "group_id", "rollout_id", "session_id", "segment_id", "reward_name", "teacher",
              "request_base")
_INT_FIELDS = ("turn_index", "policy_version", "group_size", "step", "table_version")
_LOGPROB_SLACK = 1e-4  # float rounding can push log(1) a hair above zero
# Sampling support (`support_sizes`, `support_ids`): a kept set of at most this many ids is stored id by id
# (exact whatever the learner's numerics); a larger one by its size m alone, as "the m most likely tokens".
# Part of the columns' format: every writer and reader uses this one value (prime-rl keeps 512 ids too).
SUPPORT_IDS_CAP = 512
_LOGPROB_LISTS = ("output_logprobs", "teacher_logprobs")
_FIELD_NAMES: dict[type, tuple[str, ...]] = {}
_LIST_FIELDS = tuple(ELEMENT)


@dataclass(frozen=True, kw_only=True)
class _Event:
    run: str = "default"
    event_id: str | None = None
    time: datetime | str | None = None
    meta: Mapping[str, Any] | None = None

    kind: ClassVar[str]

    def record(self) -> dict[str, Any]:
        """The event as a dict of columns (what `to_columns` consumes, through `as_record`)."""
        names = _FIELD_NAMES.get(type(self))
        if names is None:  # dataclasses.fields() is slow enough to matter once per appended event
            names = _FIELD_NAMES[type(self)] = tuple(f.name for f in dataclasses.fields(self))
        rec = {name: getattr(self, name) for name in names}
        rec["kind"] = self.kind
        return rec


@dataclass(frozen=True, kw_only=True)
class Turn(_Event):
    """One model call: the prompt tokens added before it and the tokens it sampled."""

    kind: ClassVar[str] = "turn"
    group_id: str
    rollout_id: str
    segment_id: str
    turn_index: int
    policy_version: int
    prompt_ids: TokenList
    output_ids: TokenList
    output_logprobs: FloatList
    output_mask: Sequence[bool] | np.ndarray | None = None
    session_id: str | None = None
    finish_reason: str | None = None
    sampling: Mapping[str, Any] | None = None
    request: Any = None
    response: Any = None
    # mixture-of-experts policies: the experts behind each token (`trajstore.routes`; `turn_columns` fills both)
    routed_experts: Sequence[int] | np.ndarray | None = None
    routed_experts_shape: Sequence[int] | None = None
    # the kept set of each sampled token when the call sampled from a truncated distribution (CSR:
    # one size per output token, 0 = not recorded; the ids concatenated), as `sampling_support` packs it
    support_sizes: TokenList | None = None
    support_ids: TokenList | None = None
    # when the weights changed during the call: where each version's tokens begin (`trajstore.versions`)
    output_version_starts: Sequence[int] | None = None
    output_version_values: Sequence[int] | None = None
    # a request stored as a delta of the session's earlier turn `request_base` (`trajstore.requests`); None: whole
    request_base: str | None = None
    request_shared: int | None = None
    request_kept: Sequence[str] | None = None  # members left out of `request`: the base's full request's, unchanged


@dataclass(frozen=True, kw_only=True)
class Reward(_Event):
    """One reward component of a rollout (or, with segment_id, of one segment)."""

    kind: ClassVar[str] = "reward"
    group_id: str
    rollout_id: str
    reward: float
    reward_name: str = "reward"
    segment_id: str | None = None


@dataclass(frozen=True, kw_only=True)
class Status(_Event):
    """A rollout's status; the latest one counts. `group_size` says how many rollouts the group plans."""

    kind: ClassVar[str] = "status"
    group_id: str
    rollout_id: str
    status: str
    error: str | None = None
    group_size: int | None = None


@dataclass(frozen=True, kw_only=True)
class Checkpoint(_Event):
    """A published checkpoint and the rollouts trained into it since the previous one."""

    kind: ClassVar[str] = "checkpoint"
    policy_version: int
    step: int
    consumed: Sequence[str] = field(default_factory=tuple)
    table_version: int | None = None
    metrics: Mapping[str, float] | None = None


@dataclass(frozen=True, kw_only=True)
class Metric(_Event):
    """Named scalar values of one learner step (loss, clip fraction, ...)."""

    kind: ClassVar[str] = "metric"
    step: int
    metrics: Mapping[str, float]
    policy_version: int | None = None
    table_version: int | None = None
    consumed: Sequence[str] | None = None


@dataclass(frozen=True, kw_only=True)
class Teacher(_Event):
    """A teacher's logprob of each output token of one turn, appended after the fact (`trajstore annotate`).

    Keyed by the turn it scores (rollout_id, segment_id, turn_index) and filed under `teacher`, a
    name; the turn's group_id and policy_version come along so that a training shard, which reads
    by group and version, finds it beside the turn. The `teacher_logprobs` view aligns it with the
    sample's tokens."""

    kind: ClassVar[str] = "teacher"
    group_id: str
    rollout_id: str
    segment_id: str
    turn_index: int
    policy_version: int
    teacher: str
    teacher_logprobs: FloatList


Event = Union[Turn, Reward, Status, Checkpoint, Metric, Teacher]
EVENT_TYPES: dict[str, type[_Event]] = {t.kind: t for t in (Turn, Reward, Status, Checkpoint, Metric, Teacher)}


def _length(value: Any) -> int | None:
    try:
        return len(value)
    except TypeError:
        return None


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


_PLAIN_LISTS = (list, tuple, np.ndarray)


def _not_a_list(value: Any) -> bool:
    if type(value) in _PLAIN_LISTS:  # the common case, without the slow Mapping (ABC) check
        return False
    return isinstance(value, (str, bytes, Mapping)) or _length(value) is None


def check_record(rec: Mapping[str, Any]) -> list[str]:
    """Structural checks of one event dict, O(1) per event. Returns the problems found.

    Runs once per appended event, so each check has a fast path for the valid case first.
    """
    kind = rec.get("kind")
    if kind not in KINDS:
        return [f"kind {kind!r} is not one of {sorted(KINDS)}"]
    problems: list[str] = []
    if not SUPPLIABLE.issuperset(rec):
        unknown = set(rec) - SUPPLIABLE
        filled = unknown & (WRITER_COLUMNS | COUNT_COLUMNS)
        other = sorted(unknown - filled)
        if other:
            problems.append(f"unknown field(s) {other}; the columns are listed in schemas/events.v1.json")
        if filled:
            problems.append(f"field(s) {sorted(filled)} are filled by the store; leave them out")
    get = rec.get
    for name in REQUIRED[kind]:
        if get(name) is None:
            problems.append(f"a {kind} event needs {name!r}")
    for name in _ID_FIELDS:
        value = get(name)
        if value is None or (type(value) is str and value):
            continue
        if not isinstance(value, str) or not value:
            problems.append(f"{name} must be a non-empty string, got {value!r}")
    for name in _INT_FIELDS:
        value = get(name)
        if value is None or (type(value) is int and 0 <= value <= INT32_MAX):
            continue
        if not _is_int(value):
            problems.append(f"{name} must be an integer, got {value!r}")
        elif value < 0 or (name == "turn_index" and value > INT32_MAX):
            problems.append(f"{name} must be between 0 and {INT32_MAX}, got {value}")
    group_size = get("group_size")
    if group_size is not None and _is_int(group_size) and group_size < 1:
        problems.append("group_size must be at least 1")
    status = get("status")
    if status is not None and status not in STATUSES:
        problems.append(f"status {status!r} is not one of {sorted(STATUSES)}")
    finish = get("finish_reason")
    if finish is not None and finish not in FINISH_REASONS:
        problems.append(f"finish_reason {finish!r} is not one of {sorted(FINISH_REASONS)}")
    reward = get("reward")
    if reward is not None:
        if not isinstance(reward, (int, float, np.floating, np.integer)) or isinstance(reward, bool):
            problems.append(f"reward must be a number, got {reward!r}")
        elif not math.isfinite(reward):
            problems.append(f"reward must be finite, got {reward!r}")
    metrics = get("metrics")
    if metrics is not None:
        if not isinstance(metrics, Mapping):
            problems.append(f"metrics must be an object of name -> number, got {type(metrics).__name__}")
        else:
            bad = [k for k, v in metrics.items() if not isinstance(k, str) or isinstance(v, bool)
                   or not isinstance(v, (int, float, np.floating, np.integer))]
            if bad:
                problems.append(f"metrics must map names to numbers; bad entries: {bad[:5]}")
    consumed = get("consumed")
    if consumed is not None and (isinstance(consumed, (str, bytes)) or _length(consumed) is None):
        problems.append("consumed must be a list of rollout ids")
    for name in _LIST_FIELDS:
        value = get(name)
        if value is not None and _not_a_list(value):
            problems.append(f"{name} must be a list, got {type(value).__name__}")
    n_out, n_lp = _length(get("output_ids")), _length(get("output_logprobs"))
    if n_out is not None and n_lp is not None and n_out != n_lp:
        problems.append(f"output_ids has {n_out} tokens but output_logprobs has {n_lp} values; they must be equal")
    mask = get("output_mask")
    if mask is not None:
        n_mask = _length(mask)
        if n_out is not None and n_mask is not None and n_mask != n_out:
            problems.append(f"output_mask has {n_mask} values but output_ids has {n_out} tokens; they must be equal")
    problems += _support_problems(get("support_sizes"), get("support_ids"), n_out)
    if kind == "turn" and n_out == 0:
        problems.append("a turn must have at least one output token")
    if get("routed_experts") is not None or get("routed_experts_shape") is not None:
        problems += routes.problems(rec)
    if get(versions.STARTS) is not None or get(versions.VALUES) is not None:
        problems += versions.span_problems(rec)
    if get("request_base") is not None or get("request_shared") is not None or get("request_kept") is not None:
        problems += requests.delta_problems(rec)
    return problems


def _support_problems(sizes: Any, ids: Any, n_out: int | None) -> list[str]:
    """support_sizes and support_ids come together, one size per output token; the sizes of at most
    SUPPORT_IDS_CAP sum to the number of ids."""
    if sizes is None and ids is None:
        return []
    if sizes is None or ids is None:
        return ["support_sizes and support_ids go together: give both (the sampled tokens' kept sets) or neither"]
    n_sizes, n_ids = _length(sizes), _length(ids)
    if n_sizes is None or n_ids is None:
        return []  # not lists: reported with the other list fields
    problems = []
    if n_out is not None and n_sizes != n_out:
        problems.append(f"support_sizes has {n_sizes} values but output_ids has {n_out} tokens; they must be equal")
    arr, _ = row_array(sizes, "int")
    if arr is not None and arr.size:
        stored = int(arr[arr <= SUPPORT_IDS_CAP].sum())
        if arr.min() < 0 or stored != n_ids:
            problems.append(f"support_sizes must be >= 0, and those of at most {SUPPORT_IDS_CAP} must sum to the "
                            f"{n_ids} values of support_ids (they sum to {stored})")
    return problems


def _check_token_values(rec: Mapping[str, Any]) -> list[str]:
    """Element checks for one structurally broken event, so that its report is complete (sound
    events are checked per column during conversion)."""
    problems = []
    for name in ("prompt_ids", "output_ids"):
        value = rec.get(name)
        if value is None or _not_a_list(value):
            continue
        arr, why = row_array(value, "int")
        if arr is None:
            problems.append(f"{name} {why}")
        elif arr.size and (arr.min() < 0 or arr.max() > INT32_MAX):
            problems.append(f"{name} must hold token ids between 0 and {INT32_MAX}")
    for name in _LOGPROB_LISTS:
        value = rec.get(name)
        if value is not None and not _not_a_list(value):
            arr, why = row_array(value, "float")
            if arr is None:
                problems.append(f"{name} {why}")
            elif arr.size and (np.isnan(arr).any() or arr.max() > _LOGPROB_SLACK):
                problems.append(f"{name} must be log probabilities (<= 0, not NaN)")
    value = rec.get("output_mask")
    if value is not None and not _not_a_list(value):
        arr, why = row_array(value, "bool")
        if arr is None:
            problems.append(f"output_mask {why}")
    return problems


# The latest time the store keeps: sealed files record the newest time rounded up to the
# millisecond (Delta's statistics resolution), and that must still be a time Python can hold.
LAST_TIME = datetime(9999, 12, 31, 23, 59, 59, 999000, tzinfo=timezone.utc)


def _to_time(value: Any, now: datetime) -> datetime:
    if value is None:
        return now
    if isinstance(value, str):
        value = datetime.fromisoformat(value.replace("Z", "+00:00"))
    if not isinstance(value, datetime):
        raise TypeError(f"time must be an ISO 8601 string or a datetime, got {value!r}")
    try:
        value = value.astimezone(timezone.utc) if value.tzinfo else value.replace(tzinfo=timezone.utc)
    except OverflowError:
        raise ValueError(f"{value.isoformat()} falls outside years 1-9999 in UTC") from None
    if value > LAST_TIME:
        raise ValueError(f"{value.isoformat()} is after {LAST_TIME.isoformat(timespec='milliseconds')}, "
                         "the latest time the store keeps")
    return value


def _rows_failing(values: list[Any], typ: pa.DataType) -> list[int]:
    bad = []
    for i, v in enumerate(values):
        try:
            pa.array([v], type=typ)
        except (pa.ArrowException, TypeError, ValueError, OverflowError):  # UnicodeEncodeError is a ValueError
            bad.append(i)
    return bad


def _vector_checks(columns: dict[str, pa.Array]) -> list[tuple[int, str]]:
    """Value checks over whole list columns; returns (row, problem) for every failing row.

    (Token id ranges are checked during conversion, before the ids are narrowed to int32.)
    """
    problems: list[tuple[int, str]] = []
    for name in _LOGPROB_LISTS:
        lp = columns.get(name)  # missing when its conversion failed (already reported)
        if lp is None or lp.null_count == len(lp):
            continue
        values = lp.values.to_numpy()  # a view of the float32 buffer, not a copy
        if not values.size:
            continue
        if not values.max() <= _LOGPROB_SLACK:  # NaN as well (the max of values holding one): rows only when some fail
            flat = pc.list_flatten(lp)
            bad = pc.or_(pc.is_nan(flat), pc.greater(flat, _LOGPROB_SLACK))
            if pc.any(bad).as_py():
                rows = pc.list_parent_indices(lp).filter(bad)
                for row in sorted(set(rows.to_pylist())):
                    problems.append((row, f"{name} must be log probabilities (<= 0, not NaN)"))
    return problems


def as_record(event: Event | Mapping[str, Any]) -> dict[str, Any]:
    """An event as a column dict, whether it came as a typed event or a plain dict."""
    if isinstance(event, _Event):
        return event.record()
    if isinstance(event, Mapping):
        return dict(event)
    raise TypeError(f"an event must be a Turn, Reward, Status, Checkpoint, Metric, Teacher or a dict, got {type(event).__name__}")


_DEFAULTED = frozenset({"event_id", "run", "reward_name", "time"})  # filled in when missing


def to_columns(events: Sequence[Event | Mapping[str, Any]], *, now: datetime | None = None) -> dict[str, pa.Array]:
    """Validate events and convert them to Arrow columns (without the writer columns).

    Raises InvalidEventError listing every problem of every event; nothing is returned then.
    Missing event_id gets a new time-ordered id, missing time gets `now`, missing run "default".
    """
    now = now or datetime.now(timezone.utc)
    problems: list[tuple[int, str]] = []
    records: list[dict[str, Any] | None] = []
    for i, event in enumerate(events):
        try:
            rec = as_record(event)
        except TypeError as exc:
            problems.append((i, str(exc)))
            records.append(None)
            continue
        for p in check_record(rec):
            problems.append((i, p))
        records.append(rec)
    if problems:
        # Report every problem of the call at once: the element checks still run, on their
        # own for the events above and converted together for the sound ones.
        bad = {i for i, _ in problems}
        for i in sorted(bad):
            rec = records[i]
            if rec is not None:
                problems += [(i, p) for p in _check_token_values(rec)]
        good = [i for i in range(len(records)) if i not in bad]
        if good:
            try:
                _convert([records[i] for i in good], now)  # type: ignore[misc]
            except InvalidEventError as exc:
                problems += [(good[j], p) for j, p in exc.problems]
        raise InvalidEventError(sorted(problems))
    return _convert(records, now)  # type: ignore[arg-type]


_TYPES = {f.name: f.type for f in EVENT_SCHEMA}
# The columns `_convert` builds: everything but what the writer and the counts fill in.
_CONVERTED = tuple(n for n in COLUMNS if n not in WRITER_COLUMNS and n not in COUNT_COLUMNS)
_STRING = pa.string()
# Text columns stored as given (ids, kinds, names): most of a turn's columns, sent straight to `string_columns`
_TEXT = frozenset(name for name in _CONVERTED if _TYPES[name] == _STRING) - _DEFAULTED - JSON_COLUMNS


# Integer columns and their numpy type: a column of plain Python ints converts through numpy at a third of the
# cost of Arrow's typed conversion of a list (which also reads an environment variable each time).
_PLAIN_INTS = {name: np.dtype(_TYPES[name].to_pandas_dtype()) for name in _CONVERTED
               if _TYPES[name] in (pa.int32(), pa.int64())}


@functools.lru_cache(maxsize=64)
def _null_columns(n: int) -> Mapping[str, pa.Array]:
    """Every converted column, all null, for `n` events: what a call starts from, so that the columns none of
    its events fill in (most of them, for any one kind) cost nothing per call. Copied before it is changed."""
    return {name: nulls(n, _TYPES[name]) for name in _CONVERTED}


def _convert(records: list[dict[str, Any]], now: datetime) -> dict[str, pa.Array]:
    """Structurally sound records to columns; raises InvalidEventError for bad values."""
    problems: list[tuple[int, str]] = []
    n = len(records)
    given = {name for r in records for name, v in r.items() if v is not None}  # a typed event's unset fields: None
    columns = dict(_null_columns(n))  # a failed column stays null, which the vector checks skip
    strings: list[tuple[str, list[str | None]]] = []  # converted together, below
    for name in _CONVERTED:
        if name not in given and name not in _DEFAULTED:
            continue
        values = [r.get(name) for r in records]
        typ = _TYPES[name]
        if name in _TEXT and all(v is None or type(v) is str for v in values):  # converted together, below
            strings.append((name, values))
            continue
        if name in ELEMENT:
            column, found = list_column(name, values, typ)
            problems += found
            if column is not None:
                columns[name] = column
            continue
        if name == "event_id":
            values = [v if v is not None else ids.new_id() for v in values]
        elif name == "run":
            values = [v if v is not None else "default" for v in values]
        elif name == "reward_name":
            values = [v if v is not None or r["kind"] != "reward" else "reward" for v, r in zip(values, records)]
        elif name == "time":
            converted = []
            for i, v in enumerate(values):
                try:
                    converted.append(_to_time(v, now))
                except (TypeError, ValueError) as exc:
                    problems.append((i, f"time: {exc}; use ISO 8601 such as 2026-01-31T12:00:00Z"))
                    converted.append(now)
            if all(type(v) is datetime and v.tzinfo is timezone.utc for v in converted):  # not a subclass's ns
                columns[name] = time_column(converted, typ)
                continue
            values = converted
        elif name in JSON_COLUMNS:
            texts = []
            for i, v in enumerate(values):
                try:
                    texts.append(json_text(v))
                except (RecursionError, ValueError, TypeError) as exc:  # nested too deeply, a circular reference,
                    # or a dict key JSON cannot name (a tuple)
                    problems.append((i, f"{name} cannot be written as JSON ({exc}); keep it to plain, "
                                        "moderately nested values"))
                    texts.append(None)
            values = texts
        elif name == "metrics":
            values = [None if v is None else [(k, float(x)) for k, x in v.items()] for v in values]
        elif name in ("consumed", "request_kept"):
            values = [None if v is None else list(v) for v in values]
        elif name == "routed_experts":  # checked by `routes.problems` already; numpy in, one buffer out
            columns[name] = routes.column(values)
            continue
        if values.count(None) == n:  # JSON columns given as None
            continue
        if typ == _STRING and all(v is None or type(v) is str for v in values):
            strings.append((name, values))
            continue
        if name in _PLAIN_INTS and all(type(v) is int for v in values):
            try:
                columns[name] = numpy_column(np.array(values, dtype=_PLAIN_INTS[name]), typ)
                continue
            except OverflowError:  # beyond the column's type: the conversion below names it
                pass
        try:
            columns[name] = pa.array(values, type=typ)
        except (pa.ArrowException, TypeError, ValueError, OverflowError) as exc:
            for row in _rows_failing(values, typ) or range(n):
                problems.append((row, f"{name} cannot be stored as {typ}: {exc}"))
    try:
        columns.update(string_columns(strings, n))
    except UnicodeEncodeError:  # a lone surrogate ("\ud800") is not text any store can hold: name where it is
        for name, values in strings:
            for row in _rows_failing(values, _STRING):
                problems.append((row, f"{name} holds a lone UTF-16 surrogate, which is not Unicode text; "
                                      "send valid UTF-8"))
    problems += _vector_checks(columns)  # also when another column failed: every problem is reported
    if problems:
        raise InvalidEventError(sorted(problems))
    prompt_len = lengths(columns["prompt_ids"])
    out_len = lengths(columns["output_ids"])
    columns["prompt_tokens"] = count_column(prompt_len, columns["prompt_ids"])
    columns["output_tokens"] = count_column(out_len, columns["output_ids"])
    mask = columns["output_mask"]
    columns["trainable_tokens"] = (columns["output_tokens"] if mask.null_count == len(mask)  # all of them
                                   else _trainable_counts(mask, out_len, columns["output_ids"]))
    return columns


def _trainable_counts(mask: pa.Array, out_len: np.ndarray, output_ids: pa.Array) -> pa.Array:
    """Per row: output tokens the mask leaves trainable (all of them where the mask is null)."""
    counts = out_len.astype(np.int64)
    has_mask = mask.is_valid().to_numpy(zero_copy_only=False)
    flat = mask.values.to_numpy(zero_copy_only=False)
    parents = np.repeat(np.arange(len(mask)), lengths(mask))
    marked = np.bincount(parents, weights=flat, minlength=len(mask)).astype(np.int64)
    return count_column(np.where(has_mask, marked, counts), output_ids)