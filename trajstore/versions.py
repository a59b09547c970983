"""Per-token policy versions of a turn, stored run-length: which weights sampled each output token.

A policy server may load new weights while a call is generating (the embedded server swaps
them between decode steps; vLLM's keep-mode pause freezes requests and resumes them on the
new weights). Such a turn's output tokens then come from more than one version. The turn
stores where each version began, as two parallel lists:

    output_version_starts = [0, 37]      # output index at which each version began
    output_version_values = [4, 5]       # the version of each span

Tokens 0..36 were sampled by version 4, tokens 37.. by version 5. Both columns are null when a
single version sampled every token (`policy_version`), which is also how turns written before
the columns read. Versions only go up, so `policy_version` (the first token's version) is the
oldest version of a turn, and staleness rules that take the oldest version of a sample (the
admission of new groups, the learner's choice of fresh groups) read `policy_version` as before.

`span_problems` checks a record's spans (`trajstore.events.check_record` calls it);
`expand` turns spans into one version per token (the `turns` view's `output_versions` does the
same in SQL, `OUTPUT_VERSIONS_SQL`); `compact` turns a per-token list into spans.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from numbers import Integral
from typing import Any

STARTS, VALUES = "output_version_starts", "output_version_values"
MAX_VERSION = 2**63 - 1
MAX_START = 2**31 - 1

# SQL over a turn row: the version of each output token (list<int64>, as long as output_ids).
OUTPUT_VERSIONS_SQL = (
    f"CASE WHEN {STARTS} IS NULL THEN list_transform(output_ids, lambda x: policy_version) "
    f"ELSE list_transform(range(len(output_ids)), "
    f"lambda i: {VALUES}[len(list_filter({STARTS}, lambda s: s <= i))]) END"
)
# SQL over a turn row: the version of its newest token.
NEWEST_VERSION_SQL = f"coalesce({VALUES}[-1], policy_version)"


def _is_int(value: Any) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def span_problems(rec: Mapping[str, Any]) -> list[str]:
    """What is wrong with a record's version spans (none when both columns are absent)."""
    starts, values = rec.get(STARTS), rec.get(VALUES)
    if starts is None and values is None:
        return []
    if starts is None or values is None:
        return [f"{STARTS} and {VALUES} go together: give both (one span per version) or neither (one version)"]
    try:
        starts, values = list(starts), list(values)
    except TypeError:
        return [f"{STARTS} and {VALUES} must be lists of integers"]
    if not all(isinstance(x, Integral) and not isinstance(x, bool) for x in [*starts, *values]):
        return [f"{STARTS} and {VALUES} must be lists of integers"]
    starts, values = [int(x) for x in starts], [int(x) for x in values]
    problems = []
    if len(starts) != len(values) or not starts:
        problems.append(f"{STARTS} has {len(starts)} items and {VALUES} {len(values)}; they need one item per "
                        "version span, at least one")
        return problems
    n_out = rec.get("output_ids")
    n_out = len(n_out) if n_out is not None and hasattr(n_out, "__len__") else None
    if starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:])) or (
            n_out is not None and starts[-1] >= n_out):
        problems.append(f"{STARTS} must start at 0 and increase, each below the output length ({n_out}), got "
                        f"{starts[:8]}")
    if any(b <= a for a, b in zip(values, values[1:])) or not 0 <= values[0] <= values[-1] <= MAX_VERSION:
        problems.append(f"{VALUES} must increase (versions only go up) within 0..{MAX_VERSION}, got {values[:8]}")
    version = rec.get("policy_version")
    if _is_int(version) and values[0] != version:
        problems.append(f"{VALUES} starts at version {values[0]} but policy_version is {version}; policy_version "
                        "is the version of the first output token")
    return problems


def compact(versions: Sequence[int]) -> tuple[list[int], list[int]]:
    """Spans (starts, values) of a per-token version list."""
    starts: list[int] = []
    values: list[int] = []
    for i, v in enumerate(versions):
        if not values or values[-1] != v:
            starts.append(i)
            values.append(v)
    return starts, values


def expand(starts: Sequence[int] | None, values: Sequence[int] | None, n: int, version: int) -> list[int]:
    """One version per output token; `version` for all `n` when there are no spans."""
    if not starts or not values:
        return [version] * n
    out: list[int] = []
    for k, (start, value) in enumerate(zip(starts, values)):
        end = starts[k + 1] if k + 1 < len(starts) else n
        out += [value] * (end - start)
    return out


def columns(starts: Sequence[int], values: Sequence[int]) -> dict[str, list[int] | None]:
    """A turn's two columns for these spans: null (one version) unless the weights changed mid-call."""
    if len(values) <= 1:
        return {STARTS: None, VALUES: None}
    return {STARTS: list(starts), VALUES: list(values)}
