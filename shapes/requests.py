"""Request bodies of /v1/chat/completions and /v1/completions, in OpenAI's shapes. A body's
undeclared fields are kept (`model_extra`) and classified by shapes/fields.py: refused with a 400,
accepted (they change nothing), or ignored and named in a header. Nested parts ignore theirs.

Every number the engine uses is bounded here, so that no value a client controls can fail a
worker later: seed fits in 64 bits (what torch's generator takes), temperature is 0 (greedy) or
at least MIN_TEMPERATURE, top_p at least MIN_TOP_P, top_k a 32-bit integer. max_tokens and
min_tokens are lowered to fit the context (shapes.rules). Text must be valid Unicode."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from shapes import fields
from shapes.text import require_unicode

SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
MIN_TEMPERATURE = 0.01  # below it (but above 0) sampling is greedy in all but name, then overflows
MIN_TOP_P = 0.01  # the top token alone is kept from here down; tinier values vanish in float32
TOP_K_MAX = 2**31 - 1
PENALTY_MAX = 2.0  # presence/frequency: OpenAI's range, -2..2
REPETITION_MIN, REPETITION_MAX = 0.01, 10.0  # transformers' repetition_penalty: 1 is off
LOGIT_BIAS_MAX = 100.0  # OpenAI's range, -100..100; -100 bans the token
LOGIT_BIAS_ENTRIES = 1024
TOP_LOGPROBS_MAX = 20


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class FunctionCall(_Lenient):
    name: str
    arguments: str = "{}"  # JSON text, as OpenAI sends it


class ToolCallPart(_Lenient):
    """An earlier assistant turn's call (history)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallPart] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: which call it answers
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class FunctionSpec(_Lenient):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema; absent: no arguments
    strict: bool | None = None


class Tool(_Lenient):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaSpec(_Lenient):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_with_json_schema(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs a json_schema object")
        return self


class StreamOptions(_Lenient):
    include_usage: bool = False
    detach: bool = False  # keep running after the client leaves (re-attach by id)


class GenerationBody(BaseModel):
    """What chat and text completions share."""

    model_config = ConfigDict(extra="allow")  # classified by `unknown_fields`, never dropped unseen

    prompt_param: ClassVar[str]  # the field a prompt error names
    refused: ClassVar[dict[str, fields.Refused]]
    accepted: ClassVar[dict[str, str]]

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, ge=MIN_TOP_P, le=1.0)
    top_k: int = Field(0, ge=-1, le=TOP_K_MAX)  # 0 or -1: off
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    presence_penalty: float = Field(0.0, ge=-PENALTY_MAX, le=PENALTY_MAX)
    frequency_penalty: float = Field(0.0, ge=-PENALTY_MAX, le=PENALTY_MAX)
    # None: the model's generation_config.json, else off (shapes.rules)
    repetition_penalty: float | None = Field(None, ge=REPETITION_MIN, le=REPETITION_MAX)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    # token id (a string, as JSON keys are) -> bias; the ids are checked against the vocabulary in shapes.rules
    logit_bias: dict[str, float] | None = Field(None, max_length=LOGIT_BIAS_ENTRIES)
    priority: Any = None  # never a validation error: see api.priority
    # seconds it may wait for a slot (api/queue_timeout.py); unlike priority a bad value is a 400
    queue_timeout: float | None = Field(None, gt=0, le=7 * 24 * 3600, allow_inf_nan=False)
    # answer 202 at once; the request runs with nobody listening (GET /v1/requests/{id})
    background: bool = False

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, body: Any) -> Any:
        return require_unicode(body)

    @field_validator("logit_bias")
    @classmethod
    def _token_ids_and_bounded(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not key.strip().isdigit():
                raise ValueError(f"keys must be token ids (non-negative integers), got {key!r}")
            if not -LOGIT_BIAS_MAX <= bias <= LOGIT_BIAS_MAX:
                raise ValueError(f"biases must be within -{LOGIT_BIAS_MAX:g}..{LOGIT_BIAS_MAX:g}, got {bias}")
        return value

    def bias_pairs(self) -> list[tuple[int, float]]:
        return sorted((int(k), float(v)) for k, v in (self.logit_bias or {}).items())

    @field_validator("temperature")
    @classmethod
    def _greedy_or_sane(cls, value: float) -> float:
        if 0.0 < value < MIN_TEMPERATURE:
            raise ValueError(f"must be 0 (greedy) or at least {MIN_TEMPERATURE}")
        return value

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def logprob_count(self) -> int | None:
        """None: no logprobs; N: each answer token's logprob and the N likeliest."""
        return None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def unknown_fields(self) -> list[str]:
        """The fields no table knows (to ignore, visibly); raises the 400 of a refused one."""
        return fields.classify(self.model_extra or {}, self.refused, self.accepted)


class ChatCompletionRequest(GenerationBody):
    prompt_param = "messages"
    refused = fields.REFUSED_CHAT
    accepted = fields.ACCEPTED_CHAT

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    # reaches the chat template (e.g. {"enable_thinking": false}); vLLM's and SGLang's name for it
    chat_template_kwargs: dict[str, Any] | None = None

    def tool_choice_problem(self) -> str | None:
        """Why tool_choice cannot be met with these tools (shapes.rules answers it as a 400)."""
        choice = self.tool_choice
        if (choice == "required" or isinstance(choice, NamedToolChoice)) and not self.tools:
            return "tool_choice asks for a tool call but tools is empty"
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in self.tools or []}:
            return f"tool_choice names '{choice.function.name}', which is not in tools"
        return None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=TOP_LOGPROBS_MAX)

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def offers_tools(self) -> bool:
        """Tools go into the prompt and calls are looked for (tool_choice "none": neither)."""
        return bool(self.tools) and self.tool_choice != "none"

    def forced_tools(self) -> list[FunctionSpec] | None:
        """The tools one of which the answer must call (required / named), else None."""
        if not self.offers_tools:
            return None
        if isinstance(self.tool_choice, NamedToolChoice):
            return [t.function for t in self.tools or [] if t.function.name == self.tool_choice.function.name]
        return [t.function for t in self.tools or []] if self.tool_choice == "required" else None
    def logprob_count(self) -> int | None:
        """None: no logprobs; N: each token's and the N likeliest."""
        return (self.top_logprobs or 0) if self.logprobs else None



class CompletionRequest(GenerationBody):
    prompt_param = "prompt"
    refused = fields.REFUSED_COMPLETIONS
    accepted = fields.ACCEPTED_COMPLETIONS

    # a string, a list of strings, token ids, or a list of token-id lists (what lm-eval sends)
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)  # 0 with echo: score the prompt, generate nothing
    logprobs: int | None = Field(None, ge=0, le=TOP_LOGPROBS_MAX)
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, value: str | list) -> str | list:
        if value == "" or value == [] or (isinstance(value, list) and any(p == "" or p == [] for p in value)):
            raise ValueError("the prompt is empty")
        return value

    def prompts(self) -> list[str | list[int]]:
        """Each prompt: a string or token ids."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if all(isinstance(p, int) for p in self.prompt):
            return [list(self.prompt)]  # type: ignore[arg-type]
        return list(self.prompt)  # type: ignore[arg-type]

    def prompt_text(self) -> str | None:
        """The one prompt given as text, or None (token ids, or not exactly one prompt)."""
        prompts = self.prompts()
        return prompts[0] if len(prompts) == 1 and isinstance(prompts[0], str) else None

    def logprob_count(self) -> int | None:
        return self.logprobs
