"""Bodies of /v1/files and /v1/batches, in OpenAI's shapes."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from shapes.text import require_unicode


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: str = "processed"
    status_details: str | None = None
    expires_at: int | None = None


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    has_more: bool = False


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class BatchCreate(BaseModel):
    model_config = ConfigDict(extra="ignore")

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = Field(None, max_length=16)
    priority: Any = None  # absent/null: the settings' batch_priority; else rule 1 (api.priority)

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, body: Any) -> Any:
        return require_unicode(body)


class RequestCounts(BaseModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchErrorItem(BaseModel):
    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchErrorItem]


class Batch(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: str
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts
    metadata: dict[str, str] | None = None
    priority: int  # Strata's: the priority every line of the batch runs at
    model: str | None = None

    @classmethod
    def from_record(cls, h: dict[str, str]) -> "Batch":
        """From the batch hash in Redis (queues.batches)."""
        def num(name: str) -> int | None:
            return int(h[name]) if h.get(name) else None

        return cls(
            id=h["id"], endpoint=h["endpoint"], input_file_id=h["input_file_id"],
            completion_window=h["completion_window"], status=h["status"],
            errors=BatchErrors.model_validate_json(h["errors"]) if h.get("errors") else None,
            output_file_id=h.get("output_file_id") or None, error_file_id=h.get("error_file_id") or None,
            created_at=int(h["created_at"]), in_progress_at=num("in_progress_at"), expires_at=num("expires_at"),
            finalizing_at=num("finalizing_at"), completed_at=num("completed_at"), failed_at=num("failed_at"),
            expired_at=num("expired_at"), cancelling_at=num("cancelling_at"), cancelled_at=num("cancelled_at"),
            request_counts=RequestCounts(total=int(h.get("total", 0)), completed=int(h.get("completed", 0)),
                                         failed=int(h.get("failed", 0))),
            metadata=json.loads(h["metadata"]) if h.get("metadata") else None,
            priority=int(h["priority"]), model=h.get("model") or None,
        )


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Batch]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False
