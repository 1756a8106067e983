"""POST /tokenize and /detokenize, GET /tokenizer_info: the served model's tokenizer and chat template, as the
generation endpoints use them (shapes.rules), so the counts are the ones a request is held to."""

from __future__ import annotations

from fastapi import APIRouter

from api.deps import ServicesDep
from shapes.errors import ApiError
from shapes.requests import ChatCompletionRequest
from shapes.tokens import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse, TokenizerInfo

router = APIRouter(tags=["tokens"])


def _check_model(services: ServicesDep, model: str | None) -> None:
    if model and model != services.model_name:
        raise ApiError(404, f"The model '{model}' does not exist; this server serves '{services.model_name}'.",
                       code="model_not_found", param="model")


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, services: ServicesDep) -> TokenizeResponse:
    _check_model(services, body.model)
    rules = services.rules
    if body.messages is not None:
        ids = rules.prompt(ChatCompletionRequest(messages=body.messages))
    elif body.add_special_tokens:
        ids = rules.tokenizer.encode(body.prompt or "")
    else:
        ids = rules.tokenizer.encode(body.prompt or "", add_special_tokens=False)
    return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=rules.ctx)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, services: ServicesDep) -> DetokenizeResponse:
    _check_model(services, body.model)
    ids = services.rules.token_ids(body.tokens, "tokens")
    return DetokenizeResponse(prompt=services.rules.tokenizer.decode(ids))





@router.get("/tokenizer_info")
async def tokenizer_info(services: ServicesDep) -> TokenizerInfo:
    tokenizer = services.rules.tokenizer
    names = getattr(tokenizer, "special_tokens", lambda: {})()
    return TokenizerInfo(eos_token=names.get("eos_token"), bos_token=names.get("bos_token"),
                         pad_token=names.get("pad_token"), chat_template=getattr(tokenizer, "chat_template", None),
                         model_max_length=services.rules.ctx)
