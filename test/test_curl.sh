#!/usr/bin/env bash
# Smoke test of every endpoint against a live server, with assertions on the responses.
#
#   BASE=http://127.0.0.1:8000 [PASSWORD=...] [MAX_TOKENS=16] bash test/test_curl.sh
#
# Needs curl and jq. Exits non-zero at the first failed check and prints the response.
set -euo pipefail

BASE=${BASE:-http://127.0.0.1:8000}
PASSWORD=${PASSWORD:-}
MAX_TOKENS=${MAX_TOKENS:-16}
AUTH=()
if [ -n "$PASSWORD" ]; then AUTH=(-H "Authorization: Bearer $PASSWORD"); fi
BODY_FILE=$(mktemp)
trap 'rm -f "$BODY_FILE"' EXIT
STATUS=0
BODY=""
CHECKS=0

fail() { echo "FAIL: $*" >&2; echo "--- response ($STATUS) ---" >&2; echo "$BODY" | head -c 2000 >&2; echo >&2; exit 1; }

# request METHOD PATH [JSON] [extra curl args...]: sets STATUS and BODY
request() {
  local method=$1 path=$2 data=${3:-}
  shift 3 || shift $#
  local args=(-sS -o "$BODY_FILE" -w '%{http_code}' -X "$method" "$@")
  if [ -n "$data" ]; then args+=(-H 'Content-Type: application/json' --data-binary "$data"); fi
  STATUS=$(curl "${args[@]}" "$BASE$path")
  BODY=$(cat "$BODY_FILE")
}
api() { request "$1" "$2" "${3:-}" "${AUTH[@]}"; }

expect_status() { [ "$STATUS" = "$1" ] || fail "$2: expected HTTP $1"; CHECKS=$((CHECKS + 1)); }
# expect_json FILTER LABEL: the jq filter must be true for BODY
expect_json() { jq -e "$1" >/dev/null 2>&1 <<<"$BODY" || fail "$2: $1"; CHECKS=$((CHECKS + 1)); }
# SSE: the last event is [DONE], every other event is one JSON object; EVENTS becomes a JSON array of them
sse_events() {
  [ "$(printf '%s' "$BODY" | grep -v '^$' | tail -n 1)" = "data: [DONE]" ] || fail "$1: stream must end with [DONE]"
  printf '%s' "$BODY" | grep -v '^$' | grep -v '^data: ' && fail "$1: every SSE line must be 'data: ...'"
  EVENTS=$(printf '%s' "$BODY" | grep '^data: {' | sed 's/^data: //' | jq -s '.') || fail "$1: bad JSON event"
  CHECKS=$((CHECKS + 1))
}
expect_events() { jq -e "$1" >/dev/null <<<"$EVENTS" || fail "$2: $1"; CHECKS=$((CHECKS + 1)); }

CHAT='User: 你好，请介绍一下你自己\n\nAssistant: <think>\n</think>\n'
TRANSLATE_PROMPT='English: After a blissful two weeks, Jane encounters Rochester in the gardens.\n\nChinese:'

# --- server ---------------------------------------------------------------------------
request GET /health
expect_status 200 health
expect_json '.status == "ok" and (.free_slots | type == "number")' health

api GET /v1/models
expect_status 200 models
expect_json '.object == "list" and (.data[0].id | type == "string") and .data[0].object == "model"' models
MODEL=$(jq -r '.data[0].id' <<<"$BODY")

api GET /openai/v1/models
expect_status 200 openai-models
expect_json ".data[0].id == \"$MODEL\"" openai-models

api GET /metrics
expect_status 200 metrics
grep -q '^rwkv_free_slots ' <<<"$BODY" || fail "metrics: rwkv_free_slots missing"

if [ -n "$PASSWORD" ]; then
  request POST /v1/chat/completions "{\"contents\": [\"hi\"], \"max_tokens\": 2}"
  expect_status 401 no-password
  expect_json '.error | type == "string"' no-password
  request POST /v1/chat/completions "{\"contents\": [\"hi\"], \"max_tokens\": 2, \"password\": \"$PASSWORD\"}"
  expect_status 200 body-password
fi

# --- rwkv_lightning batch ------------------------------------------------------------------
BATCH="{\"contents\": [\"$CHAT\", \"$TRANSLATE_PROMPT\"], \"max_tokens\": $MAX_TOKENS, \"stop_tokens\": [\"\\nUser:\"],
  \"temperature\": 1.0, \"top_k\": 50, \"top_p\": 0.6, \"alpha_presence\": 1.0, \"alpha_frequency\": 0.1,
  \"alpha_decay\": 0.996, \"chunk_size\": 8, \"stream\": false}"
api POST /v1/chat/completions "$BATCH"
expect_status 200 batch
expect_json '.object == "chat.completion" and (.choices | length) == 2 and ([.choices[].index] == [0, 1])' batch
expect_json 'all(.choices[]; .message.role == "assistant" and (.message.content | type == "string")
  and (.finish_reason == "stop" or .finish_reason == "length"))' batch
expect_json '.usage.total_tokens == .usage.prompt_tokens + .usage.completion_tokens and .usage.prompt_tokens > 0' batch

api POST /v1/chat/completions "${BATCH/\"stream\": false/\"stream\": true}"
expect_status 200 batch-stream
sse_events batch-stream
expect_events 'all(.[]; .object == "chat.completion.chunk")' batch-stream
expect_events '[.[].choices[] | select(.finish_reason != null) | .index] | sort == [0, 1]' batch-stream
expect_events '([.[].choices[] | select(.index == 0) | .delta.content // ""] | add | length) > 0' batch-stream

api POST /v1/chat/completions '{"contents": [], "max_tokens": 4}'
expect_status 422 empty-contents
expect_json '.param == "contents" and (.error | type == "string")' empty-contents

api POST /v1/chat/completions '{"contents": ["x"], "temperature": 0, "max_tokens": 2}'
expect_status 200 temperature-zero

api POST /v1/chat/completions '{not json'
expect_status 400 invalid-json

# --- translate, FIM, big batch ----------------------------------------------------------------
api POST /translate/v1/batch-translate '{"source_lang": "en", "target_lang": "zh-CN", "text_list": ["Hello world!", "Good morning"]}'
expect_status 200 translate
expect_json '(.translations | length) == 2 and all(.translations[]; .detected_source_lang == "en" and (.text | type == "string"))' translate

FIM="{\"prefix\": [\"The rain had stopped, and\", \"def fibonacci(n):\\n\", \"<title>\"],
  \"suffix\": [\"she walked home.\", \"\\n    return a\\n\", \"</title>\"], \"stop_tokens\": [\"✿\"], \"max_tokens\": $MAX_TOKENS}"
api POST /FIM/v1/batch-FIM "$FIM"
expect_status 200 fim
expect_json '.object == "FIM.completion" and (.choices | length) == 3' fim
api POST /FIM/v1/batch-FIM '{"prefix": ["a", "b"], "suffix": ["c"]}'
expect_status 400 fim-mismatch
expect_json '.param == "suffix"' fim-mismatch

api POST /big_batch/completions "{\"contents\": [\"$CHAT\", \"$CHAT\"], \"max_tokens\": $MAX_TOKENS, \"temperature\": 1.0, \"chunk_size\": 4}"
expect_status 200 big-batch
sse_events big-batch
expect_events '[.[].choices[] | select(.finish_reason != null) | .index] | sort == [0, 1]' big-batch

# --- OpenAI ---------------------------------------------------------------------------------
OPENAI_CHAT="{\"model\": \"any-name\", \"messages\": [{\"role\": \"system\", \"content\": \"Be brief.\"},
  {\"role\": \"user\", \"content\": \"Say hello.\"}], \"max_tokens\": $MAX_TOKENS, \"temperature\": 0}"
for path in /v1/chat/completions /openai/v1/chat/completions; do
  api POST $path "$OPENAI_CHAT"
  expect_status 200 "chat $path"
  expect_json '.object == "chat.completion" and .model == "any-name" and (.id | startswith("chatcmpl-"))' "chat $path"
  expect_json '.choices[0].message.role == "assistant" and (.choices[0].finish_reason | IN("stop", "length"))' "chat $path"
  expect_json '.usage.completion_tokens > 0' "chat $path"
done
CONTENT=$(jq -r '.choices[0].message.content' <<<"$BODY")

api POST /v1/chat/completions "${OPENAI_CHAT%\}}, \"stream\": true, \"stream_options\": {\"include_usage\": true}}"
expect_status 200 chat-stream
sse_events chat-stream
expect_events '.[0].choices[0].delta.role == "assistant"' chat-stream
expect_events '.[-1].choices == [] and .[-1].usage.total_tokens > 0' chat-stream
STREAMED=$(jq -r '[.[].choices[]?.delta.content // ""] | add' <<<"$EVENTS")
[ "$STREAMED" = "$CONTENT" ] || fail "chat-stream: streamed text differs from the non-stream text (greedy)"

api POST /v1/chat/completions '{"messages": [{"role": "robot", "content": "x"}]}'
expect_status 422 chat-bad-role
expect_json '.error.param == "messages[0].role" and .error.type == "invalid_request_error"' chat-bad-role

api POST /v1/completions '{"prompt": "The quick brown fox", "max_tokens": 0, "echo": true, "logprobs": 1}'
expect_status 200 completions-echo
expect_json '.object == "text_completion" and .choices[0].text == "The quick brown fox"' completions-echo
expect_json '.choices[0].logprobs.token_logprobs[0] == null and (.choices[0].logprobs.token_logprobs[1:] | all(. < 0))' completions-echo
expect_json '(.choices[0].logprobs.tokens | join("")) == "The quick brown fox"' completions-echo

api POST /v1/completions "{\"prompt\": [\"Once upon a time\"], \"max_tokens\": $MAX_TOKENS, \"stream\": true}"
expect_status 200 completions-stream
sse_events completions-stream
expect_events 'all(.[]; .object == "text_completion")' completions-stream

echo "test_curl.sh: all $CHECKS checks passed against $BASE"
