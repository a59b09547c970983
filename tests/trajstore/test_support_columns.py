"""The sampling-support turn columns (`support_sizes`, `support_ids`): checked at the store's edge, read by
`turns` and `samples` (aligned with a sample's tokens), and absent (null) in stores written before them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import trajstore
from trajstore import InvalidEventError, Reward, Status, Turn
from trajstore.events import SUPPORT_IDS_CAP, to_columns


def turn(**extra: Any) -> dict[str, Any]:
    return {"kind": "turn", "group_id": "g", "rollout_id": "r", "segment_id": "s", "turn_index": 0,
            "policy_version": 0, "prompt_ids": [1, 2, 3], "output_ids": [4, 5], "output_logprobs": [-0.5, -0.25],
            **extra}


@pytest.mark.parametrize(("extra", "fragment"), [
    ({"support_sizes": [1, 1]}, "support_sizes and support_ids go together"),
    ({"support_sizes": [2], "support_ids": [4, 9]}, "support_sizes has 1 values but output_ids has 2"),
    ({"support_sizes": [1, 1], "support_ids": [4]}, "must sum to the 1 values of support_ids (they sum to 2)"),
    ({"support_sizes": [1, 600], "support_ids": [4, 5]}, "must sum to the 2 values of support_ids (they sum to 1)"),
    ({"support_sizes": [1, 1], "support_ids": [4, -5]}, "support_ids"),
])
def test_a_malformed_support_is_refused_naming_the_problem(extra: dict[str, Any], fragment: str) -> None:
    with pytest.raises(InvalidEventError) as info:
        to_columns([turn(**extra)])
    assert any(fragment in message for _, message in info.value.problems), info.value.problems


def test_samples_align_the_support_with_their_tokens(tmp_path: Path) -> None:
    store = trajstore.open_store(tmp_path / "s")
    big = SUPPORT_IDS_CAP + 1
    with store.writer("w") as w:
        w.append([
            Turn(group_id="g", rollout_id="r", segment_id="s", turn_index=0, policy_version=0, prompt_ids=[1, 2],
                 output_ids=[4, 5], output_logprobs=[-0.5, -0.25], sampling={"temperature": 0.7, "top_k": 2},
                 support_sizes=[2, big], support_ids=[3, 4]),
            Turn(group_id="g", rollout_id="r", segment_id="s", turn_index=1, policy_version=0, prompt_ids=[6],
                 output_ids=[7], output_logprobs=[-1.0], sampling={"temperature": 0.7, "top_k": 2}),
            Reward(group_id="g", rollout_id="r", reward=1.0),
            Status(group_id="g", rollout_id="r", status="completed")])
    row = store.query("SELECT tokens, support_sizes, support_ids, temperature, top_k, top_p, sampling_varies "
                      "FROM samples").to_pylist()[0]
    assert row == {"tokens": [1, 2, 4, 5, 6, 7], "support_sizes": [0, 0, 2, big, 0, 0], "support_ids": [3, 4],
                   "temperature": 0.7, "top_k": 2, "top_p": None, "sampling_varies": False}
