"""The chat template the built-in tiny model's checkpoint carries (`msa.checkpoint.write_tokenizer`): the
MiniMax-M3 format (../shared/M3_SPEC.md section 7) with the tiny vocabulary's role tokens, so tools, tool calls
and reasoning are rendered by the checkpoint and parsed back (`deploy.tool_parser`, `deploy.reasoning_parser`)
exactly as with the released model.

Jinja2 source for Hugging Face-style sandboxed rendering (ImmutableSandboxedEnvironment, trim_blocks,
lstrip_blocks, a `tojson` that does not HTML-escape, `raise_exception`; `workers.tokenizer` and
`transformers.AutoTokenizer` both render it). Plain chats (system/user/assistant text, no tools) render byte for
byte what the earlier plain template rendered: `<|bos|>`, then per message `<|role|>\n{text}<|eos|>\n`, then the
generation prompt `<|assistant|>\n`; the end-of-turn token is EOS itself, so a model that ends its turn stops.
On top of that:
- `tools` (OpenAI tool dicts): listed in the system turn, one function definition as JSON per line, with the
  call syntax spelled out.
- assistant `tool_calls`: after the content, one `NS<tool_call>` wrapper holding an `NS<invoke name="F">` per
  call; each argument an element named after it, objects as nested elements, lists as `NS<item>` elements,
  booleans as true/false, null values (and null list items) left out. `function.arguments` must be an object:
  OpenAI clients send a JSON string, so the caller parses it first, as vLLM does.
- `tool` messages: a `<|tool|>` turn holding the result. `<|tool|>` is plain text here, not a special token:
  adding one would move the ids of the tiny vocabulary.
- reasoning: an assistant message's `reasoning_content` is rendered as `<mm:think>...</mm:think>` before its
  content when it follows the last user message (the current tool loop); older reasoning is dropped.
- `enable_thinking` (a `chat_template_kwargs` key, default off): the generation prompt ends in `<mm:think>`,
  so the model starts inside reasoning.
"""

CHAT_TEMPLATE = r"""
{%- set NS = ']<]minimax[>[' -%}
{%- macro render_value(v) -%}
  {%- if v is mapping -%}
    {%- for k, x in v.items() if x is not none -%}
      {{- NS ~ '<' ~ k ~ '>' -}}{{- render_value(x) -}}{{- NS ~ '</' ~ k ~ '>' -}}
    {%- endfor -%}
  {%- elif v is string -%}{{- v -}}
  {%- elif v is boolean -%}{{- 'true' if v else 'false' -}}
  {%- elif v is iterable -%}
    {%- for x in v if x is not none -%}
      {{- NS ~ '<item>' -}}{{- render_value(x) -}}{{- NS ~ '</item>' -}}
    {%- endfor -%}
  {%- else -%}{{- v -}}
  {%- endif -%}
{%- endmacro -%}
{%- macro render_content(c) -%}
  {%- if c is string -%}{{- c -}}
  {%- elif c is not none -%}
    {%- for part in c if part['type'] == 'text' -%}{{- part['text'] -}}{%- endfor -%}
  {%- endif -%}
{%- endmacro -%}
{{- bos_token -}}
{%- set first = 1 if messages and messages[0]['role'] == 'system' else 0 -%}
{%- set state = namespace(last_user=-1) -%}
{%- for m in messages -%}
  {%- if m['role'] == 'user' -%}{%- set state.last_user = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- if first or tools -%}
  {{- '<|system|>\n' -}}
  {%- if first -%}{{- render_content(messages[0]['content']) -}}{%- endif -%}
  {%- if tools -%}
    {{- '\n\n' if first else '' -}}
    {{- '# Tools\nYou may call one or more of these functions, ' -}}
    {{- 'whose definitions follow as JSON, one per line:\n<tools>\n' -}}
    {%- for tool in tools -%}
      {{- (tool['function'] if tool['function'] is defined else tool) | tojson -}}{{- '\n' -}}
    {%- endfor -%}
    {{- '</tools>\nTo call functions, end your answer with:\n' -}}
    {{- NS ~ '<tool_call>\n' ~ NS ~ '<invoke name="FUNCTION">' ~ NS ~ '<ARGUMENT>value' ~ NS ~ '</ARGUMENT>' -}}
    {{- NS ~ '</invoke>\n' ~ NS ~ '</tool_call>\n' -}}
    {{- 'with one invoke per call. Write objects as nested elements, lists as ' ~ NS ~ '<item> elements, ' -}}
    {{- 'and leave out null values.' -}}
  {%- endif -%}
  {{- eos_token ~ '\n' -}}
{%- endif -%}
{%- for m in messages[first:] -%}
  {%- set i = loop.index0 + first -%}
  {%- if m['role'] in ['system', 'user', 'tool'] -%}
    {{- '<|' ~ m['role'] ~ '|>\n' -}}{{- render_content(m['content']) -}}{{- eos_token ~ '\n' -}}
  {%- elif m['role'] == 'assistant' -%}
    {{- '<|assistant|>\n' -}}
    {%- if m['reasoning_content'] is defined and m['reasoning_content'] and i > state.last_user -%}
      {{- '<mm:think>' ~ m['reasoning_content'] ~ '</mm:think>' -}}
    {%- endif -%}
    {{- render_content(m['content']) -}}
    {%- if m['tool_calls'] is defined and m['tool_calls'] -%}
      {{- NS ~ '<tool_call>\n' -}}
      {%- for call in m['tool_calls'] -%}
        {%- set f = call['function'] if call['function'] is defined else call -%}
        {%- if f['arguments'] is string -%}
          {{- raise_exception('tool_calls: function.arguments must be an object here; parse its JSON first') -}}
        {%- endif -%}
        {{- NS ~ '<invoke name="' ~ f['name'] ~ '">' -}}
        {%- if f['arguments'] is mapping -%}{{- render_value(f['arguments']) -}}{%- endif -%}
        {{- NS ~ '</invoke>\n' -}}
      {%- endfor -%}
      {{- NS ~ '</tool_call>' -}}
    {%- endif -%}
    {{- eos_token ~ '\n' -}}
  {%- else -%}
    {{- raise_exception('unknown chat role: ' ~ m['role']) -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|assistant|>\n' -}}
  {%- if enable_thinking is defined and enable_thinking -%}{{- '<mm:think>' -}}{%- endif -%}
{%- endif -%}
"""
