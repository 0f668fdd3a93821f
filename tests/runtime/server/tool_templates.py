"""Chat templates with the tool-call rendering of the Qwen families, for the tool parser tests.

Each renders assistant `tool_calls` exactly as the family's published template does (the part the
parsers read back), with a shortened system/tools preamble:

- `QWEN3_XML_TEMPLATE` (Qwen3-Coder, Qwen3.5): `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\n
  VALUE\\n</parameter>\\n...</function>\\n</tool_call>`, VALUE being `tojson` for mappings and lists and
  the plain string otherwise; tool results as `<tool_response>` blocks in a user turn.
- `QWEN3_HERMES_TEMPLATE` (Qwen2.5, Qwen3, Qwen3-Next): `<tool_call>\\n{"name": NAME, "arguments":
  ARGS}\\n</tool_call>`, ARGS the arguments `tojson` (or the string as is).
"""

from __future__ import annotations

_HEAD = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>{{- '<|im_end|>\\n' }}{%- endif %}"
)

_TOOL_RESPONSES = (
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{%- endif %}"
    "\n<tool_response>\n{{ message.content }}\n</tool_response>"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
)

QWEN3_XML_TEMPLATE = (
    _HEAD + "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}<|im_start|>assistant\n{{ message.content or '' }}"
    "{%- for tool_call in message.tool_calls or [] %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\n<tool_call>\n<function=' + tool_call.name + '>\n' }}"
    "{%- for args_name, args_value in tool_call.arguments | items %}"
    "{{- '<parameter=' + args_name + '>\n' }}"
    "{%- if args_value is mapping or (args_value is sequence and args_value is not string) %}"
    "{{- args_value | tojson }}{%- else %}{{- args_value | string }}{%- endif %}"
    "{{- '\n</parameter>\n' }}"
    "{%- endfor %}"
    "{{- '</function>\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}" + _TOOL_RESPONSES + "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

QWEN3_HERMES_TEMPLATE = (
    _HEAD + "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}<|im_start|>assistant\n{{ message.content or '' }}"
    "{%- for tool_call in message.tool_calls or [] %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{%- if (loop.first and message.content) or not loop.first %}{{- '\n' }}{%- endif %}"
    '{{- \'<tool_call>\n{"name": "\' }}{{- tool_call.name }}{{- \'", "arguments": \' }}'
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
    "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}" + _TOOL_RESPONSES + "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
