"""The one error that means "this configuration cannot work here", whatever is retried."""

from __future__ import annotations


class ConfigError(ValueError):
    """A model, a setting or a machine that cannot serve as configured: a model path that does not
    exist, an architecture this engine does not implement, a KV cache larger than the free memory,
    a port in use. Starting the process again changes nothing, so `strata` prints the message as
    one line and exits with code 2 (strata/startup.py), and `strata serve` then stops instead of
    restarting its worker."""


class RequestError(ValueError):
    """One request's own input made the engine stop it (its grammar did not compile, or left no
    token to take): that request fails with `code`, and nothing else does."""

    code = "request_error"


class RowsFailed(Exception):
    """A decode step in which some rows' requests failed on their own account (RequestError):
    `failed` by slot, and `tokens`, by slot, what every other row of the step produced, exactly as
    a step without the failed rows would have. The caller ends the failed requests and takes the
    others' tokens as it would a normal step's."""

    def __init__(self, tokens: dict[int, list[int]], failed: dict[int, RequestError]) -> None:
        super().__init__("; ".join(f"slot {slot}: {error}" for slot, error in sorted(failed.items())))
        self.tokens = tokens
        self.failed = failed
