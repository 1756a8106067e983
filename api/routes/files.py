"""/v1/files: upload a batch input file, read a file (inputs, outputs, errors), delete it."""

from __future__ import annotations

import time

import anyio
from fastapi import APIRouter, File, Form, UploadFile
from fastapi.responses import Response

from api.batch_deps import BatchServicesDep
from api.deps import SettingsDep
from queues.files import StoredFile
from shapes.batches import FileDeleted, FileList, FileObject
from shapes.errors import ApiError

router = APIRouter(tags=["files"])

UPLOAD_PURPOSES = ("batch",)


def file_object(stored: StoredFile) -> FileObject:
    return FileObject(id=stored.id, bytes=stored.bytes, created_at=stored.created_at,
                      filename=stored.filename, purpose=stored.purpose)


def not_found(file_id: str) -> ApiError:
    return ApiError(404, f"No such File object: {file_id}", code="not_found", param="id")


@router.post("/v1/files")
async def upload_file(
    settings: SettingsDep, batch: BatchServicesDep, file: UploadFile = File(...), purpose: str = Form(...)
) -> FileObject:
    if purpose not in UPLOAD_PURPOSES:
        raise ApiError(400, f"purpose must be one of {list(UPLOAD_PURPOSES)}.", code="invalid_value", param="purpose")
    content = await file.read(settings.batch_max_file_bytes + 1)
    if len(content) > settings.batch_max_file_bytes:
        raise ApiError(413, f"The file is larger than {settings.batch_max_file_bytes} bytes.",
                       code="file_too_large", param="file")
    stored = await anyio.to_thread.run_sync(
        lambda: batch.files.put(content, filename=file.filename or "upload.jsonl", purpose=purpose,
                                now_s=int(time.time()))
    )
    return file_object(stored)


@router.get("/v1/files")
async def list_files(batch: BatchServicesDep, purpose: str | None = None, limit: int = 100) -> FileList:
    found = await anyio.to_thread.run_sync(lambda: batch.files.list(max(1, min(limit, 10_000)), purpose))
    return FileList(data=[file_object(f) for f in found])


@router.get("/v1/files/{file_id}")
async def get_file(file_id: str, batch: BatchServicesDep) -> FileObject:
    stored = await anyio.to_thread.run_sync(batch.files.get, file_id)
    if stored is None:
        raise not_found(file_id)
    return file_object(stored)


@router.get("/v1/files/{file_id}/content")
async def file_content(file_id: str, batch: BatchServicesDep) -> Response:
    content = await anyio.to_thread.run_sync(batch.files.content, file_id)
    if content is None:
        raise not_found(file_id)
    return Response(content, media_type="application/jsonl")


@router.delete("/v1/files/{file_id}")
async def delete_file(file_id: str, batch: BatchServicesDep) -> FileDeleted:
    if not await anyio.to_thread.run_sync(batch.files.delete, file_id):
        raise not_found(file_id)
    return FileDeleted(id=file_id)
