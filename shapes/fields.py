"""Every field a generation body may carry, classified, so that none is silently dropped.

- honoured: a declared field of the request model (shapes/requests.py) that Strata acts upon;
- refused: an OpenAI field (or a well-known extension) that would change the answer and that
  Strata does not implement: a 400 `unsupported_parameter` naming it, unless its value asks for
  nothing (`logprobs: false`, `frequency_penalty: 0`, null);
- accepted: an OpenAI field that changes nothing about the answer, which clients send by
  default (`user`, `metadata`, `store`, ...): taken and not acted upon, on purpose;
- anything else is not OpenAI's: ignored, logged once per name, and listed in the answer's
  `x-strata-ignored-fields` header, so a misspelt `"priorty"` is visible.

docs/api.md has the same table in words (tests/api/test_fields.py holds the two together)."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from shapes.errors import ApiError

log = logging.getLogger("strata.api")

IGNORED_HEADER = "x-strata-ignored-fields"

_NOTHING = (None, False, 0, 0.0, "", {}, [])  # values of a refused field that ask for nothing


@dataclass(frozen=True)
class Refused:
    why: str
    neutral: tuple = _NOTHING  # these values ask for nothing: taken as absent

    def asks_for_something(self, value: object) -> bool:
        # the type too: `logprobs: 0` is no `false`, but `frequency_penalty: 0` is no penalty either
        return value is not None and not any(type(value) is type(n) and value == n for n in self.neutral)


# Both endpoints. Fields evals' issue (29) implements move from here to the request models.
_REFUSED_BOTH: dict[str, Refused] = {
    # extensions other servers honour; a client that sends them expects an effect
    "typical_p": Refused("typical_p is not implemented", (None, 1, 1.0)),
    "guided_json": Refused("use response_format json_schema"),
    "guided_regex": Refused("regular-expression constraints are not implemented"),
    "guided_choice": Refused("choice constraints are not implemented; use response_format json_schema with an enum"),
    "guided_grammar": Refused("grammar constraints are not implemented; use response_format json_schema"),
    "grammar": Refused("grammar constraints are not implemented; use response_format json_schema"),
    "json_schema": Refused("use response_format json_schema"),
}

REFUSED_CHAT: dict[str, Refused] = {
    **_REFUSED_BOTH,
    "audio": Refused("audio output is not supported"),
    "modalities": Refused("only text output", (None, ["text"])),
    "prediction": Refused("predicted outputs are not supported"),
    "reasoning_effort": Refused("the served model's thinking has no effort setting; "
                                "use chat_template_kwargs (e.g. enable_thinking)"),
    "verbosity": Refused("verbosity is not supported"),
    "web_search_options": Refused("web search is not supported"),
    "functions": Refused("the deprecated functions API is not supported; use tools"),
    "function_call": Refused("the deprecated functions API is not supported; use tool_choice"),
    "moderation": Refused("moderation is not supported"),
}

REFUSED_COMPLETIONS: dict[str, Refused] = {
    **_REFUSED_BOTH,
    "best_of": Refused("only best_of=1", (None, 1)),
    "suffix": Refused("suffix (fill-in-the-middle) is not supported"),
}

# OpenAI fields that change nothing about the answer: why each is taken and not acted upon.
ACCEPTED_CHAT: dict[str, str] = {
    "user": "an end-user id for the caller's abuse tracking",
    "safety_identifier": "an end-user id for the caller's abuse tracking",
    "metadata": "tags for stored completions; Strata stores none",
    "store": "OpenAI-side storage of completions; Strata stores none",
    "service_tier": "OpenAI's processing tier; Strata's urgency is `priority`",
    "prompt_cache_key": "a hint for OpenAI's prompt cache; Strata's slots reuse prefixes anyway",
    "prompt_cache_retention": "a hint for OpenAI's prompt cache",
    "prompt_cache_options": "a hint for OpenAI's prompt cache",
}
ACCEPTED_COMPLETIONS: dict[str, str] = {"user": ACCEPTED_CHAT["user"]}


@dataclass
class IgnoredFields:
    """Names of fields no table knows, logged once each per process (up to MAX_SEEN names: a
    client inventing names must not grow the set, or the log, without end)."""

    MAX_SEEN = 1000
    seen: set[str] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def note(self, names: list[str]) -> None:
        with self._lock:
            new = [n for n in names if n not in self.seen][: max(0, self.MAX_SEEN - len(self.seen))]
            self.seen.update(new)
        for name in new:
            log.warning("ignoring the request field %r: neither OpenAI's nor Strata's (listed in %s)",
                        name, IGNORED_HEADER)


def treatment(schema: type, name: str) -> str | None:
    """honoured, refused, accepted or None (not a field of this body: ignored), for a body class
    of shapes/requests.py (docs/api.md's table is checked against it)."""
    if name in schema.model_fields:  # type: ignore[attr-defined]
        return "honoured"
    if name in schema.refused:  # type: ignore[attr-defined]
        return "refused"
    if name in schema.accepted:  # type: ignore[attr-defined]
        return "accepted"
    return None


def header_value(names: list[str]) -> str:
    """The ignored names as one header value: ASCII (a header is latin-1), at most 20 of them."""
    # unicode_escape: control characters too become \xNN (uvicorn refuses them in a header)
    shown = [name.encode("unicode_escape").decode("ascii")[:64] or '""' for name in names[:20]]
    return ",".join(shown) + (f",(+{len(names) - 20} more)" if len(names) > 20 else "")


def classify(extra: dict[str, object], refused: dict[str, Refused], accepted: dict[str, str]) -> list[str]:
    """The undeclared fields of a body -> the names to ignore (not OpenAI's); raises the 400 of the
    first refused field that asks for something."""
    ignored = []
    for name, value in extra.items():
        rule = refused.get(name)
        if rule is not None:
            if rule.asks_for_something(value):
                raise ApiError(400, f"'{name}' is not supported by this server: {rule.why}.",
                               code="unsupported_parameter", param=name)
        elif name not in accepted:
            ignored.append(name)
    return ignored
