"""The Responses API on a live server, through the official SDK and httpx: chaining through the stored
state gives exactly the tokens of the whole conversation fed at once; GET, DELETE, streaming events,
store=false, errors."""
from __future__ import annotations

import json

import pytest

from infer.api.chat_template import TURN_STOPS, render_chat
from infer.api.openai import CHAT_DEFAULTS
from infer.api.responses import ResponseRun
from infer.api.schemas import ChatMessage, ResponseObject, ResponseRequest
from infer.engine import RowFinished, RowText
from infer.sampler import SamplingParams
from test_api_support import LiveServer, reference, tiny_model

openai = pytest.importorskip("openai")

# The chat defaults (penalties included) at temperature 0: what a Responses request samples with.
SAMPLING = dict(temperature=0, top_p=CHAT_DEFAULTS.top_p, top_k=CHAT_DEFAULTS.top_k,
                alpha_presence=CHAT_DEFAULTS.alpha_presence, alpha_frequency=CHAT_DEFAULTS.alpha_frequency,
                alpha_decay=CHAT_DEFAULTS.alpha_decay)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def server(model):
    with LiveServer(model) as live:
        yield live


@pytest.fixture(scope="module")
def sdk(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def parse_events(body: str) -> list[dict]:
    """OpenAI's framing: ``event: <type>`` then ``data: <json>`` whose type matches."""
    events = []
    for block in filter(None, body.split("\n\n")):
        head, data = block.split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert head == f"event: {payload['type']}"
        events.append(payload)
    return events


def test_chained_responses_continue_the_stored_state(sdk, server, model):
    tokens: list[int] = []
    previous = None
    for n, (instructions, question) in enumerate([("Be brief.", "What is RWKV?"), (None, "Why?"), (None, "Ok.")]):
        out = sdk.responses.create(model="rwkv", input=question, instructions=instructions, temperature=0,
                                   max_output_tokens=5, previous_response_id=previous)
        ResponseObject.model_validate(out.model_dump())
        text = render_chat([ChatMessage(role="user", content=question)], system=instructions)
        prompt = tokens + server.tokenizer.encode(("\n\n" if n else "") + text)
        generated, visible, _ = reference(model, prompt, 5, stop=TURN_STOPS, **SAMPLING)
        assert out.output_text == visible and out.previous_response_id == previous
        assert (out.status, out.incomplete_details.reason) == ("incomplete", "max_output_tokens")
        assert out.usage.input_tokens == len(prompt) - len(tokens) and out.usage.output_tokens == 5
        tokens, previous = prompt + generated, out.id
    stored = sdk.responses.retrieve(previous)
    assert stored.model_dump() == out.model_dump()


def test_two_follow_ups_of_one_response_are_branches(sdk):
    first = sdk.responses.create(model="m", input="Start.", temperature=0, max_output_tokens=4)
    a = sdk.responses.create(model="m", input="Go on.", previous_response_id=first.id, temperature=0,
                             max_output_tokens=4)
    b = sdk.responses.create(model="m", input="Go on.", previous_response_id=first.id, temperature=0,
                             max_output_tokens=4)
    assert a.id != b.id and a.output_text == b.output_text  # the first response was not advanced by a


def test_stream_events(server, sdk):
    with server.client() as c:
        body = {"model": "m", "input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
                "temperature": 0, "max_output_tokens": 4, "stream": True}
        r = c.post("/v1/responses", json=body)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = parse_events(r.text)
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert final["output"][0]["content"][0]["text"] == text == events[-4]["text"]
    again = sdk.responses.create(model="m", input="Hi", temperature=0, max_output_tokens=4)
    assert again.output_text == text
    assert sdk.responses.retrieve(final["id"]).output_text == text  # a streamed response is stored too
    kinds = [e.type for e in sdk.responses.create(model="m", input="Hi", max_output_tokens=2, stream=True)]
    assert kinds[0] == "response.created" and kinds[-1] == "response.incomplete"


def test_completed_status_after_a_stop():
    body = ResponseRequest(input="x", store=True)
    run = ResponseRun("resp_1", body, "m", SamplingParams(temperature=0.5, top_p=0.9), prompt_tokens=3)
    assert run.response()["status"] == "in_progress" and run.response()["output"] == []
    run.add([RowText(0, "Hello", 5), RowFinished(0, "stop", 3, 2, text="!")])
    final = run.response()
    assert final["status"] == "completed" and final["incomplete_details"] is None
    assert final["output"][0]["status"] == "completed" and final["output"][0]["content"][0]["text"] == "Hello!"
    assert final["usage"] == {"input_tokens": 3, "output_tokens": 2, "total_tokens": 5}
    run.add([RowFinished(0, "error", 3, 0)])
    assert run.response()["status"] == "failed" and run.response()["error"]["code"] == "server_error"


def test_long_input_and_many_messages(sdk):
    long = sdk.responses.create(model="m", input="word " * 2000, max_output_tokens=1, store=False)
    assert long.usage.input_tokens > 2000
    many = sdk.responses.create(model="m", max_output_tokens=1, store=False,
                                input=[{"role": "user", "content": f"m{i}"} for i in range(1024)])
    assert many.status == "incomplete"


def test_get_delete_and_store_false(sdk, server):
    kept = sdk.responses.create(model="m", input="Keep me.", max_output_tokens=3)
    assert sdk.responses.retrieve(kept.id).id == kept.id
    sdk.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(kept.id)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.create(model="m", input="x", previous_response_id=kept.id, max_output_tokens=2)
    loose = sdk.responses.create(model="m", input="Forget me.", max_output_tokens=3, store=False)
    assert loose.store is False
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(loose.id)
    with server.client() as c:
        assert all(not s["session_id"].startswith(loose.id) for s in c.post("/state/status").json()["sessions"])


@pytest.mark.parametrize("body, status, param", [
    ({"input": ""}, 400, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "input"),
    ({"input": [{"type": "function_call", "role": "user", "content": "x"}]}, 422, "input"),
    ({"input": "x", "max_output_tokens": 10**6}, 400, "max_output_tokens"),
    ({"input": "x", "previous_response_id": "resp_missing"}, 404, "previous_response_id"),
    ({"input": "x", "previous_response_id": "x" * 257}, 422, "previous_response_id"),
    ({"input": "x", "temperature": -1}, 422, "temperature"),
    ({"input": [{"role": "user", "content": "x"}] * 1025}, 422, "input"),
])
def test_bad_requests_are_named_4xx(server, body, status, param):
    with server.client() as c:
        r = c.post("/v1/responses", json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"].startswith(param)  # a union's errors name the member (input.str)
