"""Llama 3 and gpt-oss harmony on the embedded path: tokenizers with each family's control tokens, templates
written from each family's documented format, and replies parsed and streamed behind `toolcalls`.

The models are built on the spot (`init_model(family=...)`); harmony's template is checked token for token
against `openai-harmony`'s own rendering, whose vocabulary file is found on this machine, never downloaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from collectors.model.build import ModelSize, init_model
from collectors.model.families import FAMILIES
from collectors.model.toolcalls import detect_format, parse_output
from collectors.proxy.chat import ChatReply
from collectors.proxy.streaming import reply_stream

SIZE = ModelSize(vocab_size=1024, hidden_size=32, layers=1, heads=2, kv_heads=1, intermediate_size=64,
                 max_positions=1024)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Get the weather.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "description": "The city."},
                                     "unit": {"type": "string", "enum": ["c", "f"]}, "n": {"type": "integer"}},
    "required": ["city"]}}}]
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module", params=["llama3", "harmony"])
def family_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    path = tmp_path_factory.mktemp("family") / request.param
    init_model(path, SIZE, family=request.param)
    return request.param, path


def render(tok: Any, messages: list[dict[str, Any]], prompt: bool) -> str:
    return tok.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=prompt)


def test_each_family_has_its_control_tokens_stop_tokens_and_template(family_model: tuple[str, Path]) -> None:
    name, path = family_model
    spec = FAMILIES[name]
    tok = AutoTokenizer.from_pretrained(path)
    for token in spec.special:  # one id each, special, and never spelled by text the agent sends
        (only,) = tok.encode(token, add_special_tokens=False)
        assert only in tok.all_special_ids
    assert tok.eos_token == spec.eos and detect_format(tok.chat_template) == name
    from transformers import GenerationConfig
    stops = GenerationConfig.from_pretrained(path).eos_token_id
    assert stops == [tok.convert_tokens_to_ids(t) for t in spec.stops]


def test_a_sampled_tool_call_renders_as_the_prefix_of_the_next_prompt(family_model: tuple[str, Path]) -> None:
    name, path = family_model
    tok = AutoTokenizer.from_pretrained(path)
    turn = CHAT + [{"role": "assistant", "content": None, "tool_calls": [CALL]}]
    prompt, written = render(tok, CHAT, True), render(tok, turn, False)
    after = render(tok, turn + [{"role": "tool", "tool_call_id": "c1", "content": "sunny"}], True)
    assert written.startswith(prompt) and after.startswith(written)
    reply = written[len(prompt):]
    stop = {"llama3": "<|eot_id|>", "harmony": "<|call|>"}[name]
    assert reply.endswith(stop)
    parsed = parse_output(reply[:-len(stop)], fmt=name)
    assert [(c.name, c.arguments, c.input) for c in parsed.tool_calls] == [
        ("get_weather", '{"city": "Paris"}', {"city": "Paris"})]
    assert tok.decode(tok.encode(after, add_special_tokens=False)) == after


def test_harmony_template_renders_what_openai_harmony_renders(tmp_path: Path) -> None:
    from openai_harmony import (Author, Conversation, DeveloperContent, Message, Role, SystemContent,
                                ToolDescription)

    from collectors.model.harmony import encoding

    init_model(tmp_path / "m", SIZE, family="harmony")
    tok = AutoTokenizer.from_pretrained(tmp_path / "m")
    fn = TOOLS[0]["function"]
    messages = CHAT + [{"role": "assistant", "content": None, "tool_calls": [CALL]},
                       {"role": "tool", "tool_call_id": "c1", "content": '{"t": 3}'},
                       {"role": "assistant", "content": "It is 3."}, {"role": "user", "content": "thanks"}]
    conversation = Conversation.from_messages([
        Message.from_role_and_content(Role.SYSTEM, SystemContent.new()),
        Message.from_role_and_content(Role.DEVELOPER, DeveloperContent.new().with_instructions("Be brief.")
                                      .with_function_tools([ToolDescription.new(fn["name"], fn["description"],
                                                                                parameters=fn["parameters"])])),
        Message.from_role_and_content(Role.USER, "Weather in Paris?"),
        Message.from_role_and_content(Role.ASSISTANT, '{"city": "Paris"}').with_channel("commentary")
        .with_recipient("functions.get_weather").with_content_type("<|constrain|>json"),
        Message.from_author_and_content(Author.new(Role.TOOL, "functions.get_weather"), '{"t": 3}')
        .with_channel("commentary").with_recipient("assistant"),
        Message.from_role_and_content(Role.ASSISTANT, "It is 3.").with_channel("final"),
        Message.from_role_and_content(Role.USER, "thanks"),
    ])
    enc = encoding()
    assert render(tok, messages, True) == enc.decode(enc.render_conversation_for_completion(conversation,
                                                                                           Role.ASSISTANT))


@pytest.mark.parametrize("text, content, calls", [
    ('{"name": "get_weather", "parameters": {"city": "Oslo"}}', "", [("get_weather", '{"city": "Oslo"}')]),
    ('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x":1}}', "",
     [("a", "{}"), ("b", '{"x": 1}')]),
    ("It is sunny.", "It is sunny.", []),
    ('{"name": "a", "parameters": {} trailing', '{"name": "a", "parameters": {} trailing', []),
    ('{"name": "a", "parameters": {}} and text', '{"name": "a", "parameters": {}} and text', []),
    ('{"no": "name"}', '{"no": "name"}', []),
])
def test_llama3_replies_parse_as_vllms_llama3_json_parser_reads_them(text: str, content: str,
                                                                     calls: list[tuple[str, str]]) -> None:
    parsed = parse_output(text, fmt="llama3")
    assert parsed.content == content and parsed.reasoning is None
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == calls
    assert parse_output(text, fmt="llama3", parse_tools=False).content == text


HARMONY_CALL = ('<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant to=functions.get_weather'
                '<|channel|>commentary <|constrain|>json<|message|>{"city": "Oslo"}')


@pytest.mark.parametrize("text, reasoning, content, calls", [
    (HARMONY_CALL, "Need the weather.", "", [("get_weather", '{"city": "Oslo"}')]),
    ("<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Sunny.",
     "Think.", "Sunny.", []),
    ("<|channel|>final<|message|>Hi", None, "Hi", []),
    ("no header at all", None, "no header at all", []),  # the format broken: what the model wrote, as content
    ("<|channel|>final<|message|>Hi<|end|>stray text", None, "Hi\n\nstray text", []),
    (' to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>not json', None, "not json", []),
])
def test_harmony_replies_parse_through_openai_harmony(text: str, reasoning: str | None, content: str,
                                                      calls: list[tuple[str, str]]) -> None:
    parsed = parse_output(text, fmt="harmony")
    assert (parsed.reasoning, parsed.content) == (reasoning, content)
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == calls


def _streamed(fmt: str, text: str, step: int) -> tuple[dict[str, str], list[Any]]:
    """Feed `text` in pieces of `step` characters; the pieces joined, and the events of `finish`."""
    stream, got = reply_stream(fmt, parse_tools=True), {"reasoning": "", "content": ""}
    for i in range(0, len(text), step):
        for kind, value in stream.feed(text[i:i + step]):
            got[kind] += value
    parsed = parse_output(text, fmt=fmt)
    reply = ChatReply("r", "m", 0, parsed.content, parsed.reasoning, parsed.tool_calls, "stop", None, 0, [], [], [], 0)
    before = dict(got)
    rest = stream.finish(reply)
    for event in rest:
        if event[0] != "tool_call":
            got[event[0]] += event[1]
    assert got == {"reasoning": parsed.reasoning or "", "content": parsed.content}
    return before, rest


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_streams_send_prefixes_of_the_final_parse_and_calls_at_the_end(step: int) -> None:
    before, rest = _streamed("harmony", HARMONY_CALL, step)
    assert before["reasoning"] == "Need the weather." and [e[0] for e in rest] == ["tool_call"]
    before, _ = _streamed("harmony", "<|channel|>analysis<|message|>A<|end|><|start|>assistant<|channel|>final"
                                     "<|message|>Sunny today.", step)
    assert before == {"reasoning": "A", "content": "Sunny today."}  # all of it streamed before the end
    before, rest = _streamed("llama3", '<|python_tag|>{"name": "a", "parameters": {}}', step)
    assert before == {"reasoning": "", "content": ""} and [e[0] for e in rest] == ["tool_call"]
    before, _ = _streamed("llama3", "Plain words, streamed.", step)
    assert before["content"] == "Plain words, streamed."


def test_harmony_never_downloads_its_vocabulary(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Without TIKTOKEN_ENCODINGS_BASE and without a copy on this machine: a clear error, no download."""
    from collectors.model import harmony

    monkeypatch.delenv("TIKTOKEN_ENCODINGS_BASE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(harmony, "_offline_copies", lambda: [tmp_path / "nowhere"])
    with pytest.raises(harmony.HarmonyVocabMissing, match="set TIKTOKEN_ENCODINGS_BASE to that directory"):
        harmony.vocab_dir()
    bad = tmp_path / "bad"
    bad.write_text("not the vocabulary\n")
    monkeypatch.setattr(harmony, "_offline_copies", lambda: [bad])  # a copy whose sha256 differs is not used
    with pytest.raises(harmony.HarmonyVocabMissing):
        harmony.vocab_dir()


def test_harmony_vocabulary_is_copied_once_into_trajstores_cache(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    from collectors.model import harmony

    found = [p for p in harmony._offline_copies() if p.is_file()]
    if not found:
        pytest.skip("no offline copy of o200k_base.tiktoken on this machine (litellm, a test dependency, ships one)")
    monkeypatch.delenv("TIKTOKEN_ENCODINGS_BASE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    where = harmony.vocab_dir()
    assert where == tmp_path / "trajstore" / "harmony" and harmony._sha256(where / harmony.VOCAB_FILE) == \
        harmony.VOCAB_SHA256
    monkeypatch.setattr(harmony, "_offline_copies", lambda: [])
    assert harmony.vocab_dir() == where  # the cached copy serves from then on


def test_init_model_command_takes_a_family(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from cli.main import main

    sizes = ["--vocab-size", "400", "--hidden-size", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1",
             "--intermediate-size", "48", "--max-positions", "128"]
    result = CliRunner().invoke(main, ["init-model", str(tmp_path / "m"), "--family", "llama3", *sizes])
    assert result.exit_code == 0 and "llama3 chat format" in result.output, result.output
    assert detect_format(AutoTokenizer.from_pretrained(tmp_path / "m").chat_template) == "llama3"
    bad = CliRunner().invoke(main, ["init-model", str(tmp_path / "x"), "--family", "mistral", *sizes])
    assert bad.exit_code != 0 and "hermes" in bad.output and "harmony" in bad.output
