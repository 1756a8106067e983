"""An answer split into thinking, content and tool calls (shapes/parsing.py, transformers' response
parsing), in every format of the table and by a model's own response_template, whatever pieces
the text arrives in; and the prompt a tool history renders to."""

from __future__ import annotations

import json

import pytest

from shapes.parsing import FORMATS, AnswerSplitter, Parts, Reading, answer_template, split_whole, tool_format
from shapes.requests import ChatCompletionRequest
from shapes.rules import Rules

CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
# chat templates as the table recognises them (shapes/parsing.py tool_format); "</think>": one that thinks
TEMPLATES = {"hermes": "{{ tools }}<tool_call>", "llama3_json": "{{ tools }}<|python_tag|>",
             "mistral": "{{ tools }}[TOOL_CALLS]"}


def reading(fmt: str | None = None, thinking: str | None = None) -> Reading:
    """A request's reading from the table: calls in `fmt` looked for (None: no tools offered);
    thinking "maybe" (the model may open it) or "open" (the prompt opened it)."""
    template = TEMPLATES[fmt or "hermes"] + ("</think>" if thinking else "")
    prompt = "<|im_start|>assistant\n" + ("<think>\n" if thinking == "open" else "")
    return answer_template(template).reading(fmt is not None, lambda: prompt)


def pieces(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


def streamed(text: str, reading: Reading, size: int) -> Parts:
    splitter = AnswerSplitter(reading)
    out = [splitter.push(p) for p in pieces(text, size)] + [splitter.finish()]
    return Parts("".join(p.reasoning for p in out), "".join(p.content for p in out),
                 [c for p in out for c in p.tool_calls])


ANSWERS = [
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "Let me look.", [("get_weather", {"city": "Paris"})]),
    ("hermes", '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "b", '
     '"arguments": {"x": 1}}\n</tool_call>', "", [("a", {}), ("b", {"x": 1})]),
    ("hermes", "No tools needed: 4 < 5 and <tool is not a tag.", "No tools needed: 4 < 5 and <tool is not a tag.", []),
    ("hermes", "<tool_call>\n{not json}\n</tool_call>", "{not json}", []),  # not a call: its text is content
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [("get_weather", {"city": "Paris"})]),
    ("llama3_json", "{braces} in plain text", "{braces} in plain text", []),
    ("mistral", '[TOOL_CALLS][{"name": "a", "arguments": {"q": "x"}}, {"name": "b", "arguments": {}}]', "",
     [("a", {"q": "x"}), ("b", {})]),
]


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), ANSWERS)
@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_calls_and_content_split_alike_in_any_pieces(fmt, text, content, calls, size):
    parts = streamed(text, reading(fmt), size)
    assert parts.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parts.tool_calls] == calls
    assert [c.index for c in parts.tool_calls] == list(range(len(calls)))
    assert len({c.id for c in parts.tool_calls}) == len(calls)
    whole = split_whole(text, reading(fmt))
    assert (whole.content, whole.tool_calls) == (parts.content, parts.tool_calls)


@pytest.mark.parametrize("size", [1, 2, 5, 1000])
@pytest.mark.parametrize(("thinking", "text"), [
    ("maybe", "<think>\nThe user greets me.\n</think>\n\nHello!"),
    ("open", "\nThe user greets me.\n</think>\n\nHello!"),
])
def test_thinking_goes_apart_from_the_answer(thinking, text, size):
    parts = streamed(text, reading(thinking=thinking), size)
    assert parts.reasoning.strip() == "The user greets me."
    assert parts.content == "Hello!"


def test_a_model_that_may_think_but_does_not_has_only_content():
    parts = streamed("Hello there.", reading(thinking="maybe"), 1)
    assert (parts.reasoning, parts.content) == ("", "Hello there.")


def test_thinking_then_a_call():
    text = '<think>I need the weather.</think>\n<tool_call>\n{"name": "w", "arguments": {}}\n</tool_call>'
    parts = streamed(text, reading("hermes", thinking="maybe"), 4)
    assert parts.reasoning == "I need the weather."
    assert parts.content == ""
    assert [c.name for c in parts.tool_calls] == ["w"]


def test_the_format_is_chosen_from_the_template():
    assert tool_format("{% for t in tools %}<tool_call>{% endfor %}") == (FORMATS["hermes"], True)
    assert tool_format("{{ '[TOOL_CALLS]' }}{{ tools }}") == (FORMATS["mistral"], True)
    assert tool_format("<|python_tag|>{{ tools }}") == (FORMATS["llama3_json"], True)
    assert tool_format("<|im_start|>{{ message['content'] }}") == (FORMATS["hermes"], False)  # the fallback


class TemplateTokenizer:
    """Renders with transformers' own chat-template engine; one id per character."""

    def __init__(self, template: str) -> None:
        self.chat_template = template
        self.rendered = ""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None, **kwargs) -> list[int]:
        from transformers.utils.chat_template_utils import render_jinja_template

        rendered, _ = render_jinja_template([messages], tools=tools, chat_template=self.chat_template,
                                            add_generation_prompt=True, **kwargs)
        self.rendered = rendered[0]
        return self.encode(self.rendered)

    def decode(self, ids: list[int]) -> str:
        return "".join(map(chr, ids))


PLAIN_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Qwen 2.5's shape, written small: tools in the system turn, calls and responses in tags
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %}\n{{ t | tojson }}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n{% elif m.tool_calls %}<|im_start|>assistant\n{% for c in m.tool_calls %}"
    "<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}\n"
    "</tool_call>{% endfor %}<|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

HISTORY = {
    "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"},
    ],
    "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}],
}


def test_a_tool_turn_renders_through_the_models_own_template():
    tokenizer = TemplateTokenizer(TOOL_TEMPLATE)
    Rules("m", tokenizer, 4096, 16).prompt(ChatCompletionRequest.model_validate(HISTORY))
    assert tokenizer.rendered == (
        '<|im_start|>system\nTools:{"type": "function", "function": {"name": "get_weather", "parameters": '
        '{"type": "object", "properties": {"city": {"type": "string"}}}}}<|im_end|>\n'
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        "<|im_end|>\n<|im_start|>user\n<tool_response>\nSunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_a_tool_turn_renders_through_the_fallback_where_the_template_has_no_tools():
    tokenizer = TemplateTokenizer(PLAIN_TEMPLATE)
    Rules("m", tokenizer, 4096, 16).prompt(ChatCompletionRequest.model_validate(HISTORY))
    text = tokenizer.rendered
    assert text.startswith("<|im_start|>system\nYou can call functions")
    assert '{"type": "function", "function": {"name": "get_weather"' in text
    assert ('<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n'
            '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
            '<|im_start|>user\n<tool_response>\nSunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n') in text


def test_chat_template_kwargs_reach_the_template():
    template = "{% if enable_thinking is defined and not enable_thinking %}NO-THINK{% endif %}" + PLAIN_TEMPLATE
    tokenizer = TemplateTokenizer(template)
    rules = Rules("m", tokenizer, 4096, 16)
    rules.prompt(ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                                      "chat_template_kwargs": {"enable_thinking": False}}))
    assert tokenizer.rendered.startswith("NO-THINK<|im_start|>user\nhi")


# A model's own response_template, as a tokenizer declares it (transformers' format; this is the
# shape transformers' own `serve` uses for Qwen3): calls as {"type": "function", "function": ...}
QWEN3_RESPONSE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "reasoning_content": {"open": "<think>", "close": "</think>", "content": "text"},
        "tool_calls": {"open_pattern": r"\s*<tool_call>", "close": "</tool_call>", "repeats": True,
                       "content": "json", "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"\s*(?:<\|im_end\|>|<\|endoftext\|>)", "content": "text"},
    },
}


class OwnTemplateTokenizer(TemplateTokenizer):
    response_template = QWEN3_RESPONSE


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_a_models_own_response_template_splits_its_answers(size):
    rules = Rules("m", OwnTemplateTokenizer(PLAIN_TEMPLATE), 4096, 16)
    assert rules.answer_template.source == "model"  # chosen over the table's hermes entry
    body = ChatCompletionRequest.model_validate(HISTORY)
    # the prompt (earlier turns included) up to the last assistant anchor, which opened the thinking
    prompt = rules.tokenizer.encode("<|im_start|>assistant\n<think>old</think>done<|im_end|>\n"
                                    "<|im_start|>assistant\n<think>\n")
    read = rules.reading(body, prompt)
    assert read.source == "model" and read.prefix == "<think>\n" and read.thinking_open
    assert Reading.of(read.fields()) == read  # as a reader by id finds it in the request's hash
    text = 'The city is Paris.\n</think>\n\nLooking.\n<tool_call>\n{"name": "get_weather", "arguments": ' \
           '{"city": "Paris"}}\n</tool_call>'
    parts = streamed(text, read, size)
    assert parts.reasoning.strip() == "The city is Paris."
    assert parts.content == "Looking."
    assert [(c.name, json.loads(c.arguments)) for c in parts.tool_calls] == [("get_weather", {"city": "Paris"})]


def test_without_tools_offered_a_templates_calls_are_content():
    rules = Rules("m", OwnTemplateTokenizer(PLAIN_TEMPLATE), 4096, 16)
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]})
    read = rules.reading(body, rules.tokenizer.encode("<|im_start|>assistant\n"))
    assert "tool_calls" not in json.loads(read.template)["fields"] and not read.thinking_open
    parts = streamed('<think>hm</think>\n<tool_call>\n{"name": "x"}\n</tool_call>', read, 3)
    assert parts.reasoning == "hm" and parts.tool_calls == []
    assert parts.content == '<tool_call>\n{"name": "x"}\n</tool_call>'


def test_a_template_whose_parser_fails_leaves_the_rest_as_content():
    broken = {"start_anchor": "A:", "fields": {
        "tool_calls": {"open": "<c>", "close": "</c>", "content": "json",
                       "transform": {"function": "{missing}"}},  # a placeholder the scope lacks
        "content": {"content": "text"}}}
    read = answer_template(None, broken).reading(True, lambda: "A:")
    parts = streamed('Hi <c>{"name": "f"}</c> after', read, 1000)
    assert parts.tool_calls == []
    assert parts.content.startswith("Hi ") and parts.content.endswith(" after") and '"name": "f"' in parts.content


def test_a_tokenizer_folder_that_declares_a_response_template_is_read_by_it(tiny_model, tmp_path):
    import shutil

    from engine.tokenizer import Tokenizer

    folder = tmp_path / "with-template"
    shutil.copytree(tiny_model, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "response_template": QWEN3_RESPONSE}))
    tokenizer = Tokenizer.from_model_path(folder)
    assert tokenizer.response_template == QWEN3_RESPONSE
    assert Rules("m", tokenizer, 4096, 16).answer_template.source == "model"
    assert Tokenizer.from_model_path(tiny_model).response_template is None  # SmolLM2's: the table's entry
