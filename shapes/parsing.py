"""An answer's text split into what OpenAI's clients read apart: the thinking
(`reasoning_content`), the content, and the tool calls, in the served model's own format.

The split is transformers' response parsing (`transformers.utils.chat_parsing.ResponseParser`,
driven by a declarative `response_template`): the model's own, where its tokenizer declares one
(`response_template` in tokenizer_config.json), else one built from a small table of the formats
models are trained on (`FORMATS`: Hermes/Qwen `<tool_call>` JSON, Llama 3.x JSON, Mistral
`[TOOL_CALLS]`), the entry chosen from the chat template (`tool_format`). `AnswerTemplate` is that
choice, made once per model; `Reading` is one request's (the template minus what the request
does not use, and the text the prompt already wrote of the answer, e.g. an opened `<think>`),
stored beside the request so any reader splits its answer alike. One incremental splitter
(`AnswerSplitter`) serves the stream and the whole answer: text goes in as the worker streams it,
in pieces of any size; parts come out as soon as they are certain (the parser holds back what may
be the start of a marker). A call's JSON is parsed by the template's content parser.

The table also says how each format writes a call (`ToolFormat`): shapes/constraints.py builds
a forced call's grammar from it and shapes/tool_prompt.py writes earlier calls back with it."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable

log = logging.getLogger(__name__)

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class ToolFormat:
    """How a family of models writes a tool call."""

    name: str
    start: str  # the text that opens a call ("" : the whole answer is the call's JSON)
    end: str  # the text that closes one ("" : the answer's end)
    arguments_key: str  # the JSON key holding the arguments
    is_list: bool = False  # a JSON list of calls after `start` (Mistral)

    def call_text(self, name: str, arguments: str) -> str:
        """One call as the model would write it (an assistant turn in a fallback-rendered history)."""
        body = f'{{"name": {json.dumps(name)}, "{self.arguments_key}": {arguments}}}'
        if self.is_list:
            return f"{self.start}[{body}]"
        return f"{self.start}\n{body}\n{self.end}" if self.start else body

    def calls_field(self) -> dict[str, Any]:
        """The response_template field its calls are read by (no transform: `_calls_of` reads
        the JSON, and JSON that is not a call becomes content)."""
        json_body = {"content": "json", "content_args": {"allow_non_json": True}}
        if self.is_list:  # the rest of the answer is one JSON list of calls
            return {"open": self.start, "close_pattern": r"\Z", **json_body}
        if self.start:
            return {"open_pattern": r"\s*" + re.escape(self.start), "close": self.end, "repeats": True, **json_body}
        return {"open_pattern": r"\A(?=\s*\{)", "close_pattern": r"\Z", **json_body}  # an answer that is a JSON object


FORMATS: dict[str, ToolFormat] = {
    # Hermes / Qwen 2.5 / Qwen 3 (and the fallback template's): <tool_call>\n{json}\n</tool_call>
    "hermes": ToolFormat("hermes", "<tool_call>", "</tool_call>", "arguments"),
    # Llama 3.1 / 3.2's JSON tool calling: the answer is {"name": ..., "parameters": {...}}
    "llama3_json": ToolFormat("llama3_json", "", "", "parameters"),
    # Mistral: [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]
    "mistral": ToolFormat("mistral", "[TOOL_CALLS]", "", "arguments", is_list=True),
}
FALLBACK = FORMATS["hermes"]
THINKING_FIELD = {"open": THINK_OPEN, "close": THINK_CLOSE, "content": "text", "content_args": {"strip": False}}
CONTENT_FIELD = {"content": "text", "content_args": {"strip": False}}  # the implicit region: what no marker opened
REASONING_NAMES = ("reasoning_content", "reasoning", "thinking")  # a template's field for the thinking


def tool_format(chat_template: str | None) -> tuple[ToolFormat, bool]:
    """The served model's format, from its chat template, and whether that template renders
    tools itself (False: Strata's fallback rendering, shapes/tool_prompt.py, in Hermes' format)."""
    template = chat_template or ""
    renders = "tools" in template
    if "[TOOL_CALLS]" in template:
        return FORMATS["mistral"], renders
    if "<tool_call>" in template:
        return FORMATS["hermes"], renders
    if "<|python_tag|>" in template or ("ipython" in template and "parameters" in template):
        return FORMATS["llama3_json"], renders
    return FALLBACK, False


def thinks(chat_template: str | None) -> bool:
    """Whether the template's model thinks between <think> and </think> (Qwen3, DeepSeek-R1)."""
    return THINK_CLOSE in (chat_template or "")


def prompt_opens_thinking(prompt_text: str) -> bool:
    """The rendered prompt ends inside <think> (the template opened it for the model)."""
    return prompt_text.rfind(THINK_OPEN) > prompt_text.rfind(THINK_CLOSE)


@dataclass(frozen=True)
class ToolCall:
    index: int
    id: str
    name: str
    arguments: str  # JSON text


@dataclass
class Parts:
    """What one piece of text (or the end) made certain."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


@dataclass(frozen=True)
class Reading:
    """How one answer is to be split: a response_template (JSON text; None: plain, nothing is
    split) and `prefix`, the answer's start as the prompt already wrote it (after the template's
    start anchor: "<think>\n" when the template opened the thinking). `thinking_open` (not
    stored: the API decides with it) says the answer starts inside the thinking."""

    template: str | None = None
    prefix: str = ""
    source: str = ""  # the template's origin: "model" or a FORMATS name (operators read it in the request hash)
    thinking_open: bool = field(default=False, compare=False)

    @property
    def is_plain(self) -> bool:
        return self.template is None

    def fields(self) -> dict[str, str]:
        """As stored beside its request (the request hash, a batch's line): a reader by id splits
        the answer the same way."""
        return {"response_template": self.template or "", "response_prefix": self.prefix, "tool_format": self.source}

    @classmethod
    def of(cls, stored: dict[str, str]) -> "Reading":
        return cls(stored.get("response_template") or None, stored.get("response_prefix", ""),
                   stored.get("tool_format", ""))


@dataclass(frozen=True)
class AnswerTemplate:
    """The served model's response_template, chosen once per model (`answer_template`)."""

    spec: dict[str, Any]
    source: str  # "model": its tokenizer's own; else the FORMATS entry it was built from

    def reading(self, tools: bool, prompt_text: Callable[[], str]) -> Reading:
        """The reading of one request: its calls looked for only when it offers tools; `prompt_text`
        gives the rendered prompt (its tail after the template's start anchor is the answer's
        prefix), asked only when something is to be split."""
        fields = {name: f for name, f in self.spec["fields"].items() if tools or name != "tool_calls"}
        if not any(name == "tool_calls" or name in REASONING_NAMES for name in fields):
            return Reading()
        spec = {**self.spec, "fields": fields}
        from transformers.utils.chat_parsing import ResponseParser
        from transformers.utils.chat_parsing.response_templates import load_response_template

        if self.source == "model":
            prefix = load_response_template(spec).truncate_past_last_anchor(prompt_text())
        else:  # the table's templates: the prompt can only have opened the thinking
            prefix = THINK_OPEN if "reasoning_content" in fields and prompt_opens_thinking(prompt_text()) else ""
        opened: set[str] = set()
        for event in ResponseParser(spec, prefix=prefix).initial_events:
            if event["type"] == "region_open":
                opened.add(event["field"])
            elif event["type"] == "region_close":
                opened.discard(event["field"])
        return Reading(json.dumps(spec), prefix, self.source, thinking_open=bool(opened & set(REASONING_NAMES)))


def answer_template(chat_template: str | None, own: dict[str, Any] | None = None) -> AnswerTemplate:
    """The model's own response_template where its tokenizer declares one, else the table's entry
    for its chat template, with thinking where the template thinks."""
    if own:
        return AnswerTemplate(own, "model")
    return _table_template(chat_template or "")


@lru_cache(maxsize=8)
def _table_template(chat_template: str) -> AnswerTemplate:
    fmt = tool_format(chat_template)[0]
    fields: dict[str, Any] = {}
    if thinks(chat_template):
        fields["reasoning_content"] = THINKING_FIELD
    fields["tool_calls"] = fmt.calls_field()
    fields["content"] = CONTENT_FIELD
    # an anchor that never matches: the prefix a reading holds is the answer's start already
    # (`AnswerTemplate.reading` gives it only an opened <think>)
    return AnswerTemplate({"start_anchor_pattern": r"(?!)", "fields": fields}, fmt.name)


class AnswerSplitter:
    def __init__(self, reading: Reading, id_prefix: str = "call") -> None:
        from transformers.utils.chat_parsing import ResponseParser

        assert reading.template is not None, "a plain reading is not split"
        self._parser: Any = ResponseParser(json.loads(reading.template), prefix=reading.prefix)
        self._broken = False  # the parser failed (a model's own template): the rest is content
        self._body = ""  # the open call region's text so far
        self._content_fresh = True  # the blank lines that start a content region are no content
        self._calls = 0
        self._id_prefix = id_prefix

    @property
    def num_calls(self) -> int:
        return self._calls

    def push(self, text: str) -> Parts:
        return self._run(text, final=False)

    def finish(self) -> Parts:
        return self._run("", final=True)

    def _run(self, text: str, final: bool) -> Parts:
        out = Parts()
        if self._broken:
            out.content += text
            return out
        try:
            events = self._parser.finalize()[1] if final else self._parser.feed(text)
        except (ValueError, KeyError, TypeError) as error:  # a template's parser or transform refused the text
            log.warning("the response template could not split this answer (%s); the rest is content", error)
            self._broken = True
            out.content += self._body + text
            return out
        for event in events:
            self._event(event, out)
        return out

    def _event(self, event: dict[str, Any], out: Parts) -> None:
        name, kind = event["field"], event["type"]
        if name == "tool_calls":
            if kind == "region_open":
                self._body = ""
            elif kind == "region_chunk":
                self._body += event["text"]
            else:
                calls = self._calls_of(event["value"])
                if calls is None:  # not a call after all: its text is content
                    out.content += self._body.strip()
                else:
                    out.tool_calls += calls
                self._body = ""
                self._content_fresh = True
        elif name in REASONING_NAMES:
            if kind == "region_chunk":
                out.reasoning += event["text"]
            elif kind == "region_close":
                self._content_fresh = True
        elif name == "content" and kind == "region_chunk":
            text = event["text"].lstrip() if self._content_fresh else event["text"]
            self._content_fresh = self._content_fresh and not text
            out.content += text

    def _calls_of(self, value: Any) -> list[ToolCall] | None:
        """A closed call region's value -> its calls: {"name", "arguments" (or "parameters")},
        also inside {"type": "function", "function": ...} (transformers' templates), or a list of them."""
        items = value if isinstance(value, list) else [value]
        calls = []
        for item in items:
            if isinstance(item, dict) and isinstance(item.get("function"), dict):
                item = item["function"]
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                return None
            arguments = item.get("arguments", item.get("parameters", {}))
            text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
            calls.append(ToolCall(self._calls + len(calls), f"{self._id_prefix}_{self._calls + len(calls)}",
                                  item["name"], text))
        self._calls += len(calls)
        return calls


def split_whole(text: str, reading: Reading, id_prefix: str = "call") -> Parts:
    """The whole answer at once: what the stream gives, joined."""
    splitter = AnswerSplitter(reading, id_prefix)
    first, last = splitter.push(text), splitter.finish()
    return Parts(first.reasoning + last.reasoning, first.content + last.content,
                 first.tool_calls + last.tool_calls)

