"""Request and response bodies of every route; they are also the schemas shown at ``/docs``.

Requests ignore unknown fields (clients send vendor extras), reject NaN/Infinity and text that
is not valid Unicode (an unpaired UTF-16 surrogate cannot be tokenized or echoed back).
Defaults that depend on server options (``max_tokens``) are ``None`` here and resolved by
the route, so a request without ``max_tokens`` works whatever ``--max-tokens`` is.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from infer.sessions import MAX_ID_CHARS

MAX_TOKEN_ID = 65529          # World vocabulary ids are 0..65529 (0 = end of document)
MAX_SEED = 2**64 - 1
MAX_STOPS = 16
MAX_STOP_CHARS = 1024
MAX_LOGIT_BIAS = 300
MAX_N = 128                   # choices per prompt; rows per request are limited separately
MAX_PAGE = 1000               # sessions per /state/status page
MAX_INPUT_MESSAGES = 1024     # Responses API input items

StopText = Annotated[str, Field(max_length=MAX_STOP_CHARS)]
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
PromptInput = str | list[str] | list[TokenId] | list[list[TokenId]]
SessionId = Annotated[str, Field(max_length=MAX_ID_CHARS, pattern=r"^[^\x00-\x1f\x7f-\x9f]*$",
                                 description="any text without control characters (\"\" is a valid id)")]


def _require_unicode(value: Any) -> Any:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("text contains an unpaired UTF-16 surrogate") from None
    elif isinstance(value, (list, tuple)):
        for item in value:
            _require_unicode(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            _require_unicode(key)
            _require_unicode(item)
    return value


class RequestBody(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        return _require_unicode(value)


# ---------------------------------------------------------------------------- rwkv_lightning
class LightningSampling(RequestBody):
    temperature: float = Field(1.0, ge=0, le=1000, description="0 = greedy (the peer server rejected 0)")
    top_k: int = Field(50, ge=0, le=65536, description="0 = off")
    top_p: float = Field(0.6, ge=0, le=1, description="0 = greedy, 1 = off")
    alpha_presence: float = Field(2.0, ge=-100, le=100, description="penalty added on a token's first use")
    alpha_frequency: float = Field(0.2, ge=-100, le=100, description="penalty added on each later use")
    alpha_decay: float = Field(0.996, ge=0, le=1, description="penalties are multiplied by this every token")
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="extension: reproducible sampling")


class LightningRequest(LightningSampling):
    model: str = Field("rwkv7", max_length=256, description="echoed in the response")
    max_tokens: int | None = Field(None, ge=1, description="tokens per row; default 8192 (or the server limit)")
    stop_tokens: list[StopText | TokenId] = Field(
        default_factory=lambda: ["\nUser:"], max_length=MAX_STOPS,
        description="stop strings (any length); integers are stop token ids. The stop is not returned.")
    stream: bool = False
    chunk_size: int = Field(4, ge=1, le=4096, description="stream: flush a row every N tokens")
    password: str | None = Field(None, max_length=1024, description="alternative to the Bearer header")


class BatchChatRequest(LightningRequest):
    """``/v1/chat/completions`` with ``contents``: one raw prompt (no template) per row."""

    contents: list[str] = Field(min_length=1, description="raw prompts, one batch row each")


class FimRequest(LightningRequest):
    """Fill in the middle (RWKV-7 G1c and later): row i completes between ``prefix[i]`` and ``suffix[i]``."""

    prefix: list[str] = Field(min_length=1)
    suffix: list[str] = Field(min_length=1)
    stop_tokens: list[StopText | TokenId] = Field(default_factory=list, max_length=MAX_STOPS,
                                                  description='e.g. ["✿"]; default: end of document only')


class BigBatchRequest(RequestBody):
    """Temperature-only sampling; the response is always SSE."""

    model: str = Field("rwkv7", max_length=256)
    contents: list[str] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=1000, description="0 = greedy")
    stop_tokens: list[StopText | TokenId] = Field(default_factory=lambda: ["\nUser:"], max_length=MAX_STOPS)
    chunk_size: int = Field(4, ge=1, le=4096)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    password: str | None = Field(None, max_length=1024)


class TranslateRequest(RequestBody):
    """Immersive Translate "custom API" request."""

    source_lang: str = Field("auto", max_length=32, description="language code, or auto")
    target_lang: str = Field(min_length=1, max_length=32)
    text_list: list[str]
    placeholders: list[Annotated[str, Field(min_length=1, max_length=64)]] | None = Field(
        None, max_length=64, description="extra literal markers to keep verbatim (besides {0} and <b0></b0>)")
    password: str | None = Field(None, max_length=1024)


class StateChatRequest(LightningRequest):
    """``/state/chat/completions``: one raw prompt, continued from (and stored as) ``session_id``'s state."""

    contents: list[str] = Field(min_length=1, max_length=1, description="exactly one raw prompt")
    session_id: SessionId | None = Field(None, description="omitted: a stateless turn, nothing is stored")


class MultiStateRequest(LightningRequest):
    """``/multi_state/chat/completions``: continue node ``dialogue_idx`` of the tree ``session_id``."""

    contents: list[str] = Field(min_length=1, max_length=1, description="exactly one raw prompt")
    session_id: SessionId = Field(description="the conversation tree")
    dialogue_idx: int = Field(ge=0, le=2**53, description="node to continue; 0 = the empty root")


class StateStatusRequest(RequestBody):
    offset: int = Field(0, ge=0, le=2**53)
    limit: int = Field(100, ge=1, le=MAX_PAGE)
    password: str | None = Field(None, max_length=1024)


class StateDeleteRequest(RequestBody):
    session_id: SessionId
    delete_prefix: bool = Field(False, description='also every "<session_id>:*" key (multi_state nodes)')
    password: str | None = Field(None, max_length=1024)


# ---------------------------------------------------------------------------- OpenAI
class ContentPart(RequestBody):
    type: str = Field(max_length=64)
    text: str | None = None


class ChatMessage(RequestBody):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[str | ContentPart] | None = None
    name: str | None = Field(None, max_length=256)


class StreamOptions(RequestBody):
    include_usage: bool = False


class OpenAIRequest(RequestBody):
    """Fields shared by chat and legacy completions. ``None`` means "not given"."""

    model: str | None = Field(None, max_length=256, description="echoed; any name is accepted")
    temperature: float | None = Field(None, ge=0, le=1000, description="0 = greedy")
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=0, le=65536, description="extension; 0 = off")
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    alpha_presence: float | None = Field(None, ge=-100, le=100, description="extension (rwkv_lightning)")
    alpha_frequency: float | None = Field(None, ge=-100, le=100, description="extension (rwkv_lightning)")
    alpha_decay: float | None = Field(None, ge=0, le=1, description="extension (rwkv_lightning)")
    seed: int | None = Field(None, ge=-(2**63), le=MAX_SEED, description="choice j samples with seed + j")
    n: int = Field(1, ge=1, le=MAX_N)
    # The bound goes on the list alone: on the union it would also cap a single string's length.
    stop: StopText | Annotated[list[StopText], Field(max_length=MAX_STOPS)] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = Field(
        None, max_length=MAX_LOGIT_BIAS, description="token id (as a string) -> bias added to its logit")
    password: str | None = Field(None, max_length=1024, description="alternative to the Bearer header")

    @field_validator("logit_bias", mode="after")
    @classmethod
    def _token_ids(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not key.strip().isdigit() or int(key) > MAX_TOKEN_ID:
                raise ValueError(f"key {key[:20]!r} is not a token id 0..{MAX_TOKEN_ID}")
        return value


class ChatCompletionRequest(OpenAIRequest):
    messages: list[ChatMessage] = Field(default_factory=list)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="wins over max_tokens")
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    enable_think: bool = Field(False, description="let the model reason first; returned as reasoning_content")
    system: str | None = Field(None, description="extension: system text placed before the messages")
    contents: list[str] | None = Field(None, description="extension (/openai route): contents[0] is a last user turn")
    stop_tokens: list[StopText] | None = Field(None, max_length=MAX_STOPS,
                                               description="extension (rwkv_lightning): more stop strings")
    session_id: SessionId | None = Field(
        None, description="extension: continue the stored state of this session; send only the new messages")


class CompletionRequest(OpenAIRequest):
    prompt: PromptInput
    max_tokens: int | None = Field(16, ge=0, description="0 with echo = score the prompt only")
    echo: bool | None = False
    logprobs: int | None = Field(None, ge=0, le=20, description="top alternatives per token")


class ResponseContentPart(RequestBody):
    type: str = Field(max_length=64, description="input_text / output_text / text carry text; others are dropped")
    text: str | None = None


class ResponseInputMessage(RequestBody):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ResponseContentPart]


class ResponseRequest(RequestBody):
    """``POST /v1/responses`` (OpenAI Responses API, text subset)."""

    model: str | None = Field(None, max_length=256, description="echoed; any name is accepted")
    input: str | Annotated[list[ResponseInputMessage], Field(max_length=MAX_INPUT_MESSAGES)] = Field(
        description="a user message, or messages")
    instructions: str | None = Field(None, description="system text placed before this turn's input")
    previous_response_id: SessionId | None = Field(
        None, description="continue from that response's stored state (its history is not re-sent)")
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=1000, description="0 = greedy")
    top_p: float | None = Field(None, ge=0, le=1)
    stream: bool | None = False
    store: bool | None = Field(True, description="keep the response (and its state) for GET and chaining")
    password: str | None = Field(None, max_length=1024)


# ---------------------------------------------------------------------------- responses
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> "Usage":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class BatchMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class BatchChoice(BaseModel):
    index: int
    message: BatchMessage
    finish_reason: str = Field(description="stop, length or error")


class BatchCompletion(BaseModel):
    id: str
    object: str = Field(description="chat.completion, or FIM.completion")
    created: int
    model: str
    choices: list[BatchChoice]
    usage: Usage


class BatchDelta(BaseModel):
    content: str | None = None


class BatchChunkChoice(BaseModel):
    index: int
    delta: BatchDelta
    finish_reason: str | None = None


class BatchChunk(BaseModel):
    """One SSE ``data:`` event of a lightning stream (then ``data: [DONE]``)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[BatchChunkChoice]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprobEntry]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    reasoning_content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class LegacyLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: LegacyLogprobs | None = None
    finish_reason: str | None


class Completion(BaseModel):
    """The response, and (with ``finish_reason`` null until the row ends) each SSE chunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class MultiStateCompletion(BatchCompletion):
    dialogue_idx: int | None = Field(description="the new node (null when the turn was not stored)")


class MultiStateIndexEvent(BaseModel):
    """The event before ``[DONE]`` of a multi_state stream (only when the turn was stored)."""

    object: Literal["multi_state.dialogue_idx"]
    session_id: str = Field(description='"<session_id>:<dialogue_idx>"')
    dialogue_idx: int


class StateSessionInfo(BaseModel):
    session_id: str
    cache_level: Literal["L1 (VRAM)", "L2 (RAM)", "Database (Disk)"] = Field(
        description="the hottest tier holding it (L1 is the model's device, host memory on a CPU server)")
    last_updated: str = Field(description="last use, UTC, YYYY-MM-DD HH:MM:SS")
    timestamp: float = Field(description="last use, Unix time")
    size_bytes: int


class StateStatus(BaseModel):
    status: Literal["success"] = "success"
    total_sessions: int
    l1_cache_count: int
    l2_cache_count: int
    database_count: int
    offset: int
    limit: int
    sessions: list[StateSessionInfo] = Field(description="this page, most recently used first")


class StateDeleteResult(BaseModel):
    status: Literal["success", "not_found"]
    message: str
    deleted: int = Field(description="sessions deleted")


class ResponseOutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)


class ResponseOutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[ResponseOutputText]


class ResponseUsage(BaseModel):
    input_tokens: int = Field(description="tokens of this turn's input (a chained turn does not re-read history)")
    output_tokens: int
    total_tokens: int


class ResponseObject(BaseModel):
    """A response; also what ``GET /v1/responses/{id}`` returns while it is stored."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed", "cancelled"]
    model: str
    output: list[ResponseOutputMessage]
    usage: ResponseUsage | None = None
    previous_response_id: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float
    top_p: float
    store: bool
    incomplete_details: dict[str, str] | None = None
    error: dict[str, str] | None = None
    parallel_tool_calls: bool = False
    tool_choice: str = "none"
    tools: list[Any] = Field(default_factory=list)
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    truncation: str = "disabled"
    metadata: dict[str, str] = Field(default_factory=dict)


class ResponseEvent(BaseModel):
    """One SSE event of a Responses stream (``event: <type>`` + ``data: <this>``); fields by type."""

    model_config = ConfigDict(extra="allow")
    type: str
    sequence_number: int


class ResponseDeleted(BaseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True


class Translation(BaseModel):
    detected_source_lang: str
    text: str


class TranslateResponse(BaseModel):
    translations: list[Translation]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok", "unavailable"]
    model: str
    running_rows: int
    queued_requests: int
    free_slots: int


class LightningError(BaseModel):
    error: str
    param: str | None = None


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIError(BaseModel):
    error: OpenAIErrorDetail
