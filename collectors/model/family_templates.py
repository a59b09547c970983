"""Chat templates of the Llama 3.x and gpt-oss (harmony) families, written from each family's documented format.

`trajstore init-model --family llama3|harmony` ships them (`collectors.model.families`); the
proxy renders with them as with any checkpoint's template, and `collectors.model.toolcalls`
parses what they render. Both follow the decisions of the Hermes template
(`collectors.model.chat_template`) that token-exact RL needs: no injected date or default
text that changes between calls, string `arguments` written as is (the model's own JSON
text), and every assistant turn's reasoning kept, so a later prompt extends the tokens
sampled before it.

Llama 3.1 (the "JSON based tool calling" prompt format of Llama 3.1's model card), with the
custom tools in the system prompt:

    <|begin_of_text|><|start_header_id|>system<|end_header_id|>\\n\\nEnvironment: ipython\\n\\n{system}\\n\\n
    You have access to the following functions. ... {tool json}\\n\\n...<|eot_id|>
    <|start_header_id|>user<|end_header_id|>\\n\\n{content}<|eot_id|>
    <|start_header_id|>assistant<|end_header_id|>\\n\\n{"name": N, "parameters": {...}}<|eot_id|>
    <|start_header_id|>ipython<|end_header_id|>\\n\\n{tool output}<|eot_id|>
    <|start_header_id|>assistant<|end_header_id|>\\n\\n                 (add_generation_prompt)

A turn whose text starts with `<|python_tag|>` (the model's marker for a call to its
executor) ends with `<|eom_id|>` ("end of message: a tool call needs to be made"), every
other turn with `<|eot_id|>`, as the model card pairs them. Several calls are joined with
`; `, the separator vLLM's `llama3_json` parser splits on.

gpt-oss harmony (the format `openai-harmony` renders; checked token for token against
`HarmonyEncoding.render_conversation_for_completion` in the tests):

    <|start|>system<|message|>You are ChatGPT, ... # Valid channels: analysis, commentary, final. ...<|end|>
    <|start|>developer<|message|># Instructions\\n\\n{system}\\n\\n# Tools\\n\\n## functions\\n\\nnamespace functions {...}<|end|>
    <|start|>user<|message|>{content}<|end|>
    <|start|>assistant<|channel|>analysis<|message|>{reasoning}<|end|>
    <|start|>assistant to=functions.N<|channel|>commentary <|constrain|>json<|message|>{arguments}<|call|>
    <|start|>functions.N to=assistant<|channel|>commentary<|message|>{tool output}<|end|>
    <|start|>assistant<|channel|>final<|message|>{content}<|end|>
    <|start|>assistant                                                   (add_generation_prompt)

Differences from `openai-harmony`'s own rendering, each for token-exact RL: the analysis
(reasoning) of earlier turns is kept (the library drops it before a later final message),
and an assistant message with content and tool calls writes its content on the commentary
channel (a preamble) rather than as a final answer.
"""

from __future__ import annotations

_CONTENT_MACRO = r"""
{%- macro render_content(content) -%}
    {%- if content is none -%}
    {%- elif content is string -%}{{- content -}}
    {%- else -%}{%- for part in content -%}{%- if part.type == 'text' -%}{{- part.text -}}{%- endif -%}{%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
""".strip()

LLAMA3_CHAT_TEMPLATE = _CONTENT_MACRO + r"""
{{- '<|begin_of_text|>' -}}
{%- set system = messages[0].content if messages and messages[0].role == 'system' else none -%}
{%- if tools or system is not none -%}
    {{- '<|start_header_id|>system<|end_header_id|>\n\n' -}}
    {%- if tools -%}{{- 'Environment: ipython\n\n' -}}{%- endif -%}
    {{- render_content(system) -}}
    {%- if tools -%}
        {%- if render_content(system) -%}{{- '\n\n' -}}{%- endif -%}
        {{- 'You have access to the following functions. To call a function, respond with JSON for a function call '
            'in the format {"name": function name, "parameters": dictionary of argument name and its value}. '
            'Do not use variables.' -}}
        {%- for tool in tools -%}{{- '\n\n' + (tool | tojson) -}}{%- endfor -%}
    {%- endif -%}
    {{- '<|eot_id|>' -}}
{%- endif -%}
{%- for message in messages -%}
    {%- if message.role == 'system' and loop.first -%}
    {%- elif message.role == 'user' or message.role == 'system' -%}
        {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' + render_content(message.content) + '<|eot_id|>' -}}
    {%- elif message.role == 'assistant' -%}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' + render_content(message.content) -}}
        {%- for tool_call in (message.tool_calls or []) -%}
            {%- if tool_call.function is defined -%}{%- set tool_call = tool_call.function -%}{%- endif -%}
            {%- if not loop.first -%}{{- '; ' -}}{%- endif -%}
            {{- '{"name": "' + tool_call.name + '", "parameters": ' -}}
            {%- if tool_call.arguments is string -%}{{- tool_call.arguments -}}{%- else -%}{{- tool_call.arguments | tojson -}}{%- endif -%}
            {{- '}' -}}
        {%- endfor -%}
        {%- if render_content(message.content).startswith('<|python_tag|>') -%}{{- '<|eom_id|>' -}}{%- else -%}{{- '<|eot_id|>' -}}{%- endif -%}
    {%- elif message.role == 'tool' or message.role == 'ipython' -%}
        {{- '<|start_header_id|>ipython<|end_header_id|>\n\n' + render_content(message.content) + '<|eot_id|>' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
{%- endif -%}
"""

HARMONY_CHAT_TEMPLATE = _CONTENT_MACRO + r"""
{%- macro ts_type(schema) -%}
    {%- if schema.enum is defined -%}
        {%- for value in schema.enum -%}{%- if not loop.first -%}{{- ' | ' -}}{%- endif -%}{{- value | tojson -}}{%- endfor -%}
    {%- elif schema.type == 'string' -%}string
    {%- elif schema.type == 'integer' or schema.type == 'number' -%}number
    {%- elif schema.type == 'boolean' -%}boolean
    {%- elif schema.type == 'array' -%}{{- ts_type(schema['items']) if schema['items'] is defined else 'any' -}}[]
    {%- else -%}any
    {%- endif -%}
{%- endmacro -%}
{%- set ns = namespace(last='', name='') -%}
{{- '<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\nKnowledge cutoff: 2024-06\n\n'
    'Reasoning: medium\n\n# Valid channels: analysis, commentary, final. Channel must be included for every message.' -}}
{%- if tools -%}{{- "\nCalls to these tools must go to the commentary channel: 'functions'." -}}{%- endif -%}
{{- '<|end|>' -}}
{%- set system = messages[0].content if messages and messages[0].role == 'system' else none -%}
{%- if tools or system is not none -%}
    {{- '<|start|>developer<|message|>' -}}
    {%- if system is not none -%}{{- '# Instructions\n\n' + render_content(system) -}}{%- if tools -%}{{- '\n\n' -}}{%- endif -%}{%- endif -%}
    {%- if tools -%}
        {{- '# Tools\n\n## functions\n\nnamespace functions {\n\n' -}}
        {%- for tool in tools -%}
            {%- set fn = tool.function if tool.function is defined else tool -%}
            {%- if fn.description -%}{{- '// ' + fn.description + '\n' -}}{%- endif -%}
            {{- 'type ' + fn.name + ' = (_: {\n' -}}
            {%- set params = fn.parameters if fn.parameters is defined and fn.parameters else {} -%}
            {%- for name, prop in (params.properties or {}).items() -%}
                {%- if prop.description -%}{{- '// ' + prop.description + '\n' -}}{%- endif -%}
                {{- name + ('' if name in (params.required or []) else '?') + ': ' + ts_type(prop) + ',' -}}
                {%- if prop.default is defined -%}{{- ' // default: ' + (prop.default | string) -}}{%- endif -%}
                {{- '\n' -}}
            {%- endfor -%}
            {{- '}) => any;\n\n' -}}
        {%- endfor -%}
        {{- '} // namespace functions' -}}
    {%- endif -%}
    {{- '<|end|>' -}}
{%- endif -%}
{%- for message in messages -%}
    {%- if message.role == 'system' and loop.first -%}
    {%- elif message.role == 'user' or message.role == 'system' -%}
        {{- '<|start|>' + ('user' if message.role == 'user' else 'developer') + '<|message|>' + render_content(message.content) + '<|end|>' -}}
    {%- elif message.role == 'assistant' -%}
        {%- if message.reasoning_content -%}
            {{- '<|start|>assistant<|channel|>analysis<|message|>' + message.reasoning_content + '<|end|>' -}}
        {%- endif -%}
        {%- if render_content(message.content) -%}
            {{- '<|start|>assistant<|channel|>' + ('commentary' if message.tool_calls else 'final') + '<|message|>'
                + render_content(message.content) + '<|end|>' -}}
        {%- endif -%}
        {%- for tool_call in (message.tool_calls or []) -%}
            {%- set fn = tool_call.function if tool_call.function is defined else tool_call -%}
            {%- set ns.last = fn.name -%}
            {{- '<|start|>assistant to=functions.' + fn.name + '<|channel|>commentary <|constrain|>json<|message|>' -}}
            {%- if fn.arguments is string -%}{{- fn.arguments -}}{%- else -%}{{- fn.arguments | tojson -}}{%- endif -%}
            {{- '<|call|>' -}}
        {%- endfor -%}
    {%- elif message.role == 'tool' -%}
        {%- set ns.name = message.name if message.name is defined and message.name else ns.last -%}
        {%- for earlier in messages[:loop.index0] -%}{%- for tool_call in (earlier.tool_calls or []) -%}
            {%- if tool_call.id is defined and tool_call.id and tool_call.id == message.tool_call_id -%}
                {%- set ns.name = tool_call.function.name if tool_call.function is defined else tool_call.name -%}
            {%- endif -%}
        {%- endfor -%}{%- endfor -%}
        {{- '<|start|>functions.' + ns.name + ' to=assistant<|channel|>commentary<|message|>' + render_content(message.content) + '<|end|>' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|start|>assistant' -}}
{%- endif -%}
"""
