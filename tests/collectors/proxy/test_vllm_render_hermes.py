"""`trajstore proxy --render vllm` against real vLLM on a Hermes-style model (`init-model`'s), parser `hermes`.

One vLLM for the module (`tests.collectors.proxy.vllm_render_cases.family_proxy`); the
scenarios are shared with the other families' modules.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.collectors.proxy import vllm_render_cases as cases
from tests.collectors.proxy_harness import Harness

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def h(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    yield from cases.family_proxy(cases.HERMES, tmp_path_factory)


def test_openai_tool_loop_is_one_segment_with_vllms_ids_and_logprobs(h: Harness) -> None:
    cases.openai_tool_loop(h, cases.HERMES)


def test_openai_tool_loop_streamed(h: Harness) -> None:
    cases.openai_tool_loop(h, cases.HERMES, stream=True)


def test_anthropic_tool_loop_streamed_call(h: Harness) -> None:
    cases.anthropic_tool_loop(h, cases.HERMES)


def test_a_rewritten_call_forks(h: Harness) -> None:
    cases.rewritten_history_forks(h, cases.HERMES)


def test_responses_tool_loop_streamed_answer(h: Harness) -> None:
    cases.responses_tool_loop(h, cases.HERMES)
