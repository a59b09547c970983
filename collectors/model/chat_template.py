"""The chat template `trajstore init-model` ships with its tokenizer (Qwen2.5 / Hermes style).

One Jinja string, stored in the tokenizer files, so that transformers' `apply_chat_template`,
vLLM and the capture proxy all render a conversation to the same tokens:

    <|im_start|>system\n{system}\n\n# Tools ... <tools>\n{tool json per line}\n</tools> ...<|im_end|>\n
    <|im_start|>user\n{content}<|im_end|>\n
    <|im_start|>assistant\n<think>\n{reasoning}\n</think>\n\n{content}\n<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call><|im_end|>\n
    <|im_start|>user\n<tool_response>\n{tool output}\n</tool_response><|im_end|>\n
    <|im_start|>assistant\n                      (add_generation_prompt)

Decisions that differ from Qwen2.5's own template, each for token-exact RL:
- no default system prompt is injected: what the caller sends is what the model sees;
- `arguments` may be a JSON string (OpenAI wire format) or an object; a string is written
  as is, so the rendered call is the text the model sampled, not a re-serialization;
- `reasoning_content` of every assistant turn is kept (Qwen3 drops it from older turns),
  so a later prompt still extends the earlier turns' tokens and the session stays one
  segment (see `collectors.proxy.segmenter`);
- content may be a string, null, or a list of `{"type": "text", "text": ...}` parts.
"""

from __future__ import annotations

CHAT_TEMPLATE = r"""
{%- macro render_content(content) -%}
    {%- if content is none -%}
    {%- elif content is string -%}{{- content -}}
    {%- else -%}{%- for part in content -%}{%- if part.type == 'text' -%}{{- part.text -}}{%- endif -%}{%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- if tools -%}
    {{- '<|im_start|>system\n' -}}
    {%- if messages and messages[0].role == 'system' -%}
        {{- render_content(messages[0].content) + '\n\n' -}}
    {%- endif -%}
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>' -}}
    {%- for tool in tools -%}
        {{- '\n' + (tool | tojson) -}}
    {%- endfor -%}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' -}}
{%- elif messages and messages[0].role == 'system' -%}
    {{- '<|im_start|>system\n' + render_content(messages[0].content) + '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
    {%- if message.role == 'system' and loop.first -%}
    {%- elif message.role == 'user' or message.role == 'system' -%}
        {{- '<|im_start|>' + message.role + '\n' + render_content(message.content) + '<|im_end|>\n' -}}
    {%- elif message.role == 'assistant' -%}
        {{- '<|im_start|>assistant\n' -}}
        {%- if message.reasoning_content -%}
            {{- '<think>\n' + message.reasoning_content + '\n</think>\n\n' -}}
        {%- endif -%}
        {{- render_content(message.content) -}}
        {%- for tool_call in (message.tool_calls or []) -%}
            {%- if tool_call.function is defined -%}{%- set tool_call = tool_call.function -%}{%- endif -%}
            {%- if not loop.first or render_content(message.content) -%}{{- '\n' -}}{%- endif -%}
            {{- '<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' -}}
            {%- if tool_call.arguments is string -%}{{- tool_call.arguments -}}{%- else -%}{{- tool_call.arguments | tojson -}}{%- endif -%}
            {{- '}\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\n' -}}
    {%- elif message.role == 'tool' -%}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
        {{- '\n<tool_response>\n' + render_content(message.content) + '\n</tool_response>' -}}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
{%- endif -%}
""".strip()
