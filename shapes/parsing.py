"""An answer's text split into what OpenAI's clients read apart: the thinking
(`reasoning_content`), the content, and the tool calls, in the served model's own format.

One table of the formats models are trained on (`FORMATS`), one chosen per model from its chat
template (`tool_format`), and one incremental splitter (`AnswerSplitter`) that the stream and
the whole answer both use: text goes in as the worker streams it, in pieces of any size; parts
come out as soon as they are certain. Text that might be the start of a marker (`<tool_call>`,
`</think>`) is held back until the next piece decides it, as stop strings are in workers/text.py.
A call's JSON is parsed with `json.JSONDecoder.raw_decode`, never by a regular expression."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

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


FORMATS: dict[str, ToolFormat] = {
    # Hermes / Qwen 2.5 / Qwen 3 (and the fallback template's): <tool_call>\n{json}\n</tool_call>
    "hermes": ToolFormat("hermes", "<tool_call>", "</tool_call>", "arguments"),
    # Llama 3.1 / 3.2's JSON tool calling: the answer is {"name": ..., "parameters": {...}}
    "llama3_json": ToolFormat("llama3_json", "", "", "parameters"),
    # Mistral: [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]
    "mistral": ToolFormat("mistral", "[TOOL_CALLS]", "", "arguments", is_list=True),
}
FALLBACK = FORMATS["hermes"]


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
    """How an answer is to be split: a tool format (None: calls are not looked for) and where
    thinking stands at its start: "open" (the prompt opened it), "maybe" (the model may open it
    first), or None (no thinking)."""

    tools: str | None = None
    thinking: str | None = None

    @property
    def is_plain(self) -> bool:
        return self.tools is None and self.thinking is None

    def fields(self) -> dict[str, str]:
        """As stored beside its request (the request hash, a batch's line): a reader by id splits
        the answer the same way."""
        return {"tool_format": self.tools or "", "thinking": self.thinking or ""}

    @classmethod
    def of(cls, stored: dict[str, str]) -> "Reading":
        return cls(stored.get("tool_format") or None, stored.get("thinking") or None)


class AnswerSplitter:
    def __init__(self, reading: Reading, id_prefix: str = "call") -> None:
        self.format = FORMATS[reading.tools] if reading.tools else None
        self._state = {"open": "thinking", "maybe": "start"}.get(reading.thinking or "", "content")
        self._buffer = ""
        self._calls = 0
        self._id_prefix = id_prefix
        self._content_started = False

    @property
    def num_calls(self) -> int:
        return self._calls

    def push(self, text: str) -> Parts:
        self._buffer += text
        return self._advance(final=False)

    def finish(self) -> Parts:
        return self._advance(final=True)

    # ---- the states ------------------------------------------------------------------------

    def _advance(self, final: bool) -> Parts:
        out = Parts()
        while True:
            before = (self._state, len(self._buffer))
            getattr(self, f"_{self._state}")(out, final)
            if (self._state, len(self._buffer)) == before:
                return out

    def _start(self, out: Parts, final: bool) -> None:
        stripped = self._buffer.lstrip()
        if stripped.startswith(THINK_OPEN):
            self._buffer = stripped[len(THINK_OPEN):]
            self._state = "thinking"
        elif final or not THINK_OPEN.startswith(stripped):
            self._state = "content"

    def _thinking(self, out: Parts, final: bool) -> None:
        at = self._buffer.find(THINK_CLOSE)
        if at != -1:
            out.reasoning += self._buffer[:at]
            self._buffer = self._buffer[at + len(THINK_CLOSE):]
            self._state = "content"
            return
        keep = 0 if final else _partial(self._buffer, THINK_CLOSE)
        out.reasoning += self._buffer[:len(self._buffer) - keep]
        self._buffer = self._buffer[len(self._buffer) - keep:]

    def _content(self, out: Parts, final: bool) -> None:
        if not self._content_started:  # the blank lines after </think> or before a call are no content
            self._buffer = self._buffer.lstrip()
            if not self._buffer and not final:
                return
            self._content_started = True
        fmt = self.format
        if fmt is not None and not fmt.start:  # the whole answer is a call, or is content
            if self._buffer.startswith("{") and self._calls == 0:
                self._state = "call"
                return
            fmt = None
        if fmt is None:
            out.content += self._buffer
            self._buffer = ""
            return
        at = self._buffer.find(fmt.start)
        if at != -1:
            out.content += self._buffer[:at].rstrip() if at else ""
            self._buffer = self._buffer[at + len(fmt.start):]
            self._state = "call"
            return
        # held back: what may start the marker, and trailing blanks (dropped if a call follows)
        keep = 0
        if not final:
            keep = _partial(self._buffer, fmt.start)
            before = self._buffer[:len(self._buffer) - keep]
            keep += len(before) - len(before.rstrip())
        out.content += self._buffer[:len(self._buffer) - keep]
        self._buffer = self._buffer[len(self._buffer) - keep:]

    def _call(self, out: Parts, final: bool) -> None:
        fmt = self.format
        assert fmt is not None
        end = self._buffer.find(fmt.end) if fmt.end else -1
        if end == -1 and not final:
            return  # the call is not whole yet
        body = self._buffer if end == -1 else self._buffer[:end]
        calls = self._parse(body)
        if calls is None:  # not a call after all: the text is content
            out.content += (fmt.start if fmt.start else "") + self._buffer
            self._buffer = ""
            self._state = "content"
            return
        out.tool_calls += calls
        self._buffer = "" if end == -1 else self._buffer[end + len(fmt.end):].lstrip()
        self._state = "content"
        self._content_started = False

    def _parse(self, body: str) -> list[ToolCall] | None:
        fmt = self.format
        assert fmt is not None
        try:
            value, _ = json.JSONDecoder().raw_decode(body.strip())
        except ValueError:
            return None
        items = value if fmt.is_list and isinstance(value, list) else [value]
        calls = []
        for item in items:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                return None
            arguments = item.get(fmt.arguments_key, item.get("arguments", {}))
            text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
            calls.append(ToolCall(self._calls, f"{self._id_prefix}_{self._calls}", item["name"], text))
            self._calls += 1
        return calls


def split_whole(text: str, reading: Reading, id_prefix: str = "call") -> Parts:
    """The whole answer at once: what the stream gives, joined."""
    splitter = AnswerSplitter(reading, id_prefix)
    first, last = splitter.push(text), splitter.finish()
    return Parts(first.reasoning + last.reasoning, first.content + last.content,
                 first.tool_calls + last.tool_calls)


def _partial(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
