"""Property-based fuzzing of the OpenAPI schema (schemathesis): valid and invalid bodies for every
operation must never produce a 5xx, JSON responses must match their documented schemas, and the
server must stay healthy with every slot free afterwards. Bounded: a few dozen examples per operation."""
from __future__ import annotations

import pytest

from infer.api.context import ServerLimits
from test_api_support import LiveServer, tiny_model

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import content_type_conformance, response_schema_conformance  # noqa: E402

PASSWORD = "fuzz-pw"
AUTH = {"Authorization": f"Bearer {PASSWORD}"}
MAX_EXAMPLES = 60
OPERATIONS = {"POST /v1/chat/completions", "POST /openai/v1/chat/completions", "POST /v1/completions",
              "GET /v1/models", "GET /openai/v1/models", "POST /translate/v1/batch-translate",
              "POST /FIM/v1/batch-FIM", "POST /big_batch/completions", "GET /health", "GET /metrics",
              "GET /tokenizer_info", "POST /tokenize", "POST /detokenize", "POST /state/chat/completions",
              "POST /multi_state/chat/completions", "POST /state/status", "POST /state/delete", "POST /v1/responses",
              "GET /v1/responses/{response_id}", "DELETE /v1/responses/{response_id}"}


@pytest.fixture(scope="module")
def live():
    # Tiny limits keep every generated request cheap; larger values are rejected with 400s.
    limits = ServerLimits(max_tokens=4, max_prompt_tokens=64, max_rows=4, max_body_bytes=64 * 1024)
    with LiveServer(tiny_model(), slots=8, limits=limits, password=PASSWORD) as server:
        yield server


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_no_server_errors(live, mode):
    api = schemathesis.openapi.from_url(f"{live.url}/openapi.json", headers=AUTH)
    operations = [result.ok() for result in api.get_all_operations()]
    assert {op.label for op in operations} == OPERATIONS  # every route is documented, hence fuzzed
    for operation in operations:
        @given(case=operation.as_strategy(generation_mode=schemathesis.GenerationMode(mode)))
        @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def call(case):
            case.call_and_validate(headers=AUTH, timeout=60,
                                   checks=[not_a_server_error, content_type_conformance, response_schema_conformance])
        call()


def test_server_is_healthy_afterwards(live):
    with live.client() as c:
        assert c.get("/health").status_code == 200
        r = c.post("/v1/chat/completions", json={"contents": ["still fine"], "max_tokens": 2}, headers=AUTH)
        assert r.status_code == 200
    live.wait_idle()
    assert live.engine.free_slots == 8
