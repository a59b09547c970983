"""Version spans on the wire: checked, run-length encoded, joined across a stream's chunks. Pure functions."""

from __future__ import annotations

import pytest

from collectors.policy import Chunk, PolicyServerBadResponse, StreamedSample, parse_completion
from collectors.policy.versions import int_label, parse_spans, span_list


def spans(*triples: tuple[str, int, int]) -> list[dict[str, object]]:
    return [{"version": v, "start": s, "end": e} for v, s, e in triples]


def test_spans_round_trip_and_default_labels() -> None:
    assert parse_spans(spans(("4", 0, 3), ("5", 3, 7)), 7, int_label) == ([0, 3], [4, 5])
    assert span_list([0, 3], [4, 5], 7) == spans(("4", 0, 3), ("5", 3, 7))
    assert parse_spans(spans(("default", 0, 2), ("3", 2, 4)), 4,
                       lambda label: 0 if label == "default" else int_label(label)) == ([0, 2], [0, 3])


@pytest.mark.parametrize(("value", "n", "message"), [
    ([], 3, "non-empty list"),
    (spans(("1", 1, 3)), 3, "contiguous spans"),
    (spans(("1", 0, 2), ("2", 3, 4)), 4, "contiguous spans"),
    (spans(("2", 0, 2), ("1", 2, 4)), 4, "versions only go up"),
    (spans(("1", 0, 2)), 4, "covers 2 output tokens but the choice has 4"),
    (spans(("latest", 0, 2)), 2, "not a policy version"),
])
def test_unusable_spans_say_what_is_wrong(value: object, n: int, message: str) -> None:
    problem = parse_spans(value, n, int_label)
    assert isinstance(problem, str) and message in problem
    body = {"choices": [{"text": "", "finish_reason": "length", "token_ids": list(range(n)),
                         "logprobs": {"token_logprobs": [-1.0] * n}, "weight_versions": value}]}
    if n:
        with pytest.raises(PolicyServerBadResponse, match="unusable version spans"):
            parse_completion(body, [1], policy_version=0, url="http://x", label=int_label)


def test_a_stream_joins_versions_from_its_chunks_or_from_the_servers_spans() -> None:
    joined = StreamedSample([1])
    for version, token in ((3, 10), (3, 11), (4, 12), (4, 13)):
        joined.add(Chunk([token], [-0.5], "", version))
    sample = joined.sample()
    assert (sample.policy_version, sample.version_starts, sample.version_values) == (3, [0, 2], [3, 4])
    told = StreamedSample([1])  # vLLM: every chunk has the version known before; the spans come last
    told.add(Chunk([10, 11], [-0.5, -0.5], "", 3))
    told.add(Chunk([12], [-0.5], "", 3, finish_reason="length", version_starts=[0, 1], version_values=[3, 5]))
    assert (told.sample().version_starts, told.sample().version_values) == ([0, 1], [3, 5])
    one = StreamedSample([1])
    one.add(Chunk([10], [-0.5], "", 2, finish_reason="stop"))
    assert (one.sample().policy_version, one.sample().version_starts) == (2, None)
