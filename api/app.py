"""The FastAPI application: create_app(settings) builds it, run(settings) serves it."""

from __future__ import annotations

import gc
import logging
import os
import socket
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio
import redis.asyncio as aioredis
from fastapi import Depends, FastAPI

from api.api_keys import load_keys
from api.batch_deps import BatchServices
from api.cancels import Cancels
from api.deps import Services, get_api_key
from api.errors import install_error_handlers
from api.fit import Fit
from api.middleware import BodyLimit, CatchAll
from api.routes import batches, chat, completions, files, health, metrics, models, requests, tokens
from api.settings import ApiSettings
from api.shared_reader import SharedReader
from queues.connect import connect_async, wait_until_up
from queues.intake import Intake, now_ms
from shapes.rules import Rules, TokenizerLike

log = logging.getLogger("strata.api")


def create_app(
    settings: ApiSettings,
    *,
    tokenizer: TokenizerLike | None = None,
    redis_client: aioredis.Redis | None = None,
    clock: Callable[[], int] | None = None,
    freeze_heap: bool = False,
) -> FastAPI:
    """The API. `tokenizer` and `redis_client` are built from `settings` at startup when not
    given (tests pass a small fake tokenizer; Redis is always a real server). `clock` (ms) is
    the queue's time, wall time unless a test passes the fake engine's virtual clock. The keys
    file is read here, so a broken one stops startup with its error. `freeze_heap` (the API
    process, `run`): what startup built is put out of the garbage collector's reach for good
    (`gc.freeze`), so a full collection never walks it while streams wait (as in the worker,
    workers/main.py); not for apps a test process makes by the dozen, whose garbage would stay."""
    keys = load_keys(settings.keys_file) if settings.keys_file else None

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[dict]:
        client = redis_client or connect_async(settings.redis_url, cluster=settings.redis_cluster)
        await wait_until_up(client, settings.redis_connect_s)
        tok, name, defaults, cap = await anyio.to_thread.run_sync(load_model_facts, settings, tokenizer)
        intake = Intake(
            client, name,
            max_waiting=settings.max_waiting,
            hard_limit=settings.queue_hard_limit,
            retention_s=settings.retention_s,
            clock=clock or now_ms,
        )
        log.info("serving %s; queue at %s", name, settings.redis_url)
        batch_services = BatchServices.connect(settings)
        cancels = Cancels(intake)
        try:
            async with anyio.create_task_group() as background:
                background.start_soon(cancels.deliver)
                reader = SharedReader(intake, settings.read_block_ms)
                background.start_soon(reader.run)
                # Starlette hands this dict to every request as request.state: the one place the
                # built objects live (see api.deps).
                rules = Rules(name, tok, cap, settings.default_max_tokens, defaults=defaults)
                fit = Fit(client, name, cap, int(settings.worker_live_s * 1000), intake.clock)
                if freeze_heap:
                    gc.collect()
                    gc.freeze()
                yield {"services": Services(settings, client, intake, rules, int(time.time()), cancels, fit, reader,
                                            keys=keys, started_ms=intake.clock(),
                                            replica=f"{socket.gethostname()}-{os.getpid()}"),
                       "batch_services": batch_services}
                background.cancel_scope.cancel()
        finally:
            batch_services.close()
            if redis_client is None:
                await client.aclose()

    app = FastAPI(title="Strata", version="0.1.0", lifespan=lifespan)
    install_error_handlers(app)
    app.add_middleware(CatchAll)  # added first: the inner of the two
    upload_bytes = settings.batch_max_file_bytes + 1024 * 1024  # the file and its multipart framing
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes, larger={"/v1/files": upload_bytes})
    for module in (chat, completions, requests, models, files, batches, tokens):  # 401 without a valid key when keys are configured
        app.include_router(module.router, dependencies=[Depends(get_api_key)])
    for module in (health, metrics):  # open: load balancers and Prometheus
        app.include_router(module.router)
    return app


def load_model_facts(settings: ApiSettings, tokenizer: TokenizerLike | None,
                     ) -> tuple[TokenizerLike, str, dict[str, float], int]:
    """The tokenizer, the served model name, its sampling defaults (generation_config.json) and
    the most tokens a request may hold (--max-model-len, else the model's own context), from the
    model files where not given (with the tokenizer given: --max-model-len, else --ctx)."""
    if tokenizer is not None and settings.served_model_name:
        return tokenizer, settings.served_model_name, {}, settings.max_model_len or settings.ctx
    from engine.files import cache_folder, model_context, resolve_model_path, served_model_name
    from engine.generation_config import sampling_defaults

    path = resolve_model_path(settings.model)
    if tokenizer is None:
        from engine.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_model_path(path, cache_dir=cache_folder(settings.data_dir))
    cap = settings.max_model_len or model_context(path, cache_folder(settings.data_dir)) or settings.ctx
    return tokenizer, settings.served_model_name or served_model_name(path), sampling_defaults(path), cap


def run(settings: ApiSettings, listening: socket.socket | None = None) -> None:
    """Serve the API with uvicorn until interrupted (the CLI calls this): on the listening socket
    a supervisor handed over (--fd), which several replicas then share, or on `listening`, bound
    by the caller (a port in use is then the caller's one line, not uvicorn's traceback)."""
    import uvicorn

    if settings.fd is not None:
        listening = socket.socket(fileno=settings.fd)  # family and type read from the socket itself
    if listening is None:
        uvicorn.run(create_app(settings, freeze_heap=True), host=settings.host, port=settings.port, log_level="info",
                    access_log=settings.access_log)
        return
    server = uvicorn.Server(uvicorn.Config(create_app(settings, freeze_heap=True), log_level="info",
                                           access_log=settings.access_log))
    server.run(sockets=[listening])
