"""Request bodies of /v1/completions and /v1/chat/completions, validated strictly, and their SamplingParams.

Policy for OpenAI fields (documented in docs/server.md):
- supported: model, prompt | messages, max_tokens (max_completion_tokens), temperature, top_p, seed, stop, stream,
  stream_options.include_usage, n, presence_penalty, frequency_penalty, logit_bias, logprobs, top_logprobs, echo,
  response_format (text, json_object, json_schema), tools, tool_choice, parallel_tool_calls, prediction
  (Predicted Outputs); extensions: top_k, min_p, min_tokens, repetition_penalty, num_draft_tokens, ignore_eos.
- accepted only at their neutral value (clients often send them): best_of=1, no suffix, store off; `user` and
  `name` are accepted and ignored.
- anything else is refused with a 400 that names the fields, rather than silently ignored.
Types are strict (a string is not a number), since a wrong type is a client bug worth reporting.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from specdecode.config import SamplingParams
from specdecode.errors import SpecdecodeError
from specdecode.server.errors import ApiError
from specdecode.server.json_body import load_json

# Fields accepted only when they ask for nothing we would have to ignore: name -> neutral values.
NEUTRAL_ONLY: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "suffix": (None, ""),
    "store": (None, False),
}
IGNORED = ("user",)  # harmless bookkeeping fields: accepted with any value
MAX_STOP_STRINGS = 16
MAX_CHOICES = 16  # n: each choice is a running request of its own
MAX_TOP_LOGPROBS = 20
ROLES = ("system", "developer", "user", "assistant", "tool")  # the tags pydantic puts in an error's location


INTEGER_FIELDS = ("max_tokens", "max_completion_tokens", "top_k", "seed", "num_draft_tokens", "prompt", "n",
                  "logprobs", "top_logprobs", "min_tokens")


def _whole_numbers(value: Any) -> Any:
    """JSON Schema counts 749.0 as an integer, and so do we (in lists too); 749.5 and "749" stay errors."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**64:
        return int(value)
    if isinstance(value, list):
        return [_whole_numbers(v) for v in value]
    return value


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Strict):
    include_usage: bool = False


class TextPart(Strict):
    type: Literal["text"]
    text: str


class PredictionPart(Strict):
    type: Literal["text"]
    text: Annotated[str, Field(min_length=1)]


class Prediction(Strict):
    """Predicted Outputs: the text the answer is expected to be, mostly (a file the client asks to edit)."""

    type: Literal["content"]
    content: Annotated[str, Field(min_length=1)] | Annotated[list[PredictionPart], Field(min_length=1)]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class JsonSchemaFormat(Strict):
    name: Annotated[str, Field(min_length=1, max_length=64)] = "response"
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs a json_schema object with the schema")
        return self

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type}
        if self.json_schema is not None:
            out["json_schema"] = {"schema": self.json_schema.schema_}
        return out


# token id (as a string: JSON object keys are strings) -> bias in [-100, 100]. additionalProperties: the schema says
# that other keys are refused (patternProperties alone allows them).
LogitBias = Annotated[dict[Annotated[str, Field(pattern=r"^[0-9]{1,9}$")], Annotated[float, Field(ge=-100, le=100)]],
                      Field(json_schema_extra={"additionalProperties": False})]


class SamplingFields(Strict):
    @model_validator(mode="before")
    @classmethod
    def _integers(cls, body: Any) -> Any:
        if isinstance(body, dict):
            return {k: _whole_numbers(v) if k in INTEGER_FIELDS else v for k, v in body.items()}
        return body

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)  # OpenAI's default is 1.0 (sampling); send 0 for greedy
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)  # extension (vLLM has it too); 0 = off
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)  # what a torch generator takes
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    num_draft_tokens: int | None = Field(None, ge=0)  # extension: draft length for this request
    ignore_eos: bool = False  # extension: generate exactly max_tokens (load tests)
    prediction: Prediction | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0, le=10)  # extension (vLLM's)
    min_p: float = Field(0.0, ge=0, le=1)  # extension (vLLM's)
    min_tokens: int = Field(0, ge=0)  # extension (vLLM's)
    logit_bias: LogitBias | None = None
    response_format: ResponseFormat | None = None

    def bias_by_id(self) -> dict[int, float]:
        return {int(key): bias for key, bias in (self.logit_bias or {}).items()}

    def top_logprobs_wanted(self) -> int | None:
        """Alternatives per token to report (None: no logprobs)."""
        return None

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ApiError(400, f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}", "stop")
        return stops


NonEmptyText = Annotated[str, Field(min_length=1)]
ONE = {"maxItems": 1}
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(SamplingFields):
    # Text or token ids; a list of them is OpenAI's batch form, of which one prompt per request is served.
    # One prompt per request: the schema says so (maxItems 1), single_prompt() refuses a batch in plain words.
    prompt: (NonEmptyText | TokenIds | Annotated[list[NonEmptyText], Field(min_length=1, json_schema_extra=ONE)]
             | Annotated[list[TokenIds], Field(min_length=1, json_schema_extra=ONE)])

    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # the completions API: alternatives per token
    echo: bool = False

    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs

    def single_prompt(self) -> str | list[int]:
        """The prompt as text or token ids; batches of prompts are refused (one prompt per request)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise ApiError(400, f"prompt: send one prompt per request, got a batch of {len(prompt)}", "prompt")
            prompt = prompt[0]
        if not prompt:
            raise ApiError(400, "prompt: the prompt is empty", "prompt")
        return prompt


class FunctionCall(Strict):
    name: str
    arguments: str  # JSON text


class ToolCallIn(Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


Content = str | list[TextPart]


class Message(Strict):
    """A system, developer or user message."""

    role: Literal["system", "developer", "user"]
    content: Content
    name: str | None = None  # accepted and ignored

    def as_dict(self) -> dict[str, Any]:
        role = "system" if self.role == "developer" else self.role  # chat templates know "system"
        return {"role": role, "content": _text(self.content)}


class AssistantMessage(Strict):
    """An earlier answer: text, tool calls, or both."""

    role: Literal["assistant"]
    content: Content | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": "assistant", "content": _text(self.content)}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        return out


class ToolMessage(Strict):
    """A tool's result, for the call `tool_call_id`."""

    role: Literal["tool"]
    content: Content
    tool_call_id: str
    name: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"role": "tool", "content": _text(self.content), "tool_call_id": self.tool_call_id}


def _text(content: Content | None) -> str:
    return "" if content is None else content if isinstance(content, str) else "".join(p.text for p in content)


AnyMessage = Annotated[Message | AssistantMessage | ToolMessage, Field(discriminator="role")]


class FunctionSpec(Strict):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatRequest(SamplingFields):
    messages: list[AnyMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    def top_logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def message_dicts(self) -> list[dict[str, Any]]:
        return [m.as_dict() for m in self.messages]

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools the answer may call (None: none, or tool_choice "none")."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def choice_of_tool(self) -> str | dict:
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.model_dump()
        return self.tool_choice or "auto"


def parse_request(raw: bytes, model_cls: type[SamplingFields]) -> SamplingFields:
    """Raw body -> validated request, or an ApiError(400) whose message names every bad field."""
    body = load_json(raw)
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    body = _drop_neutral(body)
    try:
        return model_cls.model_validate(body)
    except ValidationError as e:
        raise _to_api_error(e) from None


def _drop_neutral(body: dict[str, Any]) -> dict[str, Any]:
    bad = [f"{k}={json.dumps(body[k])}" for k, ok in NEUTRAL_ONLY.items() if k in body and body[k] not in ok]
    if bad:
        raise ApiError(400, f"unsupported parameter value(s): {', '.join(bad)}; specdecode takes best_of=1, no "
                            "suffix and store off", bad[0].split("=")[0])
    return {k: v for k, v in body.items() if k not in NEUTRAL_ONLY and k not in IGNORED}


def _to_api_error(err: ValidationError) -> ApiError:
    unknown, problems = [], {}
    for e in err.errors():
        loc = _field_path(e["loc"])
        if e["type"] == "extra_forbidden":
            unknown.append(loc)
        else:
            problems.setdefault(loc, []).append(e["msg"])
    parts = [f"unsupported parameter(s): {', '.join(unknown)}"] if unknown else []
    parts += [f"{loc}: {' / '.join(dict.fromkeys(msgs))}" for loc, msgs in problems.items()]
    first = unknown[0] if unknown else next(iter(problems))
    return ApiError(400, "; ".join(parts), first.split(".")[0] or None)


def _field_path(loc: tuple) -> str:
    """("prompt", "list[int]", 0) -> "prompt.0": union members add their type to loc; keep what the client wrote."""
    def is_tag(part: str) -> bool:
        return part in ("str", "int", "float", "bool", *ROLES) or part.startswith(("list[", "function-", "json-",
                                                                                    "constrained-"))

    return ".".join(str(p) for p in loc if isinstance(p, int) or not is_tag(p)) or "body"


def sampling_params(req: SamplingFields, room: int, default_max_tokens: int | None) -> SamplingParams:
    """Request -> SamplingParams. `room` is what the context window leaves after the prompt; without an explicit
    max_tokens the request gets min(default, room) (chat: default None = the whole room)."""
    requested = req.max_tokens or getattr(req, "max_completion_tokens", None)
    if requested is not None and requested > room:
        raise ApiError(400, f"max_tokens is {requested} but the context window leaves {room} tokens after the "
                            "prompt: lower max_tokens or shorten the prompt", "max_tokens",
                       "context_length_exceeded")
    max_new = requested or min(default_max_tokens or room, room)
    try:
        return SamplingParams(temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, seed=req.seed,
                              max_new_tokens=max_new, stop=req.stop_strings(), ignore_eos=req.ignore_eos,
                              presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                              repetition_penalty=req.repetition_penalty, min_p=req.min_p, min_tokens=req.min_tokens,
                              logit_bias=req.bias_by_id(), logprobs=req.top_logprobs_wanted(),
                              prompt_logprobs=req.logprobs if getattr(req, "echo", False) else None)
    except SpecdecodeError as e:
        raise ApiError(400, str(e)) from None
