"""A copy of the default model that calls tools as Hermes/Qwen models do.

Its chat template is Qwen 2.5's tool-calling template (tools in a `<tools>`
block of the system message, calls as `<tool_call>` blocks, results as
`<tool_response>` blocks), and its tokenizer spells `<tool_call>` as one
ordinary (not special) token, as Qwen's does: the `<|endoftext|>` padding
token of the default model is renamed, so the weights and the vocabulary size
stay as they are. One token for the trigger lets a test force a call in
`tool_choice: "auto"` with `logit_bias`, which a random model would never
write on its own.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

TOOL_CALL_TOKEN = "<tool_call>"
TOOL_CALL_ID = 0
"""The id `<tool_call>` gets (the renamed `<|endoftext|>`)."""

QWEN_TOOLS_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": "
    "<function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- else %}"
    "{%- if messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}"
    "{{- '\", \"arguments\": ' }}{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_hermes_model(default_model: Path, out: Path) -> Path:
    """Copy ``default_model`` to ``out`` with the Qwen tool template and `<tool_call>` token."""
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(default_model, out)
    tok_path = out / "tokenizer.json"
    tok = json.loads(tok_path.read_text())
    for added in tok["added_tokens"]:
        if added["id"] == TOOL_CALL_ID:
            added["content"], added["special"] = TOOL_CALL_TOKEN, False
    vocab = tok["model"]["vocab"]
    old = next(k for k, v in vocab.items() if v == TOOL_CALL_ID)
    del vocab[old]
    vocab[TOOL_CALL_TOKEN] = TOOL_CALL_ID
    tok_path.write_text(json.dumps(tok, ensure_ascii=False))
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["pad_token"] = "<|im_end|>"
    cfg["chat_template"] = QWEN_TOOLS_TEMPLATE
    cfg_path.write_text(json.dumps(cfg, indent=2))
    (out / "chat_template.jinja").write_text(QWEN_TOOLS_TEMPLATE)
    for name in ("config.json", "generation_config.json"):
        path = out / name
        config = json.loads(path.read_text())
        config["pad_token_id"] = 2
        path.write_text(json.dumps(config, indent=2))
    return out
