"""A request's prefix-affinity key: the hash of its prompt's first tokens, so that a worker that
holds that prefix in its KV cache can be preferred for it (docs/scheduling.md, "Prefix affinity").

Written on the request hash (`affinity`) by the one enqueue builder every enqueuer uses
(queues/scripts.py `enqueue`: the API, the batch job, the simulator), where the token ids are
already in hand: one hash of at most SPAN ids per request, no round trip, and head.lua hands it
to the workers with the priority it already reads. Workers compute the same key of the prompts
they hold (workers/affinity.py) and advertise it in their worker hash (`prefixes`)."""

from __future__ import annotations

import hashlib
from array import array
from typing import Sequence

BLOCK = 64  # the torch engine's KV block: a key covers whole blocks only
SPAN = 256  # the longest prefix a key covers


def span(num_tokens: int) -> int:
    """The prompt tokens a key covers: the longest whole-block prefix up to SPAN of the tokens a
    cache can serve (the prompt's last token is always read again, its logits give the first
    answer token); 0: too short for a key."""
    return min(SPAN, (num_tokens - 1) // BLOCK * BLOCK) if num_tokens > 1 else 0


def affinity_key(prompt: Sequence[int]) -> str | None:
    """16 hex digits naming the prompt's first span() tokens; None below one block. Prompts of
    different spans have different keys even when one starts the other."""
    n = span(len(prompt))
    if n <= 0:
        return None
    return hashlib.blake2b(array("q", prompt[:n]).tobytes(), digest_size=8).hexdigest()
