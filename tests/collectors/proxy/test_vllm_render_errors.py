"""`--render vllm` against real vLLM that cannot serve it: clear errors, before anything is captured.
(A vLLM without `--enable-scale-out`: tests/collectors/proxy/test_vllm_render.py, on the fake, since
every vLLM `start_vllm` starts has it.)

- a parser name vLLM does not have: vLLM refuses to start, and `start_vllm` (which `trajstore
  proxy --render vllm` calls) says which names vLLM has instead of a log tail.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from collectors.policy.vllm_server import VLLMUnavailable, start_vllm
from tests.collectors.proxy.vllm_render_cases import vllm_or_skip

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("option", ["tool_call_parser", "reasoning_parser"])
def test_an_unknown_parser_name_lists_vllms_names(option: str, vllm_model: Path, tmp_path: Path) -> None:
    vllm_or_skip()
    with pytest.raises(VLLMUnavailable) as err:
        server = start_vllm(vllm_model, render=True, log_path=tmp_path / "vllm.log", **{option: "no_such_parser"})
        server.stop()
    kind = "tool call" if option == "tool_call_parser" else "reasoning"
    assert f"has no {kind} parser 'no_such_parser'" in str(err.value)
    assert ("hermes" if kind == "tool call" else "qwen3") in str(err.value).split("its names are: ")[1]
