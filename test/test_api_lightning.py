"""rwkv_lightning-compatible routes on a live server (tiny random model): request bodies shaped like
the peer's README, SSE parsed, content and finish reasons asserted."""
from __future__ import annotations

import concurrent.futures

import pytest

from infer.api.context import ServerLimits
from infer.api.schemas import BatchChunk, BatchCompletion, TranslateResponse
from test_api_support import LiveServer, parse_sse, reference, tiny_model

NO_PENALTY = {"alpha_presence": 0, "alpha_frequency": 0, "alpha_decay": 1.0}
GREEDY = {"temperature": 0, **NO_PENALTY}
CHAT_PROMPTS = ["User: 你好，请介绍一下你自己\n\nAssistant: <think>\n</think>\n",
                "English: After a blissful two weeks, Jane encounters Rochester in the gardens.\n\nChinese:"]


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def server(model):
    # translate asks for up to 2048 tokens; the server limit keeps the random model's rambling short
    with LiveServer(model, limits=ServerLimits(max_tokens=48)) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    with server.client() as c:
        yield c


def stream_rows(events: list, rows: int) -> tuple[list[str], list[str | None]]:
    """Per-row text and finish_reason from lightning SSE events (validated against the documented schema)."""
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    texts, reasons = [""] * rows, [None] * rows
    for event in events[:-1]:
        BatchChunk.model_validate(event)
        for choice in event["choices"]:
            i = choice["index"]
            assert reasons[i] is None, "no output after a row's finish chunk"
            texts[i] += choice["delta"].get("content") or ""
            reasons[i] = choice.get("finish_reason")
    return texts, reasons


def batch(client, **body) -> dict:
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_batch_non_stream_readme_body(client, server):
    body = {"contents": CHAT_PROMPTS, "max_tokens": 12, "stop_tokens": ["\nUser:"], "temperature": 1.0,
            "top_k": 50, "top_p": 0.6, "alpha_presence": 1.0, "alpha_frequency": 0.1, "alpha_decay": 0.996,
            "stream": False, "chunk_size": 8, "seed": 5}
    out = batch(client, **body)
    BatchCompletion.model_validate(out)
    assert out["object"] == "chat.completion" and out["model"] == "rwkv7"
    assert [c["index"] for c in out["choices"]] == [0, 1]
    prompt_tokens = sum(len(server.tokenizer.encode(p)) for p in CHAT_PROMPTS)
    assert out["usage"]["prompt_tokens"] == prompt_tokens
    assert out["usage"]["total_tokens"] == prompt_tokens + out["usage"]["completion_tokens"]
    for choice in out["choices"]:
        assert choice["message"]["role"] == "assistant" and choice["message"]["content"]
        assert choice["finish_reason"] in ("stop", "length")
    again = batch(client, **body)
    assert [c["message"]["content"] for c in again["choices"]] == [c["message"]["content"] for c in out["choices"]]


def test_greedy_rows_match_the_engine_and_finish_by_length(client, server, model):
    out = batch(client, contents=CHAT_PROMPTS, max_tokens=10, stop_tokens=[], **GREEDY)
    for prompt, choice in zip(CHAT_PROMPTS, out["choices"]):
        _, text, _ = reference(model, server.tokenizer.encode(prompt), 10, temperature=0)
        assert choice["message"]["content"] == text
        assert choice["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 20


def test_stream_equals_non_stream_with_a_finish_chunk_per_row(client):
    body = {"contents": CHAT_PROMPTS, "max_tokens": 14, "chunk_size": 3, **GREEDY}
    whole = batch(client, **body)
    r = client.post("/v1/chat/completions", json={**body, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    texts, reasons = stream_rows(parse_sse(r.text), 2)
    assert texts == [c["message"]["content"] for c in whole["choices"]]
    assert reasons == [c["finish_reason"] for c in whole["choices"]]


def test_chunk_size_groups_tokens(client):
    body = {"contents": CHAT_PROMPTS[:1], "max_tokens": 12, "stream": True, "stop_tokens": [], **GREEDY}
    one = [e for e in parse_sse(client.post("/v1/chat/completions", json={**body, "chunk_size": 1}).text)[:-1]
           if "content" in e["choices"][0]["delta"]]
    four = [e for e in parse_sse(client.post("/v1/chat/completions", json={**body, "chunk_size": 4}).text)[:-1]
            if "content" in e["choices"][0]["delta"]]
    assert len(four) < len(one)
    assert "".join(e["choices"][0]["delta"]["content"] for e in one) == \
        "".join(e["choices"][0]["delta"]["content"] for e in four)


def test_stop_string_and_stop_token_id(client, server, model):
    prompt = CHAT_PROMPTS[0]
    tokens, text, _ = reference(model, server.tokenizer.encode(prompt), 16, temperature=0)
    stop = text[6:10]
    out = batch(client, contents=[prompt], max_tokens=16, stop_tokens=[stop], **GREEDY)["choices"][0]
    assert out["message"]["content"] == text[:text.index(stop)] and out["finish_reason"] == "stop"
    by_id = batch(client, contents=[prompt], max_tokens=16, stop_tokens=[tokens[4]], **GREEDY)["choices"][0]
    assert by_id["message"]["content"] == server.tokenizer.decode(tokens[:4]) and by_id["finish_reason"] == "stop"


def test_temperature_zero_is_greedy_not_an_error(client):
    a = batch(client, contents=["Hello"], max_tokens=6, temperature=0)
    b = batch(client, contents=["Hello"], max_tokens=6, temperature=0)
    assert a["choices"][0]["message"] == b["choices"][0]["message"]


def test_fim_readme_body_honours_stop_tokens(client, server, model):
    prefix = ["The rain had stopped, and the city was quiet.", "def fibonacci(n):\n",
              "<html>\n<head>\n<title>"]
    suffix = ["She walked home alone.", "\n    return a\n", "</title>\n</head>\n</html>"]
    out = client.post("/FIM/v1/batch-FIM", json={"prefix": prefix, "suffix": suffix, "max_tokens": 10,
                                                 "stop_tokens": [], **GREEDY}).json()
    BatchCompletion.model_validate(out)
    assert out["object"] == "FIM.completion" and len(out["choices"]) == 3
    fim_prompt = f"✿prefix✿✿suffix✿{suffix[1]}✿middle✿{prefix[1]}"
    _, text, _ = reference(model, server.tokenizer.encode(fim_prompt), 10, temperature=0)
    assert out["choices"][1]["message"]["content"] == text
    stop = text[3:6]
    cut = client.post("/FIM/v1/batch-FIM", json={"prefix": prefix[1:2], "suffix": suffix[1:2], "max_tokens": 10,
                                                 "stop_tokens": [stop], **GREEDY}).json()["choices"][0]
    assert cut["message"]["content"] == text[:text.index(stop)] and cut["finish_reason"] == "stop"
    r = client.post("/FIM/v1/batch-FIM", json={"prefix": prefix, "suffix": suffix, "max_tokens": 10, "stream": True,
                                               "stop_tokens": [], **GREEDY})
    texts, reasons = stream_rows(parse_sse(r.text), 3)
    assert texts == [c["message"]["content"] for c in out["choices"]] and reasons == ["length"] * 3


def test_fim_mismatched_lists_is_400(client):
    r = client.post("/FIM/v1/batch-FIM", json={"prefix": ["a", "b"], "suffix": ["c"]})
    assert r.status_code == 400 and r.json()["param"] == "suffix" and "same length" in r.json()["error"]


def test_big_batch_is_always_sse(client, server, model):
    body = {"contents": CHAT_PROMPTS, "max_tokens": 8, "temperature": 0, "stop_tokens": ["\nUser:"],
            "chunk_size": 4, "stream": False}
    r = client.post("/big_batch/completions", json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    texts, reasons = stream_rows(parse_sse(r.text), 2)
    for prompt, text in zip(CHAT_PROMPTS, texts):
        # temperature only: no penalties, so greedy equals the engine's plain greedy output
        _, expected, _ = reference(model, server.tokenizer.encode(prompt), 8, stop=("\nUser:",), temperature=0)
        assert text == expected
    assert all(reason in ("stop", "length") for reason in reasons)


def test_big_batch_concurrent_requests_are_independent(server):
    bodies = [{"contents": [f"Request {i}: count to ten.", f"Row two of request {i}"], "max_tokens": 10,
               "temperature": 0, "stop_tokens": []} for i in range(6)]

    def run(body):
        with server.client() as c:
            return stream_rows(parse_sse(c.post("/big_batch/completions", json=body).text), 2)[0]
    alone = [run(b) for b in bodies]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        together = list(pool.map(run, bodies))
    assert together == alone


def test_translate_readme_body(client):
    r = client.post("/translate/v1/batch-translate",
                    json={"source_lang": "en", "target_lang": "zh-CN", "text_list": ["Hello world!", "Good morning"]})
    assert r.status_code == 200, r.text
    out = TranslateResponse.model_validate(r.json())
    assert [t.detected_source_lang for t in out.translations] == ["en", "en"]
    assert all(t.text == t.text.strip() and t.text for t in out.translations)


def test_translate_auto_detects_and_keeps_blank_texts(client):
    r = client.post("/translate/v1/batch-translate",
                    json={"target_lang": "en", "text_list": ["你好，世界", "   ", "こんにちは", "Привет"]}).json()
    assert [t["detected_source_lang"] for t in r["translations"]] == ["zh-CN", "en", "ja", "ru"]
    assert r["translations"][1]["text"] == "   "


def test_translate_keeps_placeholders(client):
    texts = ["Hello {0}, welcome to {1}!", "<b0></b0> Hallo <b1></b1> Welt", "Click <a0>here</a0> now"]
    out = client.post("/translate/v1/batch-translate", json={"source_lang": "de", "target_lang": "zh-CN",
                                                             "text_list": texts}).json()["translations"]
    markers = [["{0}", "{1}"], ["<b0>", "</b0>", "<b1>", "</b1>"], ["<a0>", "</a0>"]]
    for translation, expected in zip(out, markers):
        positions = [translation["text"].find(m) for m in expected]
        assert all(p >= 0 for p in positions) and positions == sorted(positions), translation


def test_empty_contents_and_bad_fields_are_4xx(client):
    r = client.post("/v1/chat/completions", json={"contents": []})
    assert r.status_code == 422 and r.json()["param"] == "contents"
    r = client.post("/big_batch/completions", json={"contents": ["x"], "stop_tokens": [{"a": 1}]})
    assert r.status_code == 422 and r.json()["param"].startswith("stop_tokens")
    r = client.post("/v1/chat/completions", json={"contents": [""]})
    assert r.status_code == 400 and r.json()["param"] == "contents[0]"
