"""The real engine: a Transformer, its slots' positions and samplers, behind engine.protocol.Engine.
engine/load.py makes one from a model file."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Sequence

import torch

from engine.errors import RequestError, RowsFailed
from engine.grammar import Constraint, Grammars
from engine.lookup import Lookup
from engine.memory import release_freed_memory
from engine.model import KV_BUCKET, PROMPT_BLOCK, CacheIndex, ModelConfig, Transformer
from engine.protocol import DecodePath, SamplingParams, TokenLogprob
from engine.sampling import SlotSampler, sample_tokens, score_prompt
from engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    from engine.background import BackgroundBuild
    from engine.compiled import CompiledDecode

log = logging.getLogger(__name__)

SCORE_ROWS = 128  # prompt scoring: positions whose logits are made at once
TRIM_AFTER = 1024  # a read ending this many positions deep hands its freed heap back (`read`)

Drawn = tuple[torch.Tensor, torch.Tensor | None]
"""A step's logits [rows, V], which every row samples from, and, when some row asks for
logprobs, the logits those report ([rows, V], the scored rows exact: Transformer.exact_top)."""


def _halves(out: torch.Tensor, rows: int) -> Drawn:
    """exact_top's result -> `Drawn`: [2 * rows, V] when a scored row's reported logits are not
    its sampled ones (a low-precision head), else [rows, V], both."""
    return (out[:rows], out[rows:]) if out.shape[0] == 2 * rows else (out, None)


def _rows(logits: Drawn, rows: slice) -> Drawn:
    return logits[0][rows], None if logits[1] is None else logits[1][rows]


class TorchEngine:
    """Satisfies engine.protocol.Engine. Not thread-safe: one worker loop drives it."""

    def __init__(self, model: Transformer, tokenizer: Tokenizer | None, *, eos_token_ids: frozenset[int]) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.num_slots = model.num_slots
        self.ctx = model.ctx
        # the KV pool (engine/model.py `allocate_cache`): its blocks, and each slot's table of them
        self.kv_block = model.kv_block
        self.kv_tokens = model.num_kv_blocks * model.kv_block
        self._tables: list[list[int]] = model.tables.tolist()
        self._tables = [row if row[0] != model.spare_block else [] for row in self._tables]
        self.eos_token_ids = eos_token_ids
        self.device = model.device
        self.dtype = model.dtype
        self._positions = [0] * self.num_slots
        self._samplers = [SlotSampler.start(SamplingParams(temperature=0.0)) for _ in range(self.num_slots)]
        self.compiled: CompiledDecode | None = None
        self.grammars: Grammars | None = None  # made at the first constrained request
        self.building: BackgroundBuild | None = None  # the compiled step being built meanwhile
        # Slots whose request began before the compiled step took over: they decode eagerly to
        # their end, so a request's tokens never depend on when the switch came.
        self._eager = [False] * self.num_slots
        self.prompt_block = PROMPT_BLOCK
        self._lookups: list[Lookup] | None = None  # prompt lookup's, one a slot (use_prompt_lookup)
        self._held: list[list[int]] = [[] for _ in range(self.num_slots)]  # the ids each slot's cache holds
        # A recurrent model (Qwen3-Next): the position each slot's state is valid at; it cannot go
        # back, so a slot continues only from exactly there (or starts again at 0)
        self._state_at = [0] * self.num_slots
        # prompt scoring (params.prompt_logprobs): each slot's scored prompt tokens so far, and the
        # last read position's logits, which score the first token of the next chunk
        self._prompt_scores: list[list[TokenLogprob]] = [[] for _ in range(self.num_slots)]
        self._carry: list[torch.Tensor | None] = [None] * self.num_slots
        # the logits a read's first answer token was drawn from: its sibling answers' first tokens
        # are drawn from them too (fork)
        self._drawn_from: list[Drawn | None] = [None] * self.num_slots

    @property
    def prompt_lookup(self) -> bool:
        return self._lookups is not None

    @property
    def rewinds(self) -> bool:
        """Whether a slot's cache can be cut back to any earlier position (K/V entries are hidden
        by the mask). Not for a recurrent model: its state is valid at one position only, so no
        cached prefix is reused and no guessed token is taken back (docs/engine.md, "Recurrent state")."""
        return not self.model.cfg.recurrent

    @property
    def can_look_up(self) -> bool:
        """Prompt lookup is exact only where a row's logits are the same whatever shares its step
        (the CPU), and its step has two rows, which the compiled steps take only with two slots; a
        wrong guess is taken back, which a recurrent state cannot do (`rewinds`)."""
        return self.device.type == "cpu" and self.num_slots >= 2 and self.rewinds

    def use_prompt_lookup(self, on: bool = True) -> None:
        """A one-row decode step also checks guesses of the tokens after it (engine/lookup.py),
        yielding more than one token when they were right: exactly those of decoding one at a time."""
        if on and not self.can_look_up:
            raise ValueError("prompt lookup needs the CPU (row-independent kernels) and two slots")
        # a slot's earlier tokens are unknown here: its guesses start from what comes next (a
        # guess only decides whether a row is spent, never which tokens come out)
        self._lookups = [Lookup() for _ in range(self.num_slots)] if on else None

    def compile_decode(self, warm: bool = True, ahead: bool = True) -> float:
        """Decode through torch.compile from now on (engine/compiled.py); with `warm`, build the
        graphs now, and with `ahead` the steps' layers compiled ahead of time (engine/aot.py).
        Returns the seconds spent warming. Layers in oneDNN's prepacked form decode eagerly
        (`compiled.compilable`), and `compiled` stays None."""
        from engine.compiled import CompiledDecode, compilable

        if not compilable(self.model):
            log.warning("decoding eagerly: the compiled step cannot take oneDNN-prepacked linears (%s)",
                        self.model.forms)
            return 0.0
        self.compiled = CompiledDecode(self.model)
        if not warm:
            return 0.0
        return self.compiled.warm(sorted({1, min(2, self.num_slots), self.num_slots}), min(self.ctx, KV_BUCKET),
                                  ahead=ahead)

    def compile_in_background(self) -> None:
        """Decode eagerly now and through the packages compiled ahead of time once a low-priority
        child process has built them (engine/background.py); packages already cached are loaded
        now instead. Elsewhere (CUDA: its graphs are recorded in this process; a head or layers
        the packages cannot take) the compiled step is built now, as `compile_decode` does."""
        from engine import aot
        from engine.background import BackgroundBuild
        from engine.compiled import CompiledDecode, compilable

        if self.device.type != "cpu" or not compilable(self.model) or not aot.head_inside(self.model):
            self.compile_decode(warm=True)
            return
        steps = aot.packages(self.model)
        if all(step.ready for step in steps):
            self.compiled = CompiledDecode(self.model)
            self.compiled.packaged = steps
            return
        self.building = BackgroundBuild(self.model, steps).start()

    def decode_path(self) -> DecodePath:
        self._take_compiled()
        if self.compiled is not None:
            return DecodePath("compiled")
        if self.building is not None and self.building.state == "compiling":
            return DecodePath("compiling", self.building.progress())
        return DecodePath("eager")

    def _take_compiled(self) -> None:
        """Between steps: the packages built in the background, once they are, for the requests
        begun from now on."""
        if self.building is None:
            return
        steps = self.building.take()
        if steps is None and self.building.state == "compiling":
            return
        if steps is not None:
            from engine.compiled import CompiledDecode

            self.compiled = CompiledDecode(self.model)
            self.compiled.packaged = steps
            log.info("the compiled decode step takes over, %.1f s after the build began; requests begun before "
                     "it finish on the eager step", time.monotonic() - self.building.started)
        self.building = None

    def stop_building(self) -> None:
        """The worker is leaving: end a build still running."""
        if self.building is not None:
            self.building.stop()

    @property
    def config(self) -> ModelConfig:
        return self.model.cfg

    def assign(self, slot: int, blocks: Sequence[int], tokens: Sequence[int] | None = None) -> None:
        """The slot's block table from now on (the worker's pool, workers/blocks.py, chose them);
        with `tokens`, the ids whose entries those blocks hold already (a cached prefix), which
        `begin(keep=len(tokens))` then keeps."""
        self._check_slot(slot)
        blocks = list(blocks)
        if blocks != self._tables[slot]:
            self.model.assign(slot, blocks)
            self._tables[slot] = blocks
        if tokens is not None:
            if len(tokens) > len(blocks) * self.kv_block:
                raise ValueError(f"slot {slot}: {len(tokens)} cached tokens in {len(blocks)} blocks")
            self._positions[slot] = len(tokens)
            self._held[slot] = list(tokens)
            if not self.rewinds:  # entries another slot computed: no state goes with them
                self._state_at[slot] = -1
            if self._lookups is not None:
                self._lookups[slot].truncate(0)
                self._lookups[slot].extend(list(tokens))

    def room(self, slot: int) -> int:
        """How many positions the slot's blocks hold."""
        return len(self._tables[slot]) * self.kv_block

    def _check_room(self, slot: int, end: int) -> None:
        if end > self.room(slot):
            raise ValueError(f"slot {slot}: writing up to position {end} beyond its {len(self._tables[slot])} blocks "
                             f"({self.room(slot)} positions)")

    def begin(self, slot: int, params: SamplingParams, keep: int = 0) -> None:
        self._check_slot(slot)
        if params.prompt_logprobs is not None and keep:
            raise ValueError("prompt scoring reads the prompt from its first token (keep=0)")
        self.truncate(slot, keep)
        self._samplers[slot] = sampler = SlotSampler.start(params, self._constraint(params))
        self._take_compiled()
        self._eager[slot] = self.building is not None
        sampler.observe(self._held[slot])
        self._prompt_scores[slot], self._carry[slot], self._drawn_from[slot] = [], None, None

    def _constraint(self, params: SamplingParams) -> Constraint | None:
        """The row state of the request's grammar, compiled on the grammar thread (engine/grammar.py)."""
        if params.grammar is None:
            return None
        if self.grammars is None:
            if self.tokenizer is None:
                raise ValueError("a constrained request needs the model's tokenizer")
            tokenizer = self.tokenizer
            self.grammars = Grammars(tokenizer.json, self.config.vocab_size, sorted(self.eos_token_ids),
                                     tokenizer.decode)
        constraint = self.grammars.constraint(params.grammar, params.grammar_after)
        for token in params.grammar_done:
            constraint.accept(token)
        if constraint.error is not None:  # the answer so far does not fit its own grammar
            raise constraint.error
        return constraint

    def _allowed(self, slots: Sequence[int]) -> tuple[torch.Tensor | None, dict[int, RequestError]]:
        """[rows, V] bool on the device: each constrained row's allowed tokens, a free row's all
        True; None when no row is constrained now (Transformer.exact_top). And the slots whose
        grammar failed here (engine/grammar.py): their rows are all True, to be left out."""
        masks: list[torch.Tensor | None] = []
        failed: dict[int, RequestError] = {}
        for slot in slots:
            constraint = self._samplers[slot].constraint
            try:
                masks.append(constraint.allowed() if constraint is not None else None)
            except RequestError as error:
                masks.append(None)
                failed[slot] = error
        if all(m is None for m in masks):
            return None, failed
        vocab = self.config.vocab_size
        allowed = torch.ones(len(slots), vocab, dtype=torch.bool)
        for row, mask in enumerate(masks):
            if mask is not None:
                allowed[row, :mask.shape[0]] = mask[:vocab]
        return allowed.to(self.device), failed

    def _grammar_error(self, slot: int) -> RequestError | None:
        """The error the slot's grammar met at its last token (a dead end: engine/grammar.py)."""
        return getattr(self._samplers[slot].constraint, "error", None)

    def logprobs(self, slot: int) -> list[TokenLogprob]:
        """The TokenLogprob of each token read() and decode() returned for the slot since the last
        call (params.logprobs), in order."""
        return self._samplers[slot].take_logprobs()

    def prompt_logprobs(self, slot: int) -> list[TokenLogprob]:
        """The prompt's tokens after its first, scored as read so far (params.prompt_logprobs)."""
        taken, self._prompt_scores[slot] = self._prompt_scores[slot], []
        return taken

    def read(self, slot: int, tokens: Sequence[int], sample: bool) -> int | None:
        self._check_slot(slot)
        start = self._positions[slot]
        if len(tokens) == 0:
            raise ValueError("read() needs at least one token")
        end = start + len(tokens)
        if end > self.ctx:
            raise ValueError(f"slot {slot}: {start} cached + {len(tokens)} new tokens exceed ctx={self.ctx}")
        self._check_room(slot, end)
        self._check_state(slot, start)
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)
        index = CacheIndex.for_read(slot, start, end, self.device)
        sampler = self._samplers[slot]
        scoring = sampler.params.prompt_logprobs
        with torch.inference_mode():
            if scoring is None:
                allowed = None
                if sample:
                    allowed, failed = self._allowed([slot])
                    if failed:
                        raise failed[slot]
                hidden = self.model(ids, index)
                logits = _halves(self.model.logits(hidden, allowed, self._scored([slot])), 1) if sample else None
            else:
                logits = self._score_prompt(slot, list(tokens), self.model.forward_all(ids, index)[0], scoring)
                logits = logits if sample else None
        self._fed(slot, list(tokens))
        if sample and end >= TRIM_AFTER and self.device.type == "cpu":
            # a read that ends this deep left a heap of freed gathers and activations (~150 MB
            # on a 1.7B model after 2 000 tokens) that decoding never reuses: ~13 ms to hand back
            release_freed_memory()
        if logits is None:
            return None
        self._drawn_from[slot] = logits
        return self._sampled_one(slot, logits)

    def _sampled_one(self, slot: int, logits: Drawn) -> int:
        """logits ([1, V], [1, V] or None: `Drawn`) -> the slot's next token; its grammar's
        failure raised (this request's)."""
        token = sample_tokens(logits[0], [self._samplers[slot]], self.eos_token_ids, logits[1])[0]
        error = self._grammar_error(slot)
        if error is not None:
            raise error
        return token

    def fork(self, slot: int, into: Sequence[int]) -> list[int]:
        """The slot's read just ended with a sampled token: copy its cache into each slot of
        `into` (begun with their own params) and draw each one's first token from the same
        logits under its own sampler: n answers from one read."""
        logits = self._drawn_from[slot]
        if logits is None:
            raise ValueError(f"slot {slot}: fork() follows a read that sampled")
        for target in into:
            self._check_slot(target)
            if target == slot:
                raise ValueError("fork() into the slot itself")
            self._check_room(target, self._positions[slot])
        length = self._positions[slot]
        self.model.copy_slot(slot, list(into), length)
        tokens = []
        for target in into:
            self.truncate(target, 0)
            self._fed(target, list(self._held[slot][:length]))  # a recurrent state: the source's, copied
            tokens.append(self._sampled_one(target, logits))
        return tokens

    def _score_prompt(self, slot: int, tokens: list[int], h: torch.Tensor, top: int) -> Drawn:
        """h [T, dim]: this chunk's final-normed rows. Row i's logits score token i + 1; the
        previous chunk's last row scores this chunk's first token, and this chunk's last row waits
        for the next chunk (returned: it is also what the first answer token is drawn from). A read
        that gives way keeps these (the slot's state): its scores are those of one whole read.
        Logits are made SCORE_ROWS rows at a time (a [T, V] float32 block is 200 KB a row). Only
        the last row is also sampled from, by the head a read without scores uses on it."""
        carry = self._carry[slot]
        for lo in range(0, h.shape[0], SCORE_ROWS):
            logits = self.model.reported_logits(h[lo:lo + SCORE_ROWS])  # every row scores a token
            rows = logits[:-1] if carry is None else torch.cat([carry, logits[:-1]])
            first = lo + (1 if carry is None else 0)
            targets = tokens[first:lo + logits.shape[0]]
            if targets:
                self._prompt_scores[slot] += score_prompt(rows.cpu(), targets, top)
            carry = logits[-1:].clone()
        assert carry is not None
        self._carry[slot] = carry
        return self.model.logits(h[-1:]), carry

    def replay(self, slot: int, tokens: Sequence[int], sample: bool) -> int | None:
        """Append tokens this slot's request generated before (a resumed request's answer so far)
        the way they were produced: as decode rows of one token each (the step's kernels, compiled
        if decode is), up to the slots' count a step, so their KV and the next token are exactly
        the undisturbed run's. A chunk of them read as prompt tokens would go through the prompt
        kernels (bf16 copy, fused attention) and part from it at the next near-tie."""
        self._check_slot(slot)
        if len(tokens) == 0:
            raise ValueError("replay() needs at least one token")
        start = self._positions[slot]
        if start + len(tokens) > self.ctx:
            raise ValueError(f"slot {slot}: {start} cached + {len(tokens)} new tokens exceed ctx={self.ctx}")
        self._check_room(slot, start + len(tokens))
        self._check_state(slot, start)
        tokens = list(tokens)
        logits = None
        # a step's rows: at most the batched step's; one, where each row's state is its slot's
        # (a recurrent model: the rows of one step do not see each other)
        per_step = self.num_slots if self.rewinds else 1
        for lo in range(0, len(tokens), per_step):
            rows = tokens[lo:lo + per_step]
            position = self._positions[slot]
            allowed = None
            if sample and lo + per_step >= len(tokens):  # the last row's logits are sampled
                mask, failed = self._allowed([slot])
                if failed:
                    raise failed[slot]
                if mask is not None:
                    allowed = torch.ones(len(rows), mask.shape[1], dtype=torch.bool, device=mask.device)
                    allowed[-1] = mask[0]
            scored = self._scored([slot] * len(rows))
            logits = self._step([slot] * len(rows), rows, list(range(position, position + len(rows))), allowed, scored)
            self._fed(slot, rows)
        if not sample:
            return None
        assert logits is not None
        return self._sampled_one(slot, _rows(logits, slice(-1, None)))

    def decode(self, slots: Sequence[int], tokens: Sequence[int]) -> list[list[int]]:
        if len(slots) != len(tokens):
            raise ValueError("decode() needs one token per slot")
        if not slots:
            return []
        if len(set(slots)) != len(slots):
            raise ValueError("decode() got the same slot twice")
        for slot in slots:
            self._check_slot(slot)
            if self._positions[slot] >= self.ctx:
                raise ValueError(f"slot {slot} is full (ctx={self.ctx})")
            self._check_room(slot, self._positions[slot] + 1)
            self._check_state(slot, self._positions[slot])
        # penalties and constraints follow the tokens one by one: such a row decodes without guesses
        if self._lookups is not None and len(slots) == 1 and self._samplers[slots[0]].is_plain:
            return [self._decode_guessing(slots[0], tokens[0])]
        slots, tokens = list(slots), list(tokens)
        allowed, failed = self._allowed(slots)
        if failed:  # those rows' requests end: the step goes on without them
            kept = [row for row, slot in enumerate(slots) if slot not in failed]
            slots, tokens = [slots[row] for row in kept], [tokens[row] for row in kept]
            allowed = allowed[kept] if allowed is not None and kept else None
        out: dict[int, list[int]] = {}
        if slots:
            logits = self._step(slots, tokens, [self._positions[s] for s in slots], allowed, self._scored(slots))
            for slot, token in zip(slots, tokens):
                self._fed(slot, [token])
            sampled = sample_tokens(logits[0], [self._samplers[s] for s in slots], self.eos_token_ids, logits[1])
            for slot, token in zip(slots, sampled):
                error = self._grammar_error(slot)
                if error is not None:
                    failed[slot] = error
                else:
                    out[slot] = [token]
        if failed:
            raise RowsFailed(out, failed)
        return [out[slot] for slot in slots]

    def _decode_guessing(self, slot: int, token: int) -> list[int]:
        """One row, and one more at each next position for the tokens guessed after it, as many as
        fit: the step's rows are at most the slots (the batched package's largest batch), and a
        full slot ends its request, so the guesses never take its last position. Row i's token
        counts only while every guess before it was right: it then read what one step at a time
        would have."""
        assert self._lookups is not None
        position = self._positions[slot]
        room = min(self.num_slots - 1, self.ctx - position - 2, self.room(slot) - position - 1)
        guesses = self._lookups[slot].guess(token)[:max(room, 0)]  # never past the slot's blocks
        rows = [token, *guesses]
        logits = self._step([slot] * len(rows), rows, list(range(position, position + len(rows))),
                            scored=self._scored([slot] * len(rows)))
        sampler = self._samplers[slot]
        out: list[int] = []
        for row in range(len(rows)):
            if row and out[-1] != guesses[row - 1]:
                break
            sampling, reported = _rows(logits, slice(row, row + 1))
            out += sample_tokens(sampling, [sampler], self.eos_token_ids, reported)
        self._fed(slot, rows[:len(out)])
        return out

    def _scored(self, slots: Sequence[int]) -> torch.Tensor | None:
        """[rows] bool on the device: the rows whose request asks for logprobs, every logit of
        theirs exact (Transformer.exact_top); None when no row does."""
        scored = [self._samplers[slot].params.logprobs is not None for slot in slots]
        return torch.tensor(scored, device=self.device) if any(scored) else None

    def _step(self, slots: list[int], tokens: list[int], positions: list[int],
              allowed: torch.Tensor | None = None, scored: torch.Tensor | None = None) -> Drawn:
        """Rows of one token each at these positions of their slots -> logits [rows, V] and, when a
        row is scored, what they report (`Drawn`; allowed: constrained rows' tokens, for the head's
        exact top, `_allowed`; scored: `_scored`)."""
        span = min(self.ctx, -(-(max(positions) + 1) // KV_BUCKET) * KV_BUCKET)
        compiled = [self.compiled is not None and not self._eager[slot] for slot in slots]
        if all(path == compiled[0] for path in compiled):
            return _halves(self._step_on(compiled[0], slots, tokens, positions, span, allowed, scored), len(slots))
        # requests begun before the switch beside newer ones: each part on its own path (a row's
        # logits do not depend on what shares its step)
        parts = []
        for path in (False, True):
            rows = [i for i, c in enumerate(compiled) if c == path]
            part = self._step_on(path, [slots[i] for i in rows], [tokens[i] for i in rows],
                                 [positions[i] for i in rows], span,
                                 None if allowed is None else allowed[rows],
                                 None if scored is None else scored[rows])
            parts.append((rows, _halves(part, len(rows))))
        with torch.inference_mode():
            first = parts[0][1][0]
            logits = first.new_empty(len(slots), first.shape[1])
            reported = logits.clone() if any(r is not None for _, (_, r) in parts) else None
            for rows, (sampling, told) in parts:
                logits[rows] = sampling
                if reported is not None:
                    reported[rows] = sampling if told is None else told
        return logits, reported

    def _step_on(self, compiled: bool, slots: list[int], tokens: list[int], positions: list[int],
                 span: int, allowed: torch.Tensor | None = None, scored: torch.Tensor | None = None) -> torch.Tensor:
        dev = self.device
        with torch.inference_mode():
            pos = torch.tensor(positions, dtype=torch.long, device=dev)
            ids = torch.tensor(tokens, dtype=torch.long, device=dev)
            if compiled:
                assert self.compiled is not None
                return self.compiled(ids, torch.tensor(slots, dtype=torch.long, device=dev), pos, span, allowed, scored)
            index = CacheIndex.for_slots(slots, pos.unsqueeze(1), span, ends=[p + 1 for p in positions])
            return self.model.exact_top(*self.model.decode(ids.unsqueeze(1), index), allowed, scored)

    def _fed(self, slot: int, tokens: list[int]) -> None:
        self._positions[slot] += len(tokens)
        self._state_at[slot] = self._positions[slot]
        self._held[slot] += tokens
        self._samplers[slot].observe(tokens)
        if self._lookups is not None:
            self._lookups[slot].extend(tokens)

    def position(self, slot: int) -> int:
        self._check_slot(slot)
        return self._positions[slot]

    def truncate(self, slot: int, length: int) -> None:
        # Cached entries past `length` stay in memory but every mask hides them until overwritten.
        self._check_slot(slot)
        if not 0 <= length <= self._positions[slot]:
            raise ValueError(f"slot {slot}: cannot truncate {self._positions[slot]} tokens to {length}")
        if not self.rewinds and length and self._state_at[slot] < 0:
            raise ValueError(f"slot {slot}: a cached prefix another slot computed carries no recurrent state")
        if not self.rewinds and length not in (0, self._state_at[slot]):
            raise ValueError(f"slot {slot}: a recurrent state cannot go back from {self._state_at[slot]} to {length} "
                             "tokens (keep all of them or none)")
        self._positions[slot] = length
        if length == 0:
            self._state_at[slot] = 0
        del self._held[slot][length:]
        if self._lookups is not None:
            self._lookups[slot].truncate(length)

    def _check_state(self, slot: int, start: int) -> None:
        """A recurrent model's slot continues from where its state is (a cached prefix it did not
        compute itself, `assign(tokens=...)`, is not one); position 0 starts from zeros."""
        if start and not self.rewinds and start != self._state_at[slot]:
            raise ValueError(f"slot {slot}: its recurrent state is at {self._state_at[slot]} tokens, not at {start} "
                             "(a recurrent model reuses no cached prefix)")

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} out of range (num_slots={self.num_slots})")
