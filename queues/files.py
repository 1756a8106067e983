"""Files of the Batch API (uploaded batch inputs, batch outputs and errors), stored in Redis:
every API replica and batch worker sees them through the one broker they already share. The
size limit (api settings `batch_max_file_bytes`) keeps Redis memory in check; see docs/batches.md."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import redis

from queues.keys import file_content_key, file_key, files_key
from queues.records import decoded, text


@dataclass(frozen=True)
class StoredFile:
    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str  # "batch" (an upload), "batch_output" (written by a batch job)


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex}"


class FileStore:
    """Put, get, read and delete files. `client` is a sync Redis client (any decode_responses)."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client

    def put(self, content: bytes, *, filename: str, purpose: str, now_s: int, file_id: str | None = None) -> StoredFile:
        """Store a file; with a given id, replace what it held (a batch job rebuilding its output)."""
        stored = StoredFile(file_id or new_file_id(), len(content), now_s, filename, purpose)
        pipe = self.client.pipeline(transaction=False)
        pipe.set(file_content_key(stored.id), content)
        pipe.hset(file_key(stored.id), mapping={
            "id": stored.id, "bytes": stored.bytes, "created_at": now_s,
            "filename": filename, "purpose": purpose,
        })
        pipe.zadd(files_key(), {stored.id: now_s})
        pipe.execute()
        return stored

    def get(self, file_id: str) -> StoredFile | None:
        h = decoded(self.client.hgetall(file_key(file_id)))
        if not h:
            return None
        return StoredFile(h["id"], int(h["bytes"]), int(h["created_at"]), h["filename"], h["purpose"])

    def content(self, file_id: str) -> bytes | None:
        data = self.client.get(file_content_key(file_id))
        if data is None:
            return None
        return data if isinstance(data, bytes) else data.encode()

    def delete(self, file_id: str) -> bool:
        pipe = self.client.pipeline(transaction=False)
        pipe.delete(file_key(file_id), file_content_key(file_id))
        pipe.zrem(files_key(), file_id)
        deleted, _ = pipe.execute()
        return bool(deleted)

    def list(self, limit: int = 100, purpose: str | None = None) -> list[StoredFile]:
        """Newest first."""
        found = []
        for file_id in self.client.zrevrange(files_key(), 0, -1):
            stored = self.get(text(file_id))
            if stored and (purpose is None or stored.purpose == purpose):
                found.append(stored)
                if len(found) >= limit:
                    break
        return found
