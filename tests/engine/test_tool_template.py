"""A GGUF's `tokenizer.chat_template.tool_use` renders the requests that carry tools; the plain
chat template the rest (engine/tokenizer.py)."""

from __future__ import annotations

from engine.tokenizer import Tokenizer


class RecordingTokenizer:
    """What Tokenizer needs of transformers' tokenizer; apply_chat_template says which template it got."""

    eos_token_id = 0
    unk_token_id = None
    chat_template = "PLAIN"

    def convert_tokens_to_ids(self, name: str) -> None:
        return None

    def __len__(self) -> int:
        return 10

    def apply_chat_template(self, messages, tools=None, chat_template=None, **kwargs) -> str:  # noqa: ANN001
        return f"{chat_template or self.chat_template}|{len(tools or [])}"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]


def test_the_tool_template_renders_only_requests_with_tools():
    tok = Tokenizer(RecordingTokenizer(), tool_template="{{ tools }}<tool_call>")
    assert tok.render_chat([{"role": "user", "content": "hi"}]) == "PLAIN|0"
    assert tok.render_chat([{"role": "user", "content": "hi"}], tools=[{"type": "function"}]) == \
        "{{ tools }}<tool_call>|1"
    assert tok.chat_template == "{{ tools }}<tool_call>"  # the one the tool format is read from


def test_without_a_tool_template_the_chat_template_renders_tools_too():
    tok = Tokenizer(RecordingTokenizer())
    assert tok.render_chat([{"role": "user", "content": "hi"}], tools=[{"type": "function"}]) == "PLAIN|1"
    assert tok.chat_template == "PLAIN"
