"""A chat body's messages (and tools) as the served model's chat template reads them.

A template that renders tools itself (Qwen, Hermes, Llama 3.1+, Mistral: `tools` appears in it)
gets OpenAI's tools as they are and the history in transformers' convention: an assistant
turn's `tool_calls` with their arguments as objects, `tool` turns with their `tool_call_id`.

A template without tool support (SmolLM2's) gets Strata's fallback, documented in docs/api.md:
the tools are described in a system message, in the Hermes format the parser reads
(shapes/parsing.py `FALLBACK`); an earlier assistant call is written back as the model would
have written it, and a tool's answer becomes a user turn inside <tool_response> tags (such
templates know no `tool` role)."""

from __future__ import annotations

import json
from typing import Any

from shapes.parsing import ToolFormat
from shapes.requests import ChatCompletionRequest, ChatMessage

FALLBACK_INSTRUCTIONS = (
    "You can call functions to help answer. Their signatures, one JSON object per line:\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call one, answer with its name and arguments as JSON between tags, exactly like this:\n"
    "<tool_call>\n{{\"name\": \"function name\", \"arguments\": {{\"argument\": \"value\"}}}}\n</tool_call>"
)


def _role(message: ChatMessage) -> str:
    # "developer" is OpenAI's newer name for "system"; chat templates know the old one.
    return "system" if message.role == "developer" else message.role


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text  # not JSON: the template gets the text as it was sent


def native_messages(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for m in body.messages:
        entry: dict[str, Any] = {"role": _role(m), "content": m.text()}
        if m.tool_calls:
            entry["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                for c in m.tool_calls]
        if m.role == "tool":
            if m.tool_call_id is not None:
                entry["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                entry["name"] = m.name
        out.append(entry)
    return out


def native_tools(body: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    if not body.offers_tools:
        return None
    return [t.model_dump(exclude_none=True) for t in body.tools or []]


def fallback_messages(body: ChatCompletionRequest, fmt: ToolFormat) -> list[dict[str, str]]:
    """Plain {"role", "content"} turns, the tools and calls written into them."""
    out: list[dict[str, str]] = []
    if body.offers_tools:
        lines = "\n".join(json.dumps(t.model_dump(exclude_none=True), ensure_ascii=False) for t in body.tools or [])
        out.append({"role": "system", "content": FALLBACK_INSTRUCTIONS.format(tools=lines)})
    for m in body.messages:
        role, text = _role(m), m.text()
        if m.tool_calls:
            calls = "\n".join(fmt.call_text(c.function.name, _json_text(c.function.arguments)) for c in m.tool_calls)
            text = f"{text}\n{calls}" if text else calls
        if m.role == "tool":
            role, text = "user", f"<tool_response>\n{text}\n</tool_response>"
            if out and out[-1]["role"] == "user" and out[-1]["content"].startswith("<tool_response>"):
                out[-1]["content"] += "\n" + text  # answers to parallel calls: one turn
                continue
        if role == "system" and body.offers_tools and len(out) == 1:
            out[0]["content"] = f"{text}\n\n{out[0]['content']}"  # the caller's system words, then the tools
            continue
        out.append({"role": role, "content": text})
    return out


def _json_text(arguments: str) -> str:
    try:
        return json.dumps(json.loads(arguments), ensure_ascii=False)
    except ValueError:
        return json.dumps(arguments)
