"""A ChatML chat template with Hermes-style tools, for ChatML models whose own template has
no tool support (SmolLM2's, say).

Handing tools to a template that ignores them would drop them silently, so `render` uses this
one instead where the model's template never mentions tools. The wording is ours; the shape
(`<tools>` in the system turn, `<tool_call>{json}</tool_call>` answers, `<tool_response>` turns)
is the Hermes convention that `workers.tools.hermes` parses.
"""

CHATML_TOOLS_TEMPLATE = """\
{%- set system = messages[0].content if messages and messages[0].role == 'system' else none -%}
{%- if tools -%}
<|im_start|>system
{% if system %}{{ system }}

{% endif %}You may call the functions described by these JSON schemas:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
To call one, answer with a JSON object holding its name and arguments between \
<tool_call></tool_call> tags, one block per call:
<tool_call>
{"name": "<function name>", "arguments": {"<argument>": "<value>"}}
</tool_call><|im_end|>
{% elif system is not none -%}
<|im_start|>system
{{ system }}<|im_end|>
{% endif -%}
{%- for message in messages -%}
{%- if message.role == 'system' and loop.first -%}
{%- elif message.role == 'assistant' -%}
<|im_start|>assistant
{% if message.content %}{{ message.content }}{% endif -%}
{%- for call in message.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' -%}
<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else -%}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% endif -%}
"""
