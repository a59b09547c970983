"""Which weights sampled each output token: `weight_versions` spans on the wire, checked and run-length encoded.

vLLM (0.32, `POST /inference/v1/generate`) answers each choice with `weight_versions`, a list of
`{"version": LABEL, "start": S, "end": E}`: output tokens [S, E) were sampled by the weights
labelled LABEL (vLLM's weight-version label, which `VLLMClient` sets to the policy version on each
reload; "default" before the first). The embedded server (`trajstore serve`) answers with the same
field on `/v1/completions`, its labels being the versions themselves. Both change labels only
between decode steps, so a call that overlapped a reload has two or more spans.

`parse_spans` checks the spans cover the output once, in order, with versions that only go up,
and returns them as the store keeps them (`trajstore.versions`): the output index at which each
version began, and the versions. A malformed answer is a `PolicyServerBadResponse`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Spans = tuple[list[int], list[int]]  # (starts, versions): version[k] sampled the tokens from starts[k] on
Label = Callable[[str], int]  # a server's weight-version label -> policy version (raises ValueError if none)


def int_label(label: str) -> int:
    """The embedded server's labels are the policy versions themselves."""
    if not label.isdigit():
        raise ValueError(label)
    return int(label)


def parse_spans(value: Any, n_tokens: int, label: Label) -> Spans | str:
    """The spans of one choice's `weight_versions` over `n_tokens` output tokens, or why they are unusable."""
    if not isinstance(value, list) or not value:
        return f"`weight_versions` must be a non-empty list of spans, got {str(value)[:200]}"
    starts: list[int] = []
    versions: list[int] = []
    end = 0
    for span in value:
        ok = isinstance(span, dict) and isinstance(span.get("version"), str) and all(
            isinstance(span.get(k), int) and not isinstance(span.get(k), bool) for k in ("start", "end"))
        if not ok or span["start"] != end or span["end"] <= span["start"]:
            return (f"`weight_versions` must be contiguous spans {{version, start, end}} covering the output from "
                    f"0 in order, got {str(value)[:200]}")
        try:
            version = label(span["version"])
        except ValueError:
            return f"`weight_versions` names weights labelled {span['version']!r}, which is not a policy version"
        if versions and version <= versions[-1]:
            return f"`weight_versions` goes from version {versions[-1]} to {version}; versions only go up"
        starts.append(span["start"])
        versions.append(version)
        end = span["end"]
    if end != n_tokens:
        return f"`weight_versions` covers {end} output tokens but the choice has {n_tokens}"
    return starts, versions


def span_list(starts: list[int], versions: list[int], n_tokens: int) -> list[dict[str, Any]]:
    """Spans as the wire carries them (vLLM's `WeightVersionSpan`), labels being the versions."""
    ends = [*starts[1:], n_tokens]
    return [{"version": str(v), "start": s, "end": e} for s, v, e in zip(starts, versions, ends)]
