"""`strata batch submit|status|cancel` (a client of the HTTP API: httpx, rich progress) and
`strata batch-worker` (the RQ worker that runs batches, batches/worker.py)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import httpx
from pydantic import Field
from pydantic_settings import BaseSettings, CliApp, CliPositionalArg, CliSubCommand, SettingsConfigDict

from batches.settings import BatchWorkerSettings
from queues.batches import BatchStatus


class BatchWorkerCommand(BatchWorkerSettings):
    """An RQ worker running batch jobs (also re-enqueues batches whose job died)."""

    def cli_cmd(self) -> None:
        from batches.worker import run_batch_worker

        run_batch_worker(self)


class _Client(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="STRATA_", extra="ignore")

    api_url: str = Field("http://127.0.0.1:8000", description="the Strata API (its /v1 routes)")
    timeout_s: float = Field(60.0, gt=0, description="HTTP timeout per call")

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.api_url.rstrip("/"), timeout=self.timeout_s)


def _check(response: httpx.Response) -> dict:
    if response.status_code >= 400:
        try:
            error = response.json()["error"]
            message = f"{error.get('code') or error.get('type')}: {error['message']}"
        except (ValueError, KeyError, TypeError):
            message = response.text
        print(f"error {response.status_code}: {message}", file=sys.stderr)
        raise SystemExit(1)
    return response.json()


def _summary(batch: dict) -> str:
    c = batch["request_counts"]
    return (f"{batch['id']}  {batch['status']}  priority {batch['priority']}  "
            f"{c['completed']} completed, {c['failed']} failed of {c['total']}  "
            f"output {batch.get('output_file_id') or '-'}  errors {batch.get('error_file_id') or '-'}")


class BatchSubmit(_Client):
    """Upload FILE (JSONL), create a batch, show its progress until it ends, write the output."""

    file: CliPositionalArg[Path]
    endpoint: str = Field("/v1/chat/completions", description="/v1/chat/completions or /v1/completions")
    priority: int | None = Field(None, description="the lines' priority; default the server's (e.g. -10)")
    output: Path | None = Field(None, description="where to write the output file; default FILE.output.jsonl")
    poll_s: float = Field(1.0, gt=0, description="how often progress is read")

    def cli_cmd(self) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        with self.http() as http, self.file.open("rb") as f:
            uploaded = _check(http.post("/v1/files", files={"file": (self.file.name, f)}, data={"purpose": "batch"}))
            body: dict = {"input_file_id": uploaded["id"], "endpoint": self.endpoint, "completion_window": "24h"}
            if self.priority is not None:
                body["priority"] = self.priority
            batch = _check(http.post("/v1/batches", json=body))
            columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
            with Progress(*columns) as progress:
                task = progress.add_task(batch["id"], total=batch["request_counts"]["total"])
                try:
                    while not BatchStatus(batch["status"]).is_final:
                        time.sleep(self.poll_s)
                        batch = _check(http.get(f"/v1/batches/{batch['id']}"))
                        c = batch["request_counts"]
                        progress.update(task, completed=c["completed"] + c["failed"],
                                        description=f"{batch['id']} {batch['status']}")
                except KeyboardInterrupt:
                    print(f"\nstill running; `strata batch cancel {batch['id']}` stops it", file=sys.stderr)
                    raise SystemExit(130) from None
            print(_summary(batch))
            output = self.output or self.file.with_suffix(".output.jsonl")
            if batch.get("output_file_id"):
                output.write_bytes(http.get(f"/v1/files/{batch['output_file_id']}/content").content)
                print(f"output: {output}")
            if batch.get("error_file_id"):
                errors = output.with_name(output.name.replace(".output", "") .removesuffix(".jsonl") + ".errors.jsonl")
                errors.write_bytes(http.get(f"/v1/files/{batch['error_file_id']}/content").content)
                print(f"errors: {errors}")
        if batch["status"] != BatchStatus.COMPLETED:
            raise SystemExit(1)


class BatchShow(_Client):
    """Show a batch: status, counts, file ids."""

    batch_id: CliPositionalArg[str]

    def cli_cmd(self) -> None:
        with self.http() as http:
            print(_summary(_check(http.get(f"/v1/batches/{self.batch_id}"))))


class BatchCancel(_Client):
    """Cancel a batch: no new lines are fed; it ends `cancelled`."""

    batch_id: CliPositionalArg[str]

    def cli_cmd(self) -> None:
        with self.http() as http:
            print(_summary(_check(http.post(f"/v1/batches/{self.batch_id}/cancel"))))


class BatchCommand(BaseSettings):
    """Batch API client: submit a JSONL file, see a batch, cancel one."""

    submit: CliSubCommand[BatchSubmit]
    status: CliSubCommand[BatchShow]
    cancel: CliSubCommand[BatchCancel]

    def cli_cmd(self) -> None:
        CliApp.run_subcommand(self)
