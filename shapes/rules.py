"""The generation endpoints' own rules for turning a validated body into a queued request: the
model asked for, n, tokenizing, and the answer length that fits the context. The API applies them
to each request; batch creation to each line, so a line is refused exactly as the endpoint would."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Protocol

from jinja2 import TemplateError

from queues.records import QueuedRequest
from shapes import tool_prompt
from shapes.constraints import answer_grammar
from shapes.errors import ApiError
from shapes.fields import IgnoredFields
from shapes.parsing import THINK_CLOSE, AnswerTemplate, Reading, ToolFormat, answer_template, tool_format
from shapes.requests import ChatCompletionRequest, CompletionRequest, GenerationBody

N_MAX = 16  # answers one request may ask for (`n`); each takes a slot

# chat_template_kwargs that would change what the template is asked for, not how it words it
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "conversation", "tools", "documents", "tokenize",
                                      "add_generation_prompt", "continue_final_message", "return_dict",
                                      "return_tensors", "padding", "truncation", "chat_template"})


class TokenizerLike(Protocol):
    """What the rules need of engine.tokenizer.Tokenizer (tests pass a small fake)."""

    def encode(self, text: str) -> list[int]: ...
    def encode_chat(self, messages: list[dict]) -> list[int]: ...  # tools=, and template kwargs, when asked
    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True)
class Rules:
    model_name: str  # the served model: the only `model` a body may name
    tokenizer: TokenizerLike
    ctx: int  # tokens one request may hold: prompt + answer
    default_max_tokens: int
    ignored: IgnoredFields = field(default_factory=IgnoredFields)  # shared by the copies rules_now makes
    # the model's sampling defaults (engine.generation_config): what a body that sets none gets
    defaults: dict[str, float] = field(default_factory=dict)
    slots: int | None = None  # the most slots a live worker has: n answers take n of one worker's (None: unknown)
    pool_tokens: int | None = None  # the smallest live worker's KV pool: prompt + answer must fit it too

    def sampling(self, body: GenerationBody, name: str, fallback: Any) -> Any:
        """The body's value when it set one, else the model's default, else `fallback`."""
        value = getattr(body, name)
        if name in body.model_fields_set and value is not None:
            return value
        return self.defaults.get(name, fallback)

    def logit_bias(self, body: GenerationBody) -> list[tuple[int, float]]:
        pairs = body.bias_pairs()
        vocab = getattr(self.tokenizer, "vocab_size", None)
        outside = [t for t, _ in pairs if vocab is not None and t >= vocab]
        if outside:
            raise ApiError(400, f"logit_bias names token ids outside the vocabulary (0..{vocab - 1}): {outside[:5]}",
                           code="invalid_value", param="logit_bias")
        return pairs

    def check(self, body: GenerationBody) -> list[str]:
        """What comes before tokenizing: the fields (shapes/fields.py), the model asked for, and n.
        Returns the names of the fields ignored (not OpenAI's), logged once each."""
        ignored = body.unknown_fields()
        self.ignored.note(ignored)
        if body.model and body.model != self.model_name:
            raise ApiError(
                404, f"The model '{body.model}' does not exist; this server serves '{self.model_name}'.",
                code="model_not_found", param="model",
            )
        if not 1 <= body.n <= N_MAX:
            raise ApiError(400, f"n must be from 1 to {N_MAX}, got {body.n}.", code="invalid_value", param="n")
        problem = body.tool_choice_problem() if isinstance(body, ChatCompletionRequest) else None
        if problem:
            raise ApiError(400, problem, code="invalid_value", param="tool_choice")
        return ignored

    def prompt(self, body: GenerationBody) -> list[int]:
        """The prompt's token ids (CPU-bound: a long prompt belongs in a thread)."""
        param = body.prompt_param
        if isinstance(body, ChatCompletionRequest):
            ids = self._chat_prompt(body)
        elif isinstance(body, CompletionRequest):
            prompts = body.prompts()
            if len(prompts) != 1:
                raise ApiError(400, "prompt must be one prompt: a string, token ids, or a list holding exactly one "
                               "of them.", param=param, code="unsupported_value")
            ids = self.tokenizer.encode(prompts[0]) if isinstance(prompts[0], str) else self.token_ids(prompts[0], param)
        else:
            raise TypeError(f"no prompt rule for {type(body).__name__}")
        if not ids:
            raise ApiError(400, "The prompt is empty (no tokens).", param=param, code="invalid_value")
        return ids

    @property
    def chat_template(self) -> str | None:
        return getattr(self.tokenizer, "chat_template", None)

    @property
    def tool_format(self) -> tuple[ToolFormat, bool]:
        """The served model's tool-call format and whether its template renders tools (shapes/parsing.py)."""
        return tool_format(self.chat_template)

    def _chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        fmt, native = self.tool_format
        kwargs = dict(body.chat_template_kwargs or {})
        reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs))
        if reserved:
            raise ApiError(400, f"chat_template_kwargs may not set {', '.join(reserved)}.",
                           code="invalid_value", param="chat_template_kwargs")
        plain = not body.offers_tools and not kwargs and not any(m.tool_calls or m.role == "tool" for m in body.messages)
        try:
            if plain:  # what every template reads, and every tokenizer (tests' fakes too) takes
                return self.tokenizer.encode_chat(tool_prompt.fallback_messages(body, fmt))
            if native:
                return self.tokenizer.encode_chat(tool_prompt.native_messages(body), tools=tool_prompt.native_tools(body),
                                                  **kwargs)
            return self.tokenizer.encode_chat(tool_prompt.fallback_messages(body, fmt), **kwargs)
        except (ValueError, TypeError, TemplateError) as error:  # no chat template, or the template refused them
            raise ApiError(400, str(error) or "the chat template refused these messages", param="messages",
                           code="invalid_value") from None

    @cached_property
    def answer_template(self) -> AnswerTemplate:
        """How the served model's answers split (shapes/parsing.py), chosen once: its tokenizer's
        own response_template, else the table's entry for its chat template."""
        return answer_template(self.chat_template, getattr(self.tokenizer, "response_template", None))

    def reading(self, body: GenerationBody, prompt: list[int]) -> Reading:
        """How the answer is split (shapes/parsing.py): tool calls looked for, thinking."""
        if not isinstance(body, ChatCompletionRequest):
            return Reading()
        return self.answer_template.reading(body.offers_tools, lambda: self.tokenizer.decode(prompt))

    def token_ids(self, ids: list[int], param: str) -> list[int]:
        """A prompt given as token ids: each must be in the vocabulary."""
        vocab = getattr(self.tokenizer, "vocab_size", None)
        outside = [t for t in ids if t < 0 or (vocab is not None and t >= vocab)]
        if outside:
            raise ApiError(400, f"The prompt holds token ids outside the vocabulary (0..{(vocab or 0) - 1}): "
                           f"{outside[:5]}", param=param, code="invalid_value")
        return list(ids)

    def max_tokens(self, prompt_len: int, requested: int | None, param: str) -> int:
        """What was asked (default_max_tokens when nothing was), lowered so that prompt + answer
        fit the context (`ctx`) and a worker's whole KV pool. A prompt that leaves no room in
        either is refused, naming both numbers (workers/admission.py `never_fits` says the same)."""
        room = self.ctx - prompt_len
        if room <= 0:
            raise ApiError(
                400,
                f"This model's context is {self.ctx} tokens; the prompt has {prompt_len}, "
                f"which leaves no room for an answer.",
                code="context_length_exceeded", param=param,
            )
        if self.pool_tokens is not None and prompt_len >= self.pool_tokens:
            raise ApiError(
                400,
                f"The KV pool holds {self.pool_tokens} tokens; the prompt has {prompt_len}, "
                f"which leaves no room for an answer.",
                code="context_length_exceeded", param=param,
            )
        wanted = self.default_max_tokens if requested is None else requested
        return min(wanted, room, room if self.pool_tokens is None else self.pool_tokens - prompt_len)

    def queued(self, request_id: str, body: GenerationBody, prompt: list[int], priority: int) -> QueuedRequest:
        max_tokens = self.max_tokens(len(prompt), body.requested_max_tokens(), body.prompt_param)
        grammar = after = None
        if isinstance(body, ChatCompletionRequest):
            grammar = answer_grammar(body, self.tool_format[0])
            # once a grammar is complete only an end token fits it: nothing may mask or skip that end
            for name in ("ignore_eos", "min_tokens"):
                if grammar and getattr(body, name):
                    raise ApiError(400, f"{name} cannot be combined with response_format or a forced tool call.",
                                   code="unsupported_value", param=name)
            # a model whose prompt opened its thinking is free until it ends; one that may open it (`maybe`)
            # is constrained at once: it answers without thinking
            after = THINK_CLOSE if grammar and self.reading(body, prompt).thinking_open else None
        if self.slots is not None and body.n > self.slots:
            raise ApiError(400, f"n={body.n} answers take {body.n} slots of one worker together; the workers "
                           f"serving this model have at most {self.slots}.", code="invalid_value", param="n")
        echo = isinstance(body, CompletionRequest) and body.echo
        if max_tokens == 0 and not echo:
            raise ApiError(400, "max_tokens 0 generates nothing: it needs echo (prompt scoring).",
                           code="invalid_value", param="max_tokens")
        return QueuedRequest(
            id=request_id,
            priority=priority,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=float(self.sampling(body, "temperature", 1.0)),
            top_p=float(self.sampling(body, "top_p", 1.0)),
            top_k=max(int(self.sampling(body, "top_k", 0)), 0),
            seed=body.seed,
            min_tokens=min(body.min_tokens, max_tokens),
            ignore_eos=body.ignore_eos,
            stop=body.stop_list(),
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=float(self.sampling(body, "repetition_penalty", 1.0)),
            min_p=float(self.sampling(body, "min_p", 0.0)),
            logit_bias=self.logit_bias(body),
            grammar=grammar,
            grammar_after=after,
            logprobs=body.logprob_count(),
            echo=echo,
            prompt_logprobs=body.logprob_count() if echo else None,
            n=body.n,
        )
