"""The one error that means "this configuration cannot work here", whatever is retried."""

from __future__ import annotations


class ConfigError(ValueError):
    """A model, a setting or a machine that cannot serve as configured: a model path that does not
    exist, an architecture this engine does not implement, a KV cache larger than the free memory,
    a port in use. Starting the process again changes nothing, so `strata` prints the message as
    one line and exits with code 2 (strata/startup.py), and `strata serve` then stops instead of
    restarting its worker."""
