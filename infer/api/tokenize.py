"""Tokenizer routes in vLLM's shape (``/tokenizer_info``, ``/tokenize``, ``/detokenize``).

lm-evaluation-harness's ``local-completions`` model probes them and, when present, uses the
server's tokenizer to compute context lengths for log-likelihoods and sends token ids, so
RWKV models can be evaluated without a Hugging Face tokenizer. The end-of-document token 0
is spelled ``<|endoftext|>`` here (both directions) and serves as BOS and EOS: RWKV
evaluations start a context-free document with token 0.
"""
from __future__ import annotations

from fastapi import APIRouter, Depends
from pydantic import BaseModel, Field

from infer.api.context import ServerContext, get_ctx
from infer.api.logprobs import EOD_TEXT
from infer.api.schemas import OpenAIError, RequestBody, TokenId

router = APIRouter(tags=["tokenizer"])
ERRORS = {status: {"model": OpenAIError} for status in (401, 413, 422)}


class TokenizeRequest(RequestBody):
    prompt: str
    add_special_tokens: bool = Field(False, description="accepted; RWKV adds no special tokens")
    model: str | None = Field(None, max_length=256)


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int = Field(description="the server's prompt limit (--max-prompt-tokens)")


class DetokenizeRequest(RequestBody):
    tokens: list[TokenId]
    model: str | None = Field(None, max_length=256)


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfo(BaseModel):
    tokenizer_class: str = "RWKV World (rwkv_vocab_v20230424, greedy longest match)"
    eos_token: str = EOD_TEXT
    bos_token: str = EOD_TEXT
    pad_token: str | None = None
    vocab_size: int
    max_model_len: int


@router.get("/tokenizer_info", response_model=TokenizerInfo, responses=ERRORS, summary="Tokenizer description")
async def tokenizer_info(ctx: ServerContext = Depends(get_ctx)) -> TokenizerInfo:
    return TokenizerInfo(vocab_size=ctx.tokenizer.vocab_size, max_model_len=ctx.limits.max_prompt_tokens)


@router.post("/tokenize", response_model=TokenizeResponse, responses=ERRORS, summary="Text to token ids")
async def tokenize(body: TokenizeRequest, ctx: ServerContext = Depends(get_ctx)) -> TokenizeResponse:
    pieces = await ctx.tokenize(body.prompt.split(EOD_TEXT))
    tokens = [t for n, piece in enumerate(pieces) for t in ([0] if n else []) + piece]
    return TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=ctx.limits.max_prompt_tokens)


@router.post("/detokenize", response_model=DetokenizeResponse, responses=ERRORS, summary="Token ids to text")
async def detokenize(body: DetokenizeRequest, ctx: ServerContext = Depends(get_ctx)) -> DetokenizeResponse:
    runs: list[list[int]] = [[]]
    for token in body.tokens:
        if token == 0:
            runs.append([])
        else:
            runs[-1].append(token)
    return DetokenizeResponse(prompt=EOD_TEXT.join(ctx.tokenizer.decode(run) for run in runs))
