"""Text a client sends must be valid Unicode. JSON can carry a lone surrogate (`"\\ud800"`),
which Python decodes into a str that UTF-8 cannot encode: it would fail later, in the tokenizer,
in Redis or in the answer, as a 500. Request bodies are checked once, whole, at the door."""

from __future__ import annotations

from pydantic_core import PydanticCustomError

TEXT_ENCODING = "text_encoding"  # the validation error's type


def unencodable_path(value: object) -> str | None:
    """The dotted path (`messages.0.content`) of the first string or key inside `value` that
    UTF-8 cannot encode, or None. Iterative: a deeply nested body cannot exhaust the stack."""
    pending: list[tuple[tuple, object]] = [((), value)]
    while pending:
        path, item = pending.pop()
        if isinstance(item, str):
            if not _encodes(item):
                return ".".join(map(str, path)) or None
        elif isinstance(item, dict):
            for key, inner in reversed(list(item.items())):
                if isinstance(key, str) and not _encodes(key):
                    return ".".join(map(str, path)) or "(a key)"
                pending.append(((*path, key), inner))
        elif isinstance(item, list):
            pending.extend(((*path, index), inner) for index, inner in reversed(list(enumerate(item))))
    return None


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def require_unicode(body: object) -> object:
    """A model's `before` check: the whole body, or a validation error whose context names the
    field (shapes.errors.validation_error makes it the error's `param`)."""
    field = unencodable_path(body)
    if field is not None:
        raise PydanticCustomError(
            TEXT_ENCODING, "text is not valid Unicode (a lone surrogate): UTF-8 cannot encode it",
            {"field": field},
        )
    return body
