"""OpenAI-compatible routes on a live server, driven by the official ``openai`` SDK and by httpx:
chat (stream, usage, finish reasons, stop, seed, n, logprobs, thinking) and legacy completions
(echo + logprobs checked against the runtime's own log-softmax, the lm-evaluation-harness payload)."""
from __future__ import annotations

import math

import pytest
import torch

from infer.api.chat_template import TURN_STOPS, render_chat
from infer.api.context import ServerLimits
from infer.api.schemas import ChatCompletion, ChatCompletionChunk, ChatMessage, Completion
from test_api_support import MODEL_NAME, LiveServer, parse_sse, reference, tiny_model

openai = pytest.importorskip("openai")

MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Write a haiku about\n    indented code.\n\nThank you!"}]
NO_PENALTY = {"presence_penalty": 0, "frequency_penalty": 0}


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def server(model):
    with LiveServer(model, limits=ServerLimits(max_tokens=64, max_rows=16)) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    with server.client() as c:
        yield c


@pytest.fixture(scope="module")
def sdk(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def id_of(server):
    """Token bytes -> id (the vocabulary's byte strings are unique)."""
    return {server.tokenizer.decode_bytes([i]): i for i in range(1, 65530)}


def chat_prompt(server, messages=MESSAGES, think=False) -> list[int]:
    return server.tokenizer.encode(render_chat([ChatMessage.model_validate(m) for m in messages], enable_think=think))


def log_softmax_rows(model, tokens: list[int]) -> torch.Tensor:
    """Row j: the model's log-probabilities for the token after ``tokens[:j+1]``."""
    return torch.log_softmax(model.prefill([tokens], [0], model.new_state_pool(1), all_logits=True).float(), -1)


def test_models_list(sdk, server):
    assert [m.id for m in sdk.models.list()] == [MODEL_NAME]
    other = openai.OpenAI(base_url=f"{server.url}/openai/v1", api_key="unused", max_retries=0)
    assert [m.id for m in other.models.list()] == [MODEL_NAME]


def test_chat_non_stream_greedy_matches_engine(sdk, server, model):
    out = sdk.chat.completions.create(model="my-rwkv", messages=MESSAGES, temperature=0, max_tokens=12, **NO_PENALTY)
    ChatCompletion.model_validate(out.model_dump(exclude_none=True))
    assert out.model == "my-rwkv" and out.id.startswith("chatcmpl-") and out.object == "chat.completion"
    prompt = chat_prompt(server)
    _, text, reason = reference(model, prompt, 12, stop=TURN_STOPS, temperature=0)
    assert out.choices[0].message.content == text and out.choices[0].finish_reason == reason
    assert out.usage.prompt_tokens == len(prompt)
    assert out.usage.total_tokens == len(prompt) + out.usage.completion_tokens


def test_chat_template_keeps_indentation_and_blank_lines():
    text = render_chat([ChatMessage.model_validate(m) for m in MESSAGES])
    assert text == ("System: You are terse.\n\nUser: Write a haiku about\n    indented code.\n\nThank you!"
                    "\n\nAssistant: <think>\n</think>\n")


def test_chat_stream_with_usage_equals_non_stream(sdk):
    kwargs = dict(model="m", messages=MESSAGES, temperature=0, max_tokens=10, **NO_PENALTY)
    whole = sdk.chat.completions.create(**kwargs)
    chunks = list(sdk.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].choices == []
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == whole.choices[0].message.content
    reasons = [c.choices[0].finish_reason for c in chunks[:-1] if c.choices[0].finish_reason]
    assert reasons == [whole.choices[0].finish_reason]
    for c in chunks:
        ChatCompletionChunk.model_validate(c.model_dump(exclude_none=True))


def test_chat_stop_and_max_completion_tokens(sdk, server, model):
    _, text, _ = reference(model, chat_prompt(server), 20, stop=TURN_STOPS, temperature=0)
    stop = text[5:8]
    out = sdk.chat.completions.create(model="m", messages=MESSAGES, temperature=0, max_tokens=20, stop=stop,
                                      **NO_PENALTY)
    assert out.choices[0].message.content == text[:text.index(stop)] and out.choices[0].finish_reason == "stop"
    legacy = sdk.chat.completions.create(model="m", messages=MESSAGES, temperature=0, max_tokens=20,
                                         extra_body={"stop_tokens": [stop]}, **NO_PENALTY)  # the peer's field
    assert legacy.choices[0].message.content == out.choices[0].message.content
    short = sdk.chat.completions.create(model="m", messages=MESSAGES, temperature=0, max_tokens=20,
                                        max_completion_tokens=3, **NO_PENALTY)
    assert short.usage.completion_tokens == 3 and short.choices[0].finish_reason == "length"


def test_seed_reproducible_and_n_choices_differ(sdk):
    def run(seed):
        out = sdk.chat.completions.create(model="m", messages=MESSAGES, temperature=1.0, top_p=1.0, max_tokens=8,
                                          n=3, seed=seed)
        assert [c.index for c in out.choices] == [0, 1, 2]
        return [c.message.content for c in out.choices]
    first = run(7)
    assert run(7) == first
    assert len(set(first)) > 1
    assert run(8) != first
    single = sdk.chat.completions.create(model="m", messages=MESSAGES, temperature=1.0, top_p=1.0, max_tokens=8,
                                         seed=7)
    assert single.choices[0].message.content == first[0]  # choice j samples with seed + j


def test_chat_logprobs_match_the_runtime(sdk, server, model, id_of):
    out = sdk.chat.completions.create(model="m", messages=MESSAGES, temperature=0, max_tokens=8, logprobs=True,
                                      top_logprobs=3, **NO_PENALTY)
    entries = out.choices[0].logprobs.content
    assert len(entries) == out.usage.completion_tokens
    raw = b"".join(bytes(e.bytes) for e in entries)
    assert raw.decode("utf-8", "replace") == out.choices[0].message.content
    prompt = chat_prompt(server)
    generated = [id_of[bytes(e.bytes)] for e in entries]
    logp = log_softmax_rows(model, prompt + generated)
    for k, entry in enumerate(entries):
        row = logp[len(prompt) - 1 + k]
        assert math.isclose(entry.logprob, row[generated[k]].item(), abs_tol=1e-4)
        assert [id_of[bytes(t.bytes)] for t in entry.top_logprobs] == row.topk(3).indices.tolist()
        assert entry.top_logprobs[0].logprob == entry.logprob  # greedy: the chosen token is the top one


def test_chat_thinking_splits_reasoning(client):
    body = {"messages": MESSAGES, "temperature": 0, "max_tokens": 12, "enable_think": True}
    whole = client.post("/v1/chat/completions", json=body).json()
    message = whole["choices"][0]["message"]
    assert "reasoning_content" in message and "<think" not in message["reasoning_content"]
    events = parse_sse(client.post("/v1/chat/completions", json={**body, "stream": True}).text)
    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content", "") for d in deltas) == message["content"]
    plain = client.post("/v1/chat/completions", json={**body, "enable_think": False}).json()
    assert "reasoning_content" not in plain["choices"][0]["message"]


def test_dispatch_and_unknown_fields(client):
    body = {"model": "x", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                                                    {"type": "image_url", "image_url": {"url": "u"}}]}],
            "max_tokens": 3, "tools": [{"type": "function", "function": {"name": "f"}}], "user": "u1",
            "response_format": {"type": "text"}, "something_new": {"nested": True}}
    for path in ("/v1/chat/completions", "/openai/v1/chat/completions"):
        out = client.post(path, json=body)
        assert out.status_code == 200, out.text
        assert out.json()["id"].startswith("chatcmpl-") and out.json()["model"] == "x"
    lightning = client.post("/v1/chat/completions", json={"contents": ["hi"], "messages": [], "max_tokens": 3}).json()
    assert lightning["id"].startswith("rwkv7-batch")


@pytest.mark.parametrize("body, status, param", [
    ({"messages": [{"role": "robot", "content": "x"}]}, 422, "messages[0].role"),
    ({"messages": [{"role": "user", "content": ""}]}, 400, "messages"),
    ({"messages": MESSAGES, "temperature": -1}, 422, "temperature"),
    ({"messages": MESSAGES, "max_tokens": 65}, 400, "max_tokens"),
    ({"messages": MESSAGES, "max_completion_tokens": 0}, 422, "max_completion_tokens"),
    ({"messages": MESSAGES, "n": 17}, 400, "n"),
    ({"messages": MESSAGES, "top_logprobs": 2}, 400, "top_logprobs"),
    ({"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, 422, "top_logprobs"),
    ({"messages": MESSAGES, "logit_bias": {"abc": 1}}, 422, "logit_bias"),
    ({"messages": MESSAGES, "stop": [1, 2]}, 422, "stop"),
    ({"messages": "hello"}, 422, "messages"),
])
def test_chat_errors_have_the_openai_shape(client, body, status, param):
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"].startswith(param)
    assert error["type"] == "invalid_request_error"


def test_sdk_raises_typed_errors(sdk):
    with pytest.raises(openai.UnprocessableEntityError):
        sdk.chat.completions.create(model="m", messages=MESSAGES, temperature=-1)
    with pytest.raises(openai.BadRequestError):
        sdk.chat.completions.create(model="m", messages=MESSAGES, max_tokens=10_000)


# ---------------------------------------------------------------------------- /v1/completions
def lm_eval_parse(choice: dict, ctxlen: int) -> tuple[float, bool]:
    """lm-evaluation-harness ``LocalCompletionsAPI.parse_logprobs`` for one choice."""
    token_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
    top = choice["logprobs"]["top_logprobs"][ctxlen:-1]
    return sum(token_logprobs), all(t == max(d.values()) for t, d in zip(token_logprobs, top))


def test_lm_eval_loglikelihood_payload(client, server, model):
    tok = server.tokenizer
    contexts = ["The capital of France is", "Two plus two equals"]
    continuations = [" Paris.", " four"]
    prompts = [tok.encode(c + x) for c, x in zip(contexts, continuations)]
    body = {"model": "m", "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True}
    out = client.post("/v1/completions", json=body).json()
    Completion.model_validate(out)
    for choice, prompt, context in zip(sorted(out["choices"], key=lambda c: c["index"]), prompts, contexts):
        ctxlen = len(tok.encode(context))
        assert len(choice["logprobs"]["token_logprobs"]) == len(prompt) + 1
        assert choice["logprobs"]["token_logprobs"][0] is None
        logp = log_softmax_rows(model, prompt)
        expected = sum(logp[j - 1, prompt[j]].item() for j in range(ctxlen, len(prompt)))
        total, greedy = lm_eval_parse(choice, ctxlen)
        assert math.isclose(total, expected, abs_tol=1e-3)
        assert greedy == all(logp[j - 1].argmax().item() == prompt[j] for j in range(ctxlen, len(prompt)))


def test_remote_tokenizer_routes_for_lm_eval(client, server):
    """What lm-eval's ``check_remote_tokenizer_support`` probes, then encode/decode round trips."""
    info = client.get("/tokenizer_info").json()
    assert info["eos_token"] == info["bos_token"] == "<|endoftext|>"
    tok = server.tokenizer
    r = client.post("/tokenize", json={"prompt": "Hello<|endoftext|>world", "add_special_tokens": False}).json()
    assert r["tokens"] == tok.encode("Hello") + [0] + tok.encode("world") and r["count"] == len(r["tokens"])
    assert client.post("/tokenize", json={"prompt": "<|endoftext|>"}).json()["tokens"] == [0]  # eos_token_id
    assert client.post("/tokenize", json={"prompt": ""}).json()["tokens"] == []
    back = client.post("/detokenize", json={"tokens": r["tokens"]}).json()
    assert back == {"prompt": "Hello<|endoftext|>world"}
    error = client.post("/detokenize", json={"tokens": [70000]})
    assert error.status_code == 422 and error.json()["error"]["param"].startswith("tokens")


def test_echo_scoring_with_max_tokens_zero(client, server, model):
    text = "Hello world, this is a test of scoring."
    out = client.post("/v1/completions", json={"prompt": text, "max_tokens": 0, "echo": True, "logprobs": 2}).json()
    choice = out["choices"][0]
    assert choice["text"] == text and choice["finish_reason"] == "length"
    assert out["usage"] == {"prompt_tokens": len(server.tokenizer.encode(text)), "completion_tokens": 0,
                            "total_tokens": len(server.tokenizer.encode(text))}
    lp = choice["logprobs"]
    prompt = server.tokenizer.encode(text)
    assert "".join(lp["tokens"]) == text
    offsets = lp["text_offset"] + [len(text)]
    assert [text[offsets[k]:offsets[k + 1]] for k in range(len(prompt))] == lp["tokens"]
    logp = log_softmax_rows(model, prompt)
    for j in range(1, len(prompt)):
        assert math.isclose(lp["token_logprobs"][j], logp[j - 1, prompt[j]].item(), abs_tol=1e-4)
        top = lp["top_logprobs"][j]
        best = server.tokenizer.decode([logp[j - 1].argmax().item()])
        assert math.isclose(top[best], logp[j - 1].max().item(), abs_tol=1e-4)
        assert len(top) in (2, 3)  # top 2, plus the prompt token when it is not among them


def test_end_of_document_is_listed_in_logprobs(client):
    body = {"prompt": [[5, 6, 7]], "max_tokens": 4, "echo": True, "logprobs": 1, "temperature": 0,
            "logit_bias": {"0": 100}}
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["logprobs"]["tokens"][-1] == "<|endoftext|>" and len(choice["logprobs"]["tokens"]) == 4


def test_completion_stream_equals_non_stream(client):
    body = {"prompt": ["Once upon a time", "In a galaxy"], "max_tokens": 9, "temperature": 0, "logprobs": 2,
            "echo": True, "stop": ["\n\n"]}
    whole = client.post("/v1/completions", json=body).json()
    events = parse_sse(client.post("/v1/completions",
                                   json={**body, "stream": True, "stream_options": {"include_usage": True}}).text)
    assert events[-1] == "[DONE]" and events[-2]["usage"] == whole["usage"]
    for i, choice in enumerate(whole["choices"]):
        parts = [c for e in events[:-2] for c in e["choices"] if c["index"] == i]
        assert "".join(c["text"] for c in parts) == choice["text"]
        assert choice["text"].startswith(body["prompt"][i])
        assert [c["finish_reason"] for c in parts if c["finish_reason"]] == [choice["finish_reason"]]
        for key in ("tokens", "token_logprobs", "text_offset"):
            assert [x for c in parts if c["logprobs"] for x in c["logprobs"][key]] == choice["logprobs"][key]


def test_stream_interval_sends_fewer_chunks_of_the_same_text(model, client):
    """--stream-interval 4: a chunk every 4 tokens after the first, the same text and usage as every token."""
    body = {"prompt": ["Once upon a time", "In a galaxy"], "max_tokens": 17, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "logit_bias": {"0": -100}}
    every_token = parse_sse(client.post("/v1/completions", json=body).text)
    with LiveServer(model, stream_interval=4) as live, live.client() as gathered:
        events = parse_sse(gathered.post("/v1/completions", json=body).text)
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 9, "temperature": 0, "stream": True}
        chat_events = parse_sse(gathered.post("/v1/chat/completions", json=chat).text)
    assert events[-2]["usage"] == every_token[-2]["usage"]
    for i in range(2):
        texts = [[c["text"] for e in stream[:-2] for c in e["choices"] if c["index"] == i and c["text"]]
                 for stream in (events, every_token)]
        assert "".join(texts[0]) == "".join(texts[1])
        assert len(texts[0]) <= 1 + 4  # the first token, then 16 in fours
    deltas = [c["delta"].get("content", "") for e in chat_events[:-1] for c in e["choices"]]
    reference_chat = client.post("/v1/chat/completions", json={**chat, "stream": False}).json()
    assert "".join(deltas) == reference_chat["choices"][0]["message"]["content"]


def test_completion_n_and_seed_ordering(client):
    body = {"prompt": ["Alpha", "Beta"], "max_tokens": 6, "n": 2, "seed": 3, "temperature": 1.0}
    out = client.post("/v1/completions", json=body).json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    alone = client.post("/v1/completions", json={**body, "prompt": "Beta", "n": 1}).json()
    assert out["choices"][2]["text"] == alone["choices"][0]["text"]  # prompt 1, choice 0 -> seed 3


def test_sdk_completions(sdk):
    out = sdk.completions.create(model="m", prompt="Say something", max_tokens=5, temperature=0, echo=True)
    assert out.choices[0].text.startswith("Say something") and out.usage.completion_tokens <= 5


@pytest.mark.parametrize("body, status, param", [
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": [[]]}, 400, "prompt"),
    ({"prompt": [70000]}, 422, "prompt"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": "x", "logprobs": 50}, 422, "logprobs"),
    ({"prompt": ["a"] * 9, "n": 2}, 400, "n"),
])
def test_completion_errors(client, body, status, param):
    r = client.post("/v1/completions", json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"].startswith(param)


def test_openapi_documents_real_schemas(client):
    doc = client.get("/openapi.json").json()
    schemas = doc["components"]["schemas"]
    assert {"messages", "n", "seed", "logprobs", "enable_think"} <= set(schemas["ChatCompletionRequest"]["properties"])
    assert {"contents", "stop_tokens", "chunk_size"} <= set(schemas["BatchChatRequest"]["properties"])
    assert {"prompt", "echo", "logprobs"} <= set(schemas["CompletionRequest"]["properties"])
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    refs = [r["$ref"] for r in chat["requestBody"]["content"]["application/json"]["schema"]["anyOf"]]
    assert refs == ["#/components/schemas/BatchChatRequest", "#/components/schemas/ChatCompletionRequest"]
    assert "text/event-stream" in chat["responses"]["200"]["content"]
    ok = doc["paths"]["/v1/completions"]["post"]["responses"]["200"]["content"]["application/json"]["schema"]
    assert ok == {"$ref": "#/components/schemas/Completion"}
    assert "swagger-ui" in client.get("/docs").text.lower()
