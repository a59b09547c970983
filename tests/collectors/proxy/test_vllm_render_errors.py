"""`--render vllm` against real vLLM that cannot serve it: clear errors, before anything is captured.

- a vLLM started without `--enable-scale-out` (the session's `vllm_server`) answers its render
  route 403: the proxy refuses to start and says which option vLLM needs;
- a parser name vLLM does not have: vLLM refuses to start, and `start_vllm` (which `trajstore
  proxy --render vllm` calls) says which names vLLM has instead of a log tail.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from collectors.policy import VLLMClient
from collectors.policy.vllm_server import VLLMServer, VLLMUnavailable, start_vllm
from collectors.proxy.vllm_render import RenderUnavailable
from tests.collectors.proxy.vllm_render_cases import vllm_or_skip
from tests.collectors.proxy_harness import running_proxy

pytestmark = pytest.mark.vllm


def test_a_vllm_without_scale_out_is_refused_at_start(vllm_server: VLLMServer, vllm_model: Path,
                                                      tmp_path: Path) -> None:
    with pytest.raises(RenderUnavailable, match="only when started with --enable-scale-out"):
        with running_proxy(VLLMClient(vllm_server.url), tmp_path / "store", vllm_model,
                           render="vllm"):
            pass


@pytest.mark.parametrize("option", ["tool_call_parser", "reasoning_parser"])
def test_an_unknown_parser_name_lists_vllms_names(option: str, vllm_model: Path, tmp_path: Path) -> None:
    vllm_or_skip()
    with pytest.raises(VLLMUnavailable) as err:
        server = start_vllm(vllm_model, render=True, log_path=tmp_path / "vllm.log", **{option: "no_such_parser"})
        server.stop()
    kind = "tool call" if option == "tool_call_parser" else "reasoning"
    assert f"has no {kind} parser 'no_such_parser'" in str(err.value)
    assert ("hermes" if kind == "tool call" else "qwen3") in str(err.value).split("its names are: ")[1]
