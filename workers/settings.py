"""A worker process's configuration: every option is a CLI flag and a STRATA_ variable."""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import NoDecode

from queues.settings import CONFIG, ModelSettings, RedisSettings
from workers.scheduler import Policy, Reserve


class WorkerSettings(RedisSettings, ModelSettings):
    """The shared options (queues/settings.py), then the worker's own."""

    model_config = CONFIG

    engine: Literal["torch", "fake"] = Field(
        "torch", description="torch: the model's weights; fake: no weights, deterministic tokens (' t7' per token) "
                             "that take --fake-read-ms-per-token and --fake-decode-ms-per-step of real time (load tests)")
    fake_read_ms_per_token: float = Field(0.05, ge=0, description="--engine fake: wall time per prompt token read")
    fake_decode_ms_per_step: float = Field(10.0, ge=0, description="--engine fake: wall time per decode step (all slots)")
    device: str = Field("cpu", description="cpu or cuda:N")
    dtype: str | None = Field(None, description="float32 or bfloat16; default bfloat16 on CUDA and for a quantized GGUF on the CPU, "
                                                "else float32; float32 is the exact path (see docs/engine.md)")
    parallel: int = Field(4, ge=1, description="slots: requests decoded together")
    kv_tokens: int | None = Field(None, ge=16, description="the worker's KV pool in tokens, shared by every slot in blocks "
                                                           "(a prompt block, 64 on the torch engine); default --parallel x "
                                                           "--ctx. A request may take up to --max-model-len of it")
    kv_dtype: Literal["auto", "float32", "float16", "bfloat16", "int8", "fp8"] = Field(
        "auto", description="what the KV pool stores: auto (on the CPU float16 under bf16 activations, float32 on the "
                            "float32 path; the activations' dtype on CUDA), float32, float16, bfloat16, int8 (a scale "
                            "per token and head: 0.27x float32's bytes), fp8 (CUDA only); attention computes in float32 "
                            "whatever it is (docs/kv_pool.md)")
    prefill_chunk: int = Field(256, ge=1, description="tokens read per chunk, rounded up to a multiple of the engine's "
                                                   "prompt block (64 on the torch engine); a chunk boundary is where a read can stop")
    prefill_preempt: bool = Field(True, description="a read may give way at a chunk boundary (rule 4)")
    yields_max: int = Field(2, ge=0, description="most times one read gives way")
    batch_groups: int = Field(1, ge=1, description="slot groups; a newcomer goes to the least busy group")
    slot_low_first: bool = Field(True, description="within a group, the lowest free slot first; off: least recently used")
    reserve: Annotated[list[str], NoDecode] = Field(
        [], description="N:P keeps N slots for requests of priority >= P; repeat for tiers (--reserve 1:10 --reserve 1:5)")
    aging_s: float | None = Field(
        None, gt=0, description="a waiting request's priority rises by 1 every this many seconds (off: none); "
                                "published in Redis for every enqueue of the model")
    affinity_wait_s: float = Field(
        0.5, ge=0, description="prefix affinity: a worker with a free slot leaves a newcomer for up to this long to an "
                               "idle worker that advertises its prompt's prefix (the first 256 tokens' hash) as cached; "
                               "never the order requests are served in, only the worker (0: off)")
    threads: int | None = Field(None, description="torch CPU threads; default all cores")
    int4: bool = Field(True, description="CPU + bfloat16: linears stored as Q4_0/Q4_1 run from the file's own blocks "
                                         "(engine/quants' repacked dots with 16-bit activations where the CPU has AVX2, "
                                         "else torch's int4 kernel); off: dequantized to bfloat16 (more memory)")
    prefill_bf16: bool = Field(True, description="with --int4, where oneDNN prepacks bfloat16 and no bfloat16 tile reads "
                                                 "prompts from the blocks (that tile: --prompt-int8 on AVX-512 BF16 without "
                                                 "AMX, AMD Zen 4/5): each Q4_0/Q4_1 matrix also keeps a bfloat16 prepacked "
                                                 "copy that every prompt token goes through (faster prompt reading, +2 bytes "
                                                 "a weight); off: the file's blocks only (prompts in integers with 16-bit "
                                                 "activations with --prompt-int8, else bfloat16 slabs)")
    prompt_int8: bool = Field(True, description="x86 CPU with AVX2 and no AMX (AMD Zen 2-5, Intel from Haswell on "
                                                "without AMX): prompt tokens of a quantized file's Q4_0 / K-quant / Q5 / "
                                                "Q8_0 / IQ matrices multiplied in int8, the activations quantized per 32 as "
                                                "for generated tokens (llama.cpp's arithmetic): a 1.7B Q4_K_M's prompt "
                                                "reading ~1.2x faster with AVX-512 VNNI, ~1.4x on AVX2 alone; "
                                                "Q4_1's with AVX-512 VNNI in 16-bit integers, or with AVX-512 BF16 by a "
                                                "bfloat16 tile from their blocks (no prompt copy then), on AVX2 alone in "
                                                "float32; off: bfloat16 slabs (float32 on AVX2 alone), closer to float32 "
                                                "(docs/engine.md)")
    repack: bool = Field(True, description="CPU with AVX2: a quantized file's Q4_0 .. Q8_0 and K-quant matrices repacked at load, eight "
                                           "rows at a time (exact; Q4_K 148 bytes a row's 256 weights against 144), so the "
                                           "decode step multiplies eight rows per register (1.2-1.4x its decode on a Q4_K_M "
                                           "file); off: the file's own pages, shared with other workers on the same file "
                                           "(docs/engine.md)")
    compile: bool = Field(True, description="compiled decode: on the CPU every layer ahead of time in one C++ call (~1 min "
                                            "to build on a fresh machine, loaded in a second from --data-dir after, whatever "
                                            "--parallel and --ctx); --no-compile: eager (docs/engine.md)")
    compile_background: bool = Field(True, description="with --compile on the CPU: serve at once with the eager step while a "
                                                       "low-priority process builds the compiled one, which takes over for "
                                                       "the requests begun after it is ready (progress in the log and "
                                                       "/health); off: build it before serving")
    prompt_lookup: bool = Field(True, description="CPU, 2+ slots: a one-row decode step also checks guesses of the next tokens from "
                                                  "the request's own text, several tokens a step when right, the same tokens "
                                                  "(docs/engine.md); off: one token a step")
    lease_ms: int = Field(15_000, ge=100, description="a claim not renewed for this long goes back to the queue")
    max_attempts: int = Field(3, ge=1, description="a request whose workers died this many times while running it fails (worker_lost)")
    heartbeat_s: float = Field(1.0, gt=0, description="how often the worker hash is refreshed")
    idle_wait_s: float = Field(0.5, gt=0, description="longest block on an empty queue")
    worker_id: str | None = Field(None, description="default host-pid-device")

    @field_validator("reserve", mode="before")
    @classmethod
    def _one_per_tier(cls, value: object) -> object:
        """`1:10,1:5` in one flag or variable reads as two tiers, like two flags; a JSON list too."""
        if isinstance(value, str) and value.strip().startswith("["):
            return json.loads(value)
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("reserve")
    @classmethod
    def _tiers_parse(cls, value: list[str]) -> list[str]:
        parse_reserve(value)
        return value

    @model_validator(mode="after")
    def _tiers_fit(self) -> "WorkerSettings":
        reserved = sum(r.count for r in parse_reserve(self.reserve))
        if reserved > self.parallel:
            raise ValueError(f"--reserve keeps {reserved} slots but the worker has {self.parallel} (--parallel)")
        return self

    def reserve_tiers(self) -> tuple[Reserve, ...]:
        return parse_reserve(self.reserve)

    def pool_tokens(self) -> int:
        return self.kv_tokens if self.kv_tokens is not None else self.parallel * self.ctx

    def policy(self) -> Policy:
        """The scheduling flags, as workers/scheduler.py takes them."""
        return Policy(prefill_preempt=self.prefill_preempt, yields_max=self.yields_max,
                      batch_groups=self.batch_groups, slot_low_first=self.slot_low_first,
                      reserve=self.reserve_tiers(), aging_s=self.aging_s, affinity_wait_s=self.affinity_wait_s)


def parse_reserve(tiers: list[str]) -> tuple[Reserve, ...]:
    out = []
    for tier in tiers:
        count, sep, priority = tier.partition(":")
        try:
            if not sep:
                raise ValueError
            out.append(Reserve(int(count), int(priority)))
        except ValueError:
            raise ValueError(f"--reserve {tier!r}: expected N:P, e.g. 1:10 (N slots for priority >= P)") from None
        if out[-1].count < 1:
            raise ValueError(f"--reserve {tier!r}: N must be at least 1")
    if len({r.min_priority for r in out}) < len(out):
        raise ValueError("--reserve: one tier per priority (merge them: 2:10, not 1:10 and 1:10)")
    return tuple(out)
