"""Function calling through the chat template: tools into the prompt, tool calls out of the answer.

Calls are written the way Qwen2.5's, Hermes' and many other templates ask: `<tool_call>\\n{"name": ...,
"arguments": {...}}\\n</tool_call>`. A template that renders `tools` itself is used as it is; for one that ignores
them (it renders the same text with and without), the tools and that format are described in a system message.

tool_choice: "auto" lets the model answer or call (calls are read out of its text afterwards); "required" and a
named function constrain the output to calls (one or more) whose arguments match the tools' JSON schemas, via the
grammar (rules/grammar.py); "none" leaves the tools out of the constraint and of the answer's parsing.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from specdecode.errors import SpecdecodeError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
CALL_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)

SYSTEM_TOOLS = """You can call functions. Their signatures, as JSON, between <tools></tools>:
<tools>
{tools}
</tools>
To call one, answer with a JSON object of its name and arguments between <tool_call></tool_call> tags:
<tool_call>
{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}
</tool_call>"""


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def render(tokenizer, messages: list[dict], tools: list[dict] | None) -> str:
    """Chat messages (with tool calls and tool results) and tools -> the prompt text the chat template makes."""
    messages = [_for_template(m) for m in messages]
    try:
        if not tools:
            return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        plain = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # noqa: BLE001 - a template's own error (jinja raise_exception, a missing key)
        raise SpecdecodeError(f"the chat template cannot render these messages and tools: {e}") from None
    if text != plain:
        return text
    described = SYSTEM_TOOLS.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0], content=f"{messages[0]['content']}\n\n{described}")
        messages = [first, *messages[1:]]
    else:
        messages = [{"role": "system", "content": described}, *messages]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def _for_template(message: dict) -> dict:
    """Templates read a call's arguments as an object: OpenAI sends them as JSON text."""
    if not message.get("tool_calls"):
        return message
    calls = []
    for call in message["tool_calls"]:
        function = dict(call["function"])
        try:
            function["arguments"] = json.loads(function["arguments"])
        except (TypeError, ValueError):
            pass
        calls.append({**call, "function": function})
    return {**message, "tool_calls": calls}


def call_grammar(tools: list[dict], tool_choice: str | dict, many: bool = True) -> str:
    """A Lark grammar (llguidance's dialect) of one call (or, `many`, one or more) of the allowed tools, arguments
    per schema."""
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        allowed = [t for t in tools if t["function"]["name"] == name]
        if not allowed:
            raise SpecdecodeError(f"tool_choice names function '{name}', which is not among the tools")
    else:
        allowed = tools
    schemas = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                "properties": {"name": {"const": t["function"]["name"]},
                               "arguments": own_root(t["function"].get("parameters"), i)}}
               for i, t in enumerate(allowed)]
    call = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    start = 'start: call ("\\n" call)*\n' if many else "start: call\n"
    return (start + f'call: {json.dumps(OPEN)} "\\n" body "\\n" {json.dumps(CLOSE)}\n'
            f"body: %json {json.dumps(call)}\n")


def own_root(parameters: dict | None, index: int) -> dict:
    """A tool's arguments schema as it is embedded in the call's: with a base URI of its own ($id), so that its
    `#` and `#/$defs/...` references point into it, not into the call object around it."""
    if not parameters:
        return {"type": "object"}
    return parameters if "$id" in parameters else {"$id": f"urn:specdecode:tool-{index}", **parameters}


def parse(text: str, tools: list[dict]) -> tuple[str | None, list[ToolCall]]:
    """An answer -> (its text outside tool calls, None when there is none; the calls of known tools in it).
    A block that is not a JSON call of a known tool stays in the text."""
    known = {t["function"]["name"] for t in tools}
    calls: list[ToolCall] = []
    kept: list[str] = []
    last = 0
    for match in CALL_BLOCK.finditer(text):
        try:
            body = json.loads(match.group(1))
            name, arguments = body["name"], body.get("arguments", {})
        except (ValueError, KeyError, TypeError):
            continue
        if name not in known:
            continue
        kept.append(text[last : match.start()])
        last = match.end()
        calls.append(ToolCall(name, json.dumps(arguments, ensure_ascii=False)))
    kept.append(text[last:])
    content = "".join(kept).strip()
    return (content or None) if calls else text, calls
