#!/usr/bin/env bash
# curl checks against a running Tandem server; exits non-zero at the first failure.
#   scripts/smoke.sh [BASE_URL]      (default http://127.0.0.1:8000)
# Set TANDEM_API_KEY when the server requires a key.
set -euo pipefail
BASE="${1:-http://127.0.0.1:8000}"
AUTH=()
[ -n "${TANDEM_API_KEY:-}" ] && AUTH=(-H "Authorization: Bearer ${TANDEM_API_KEY}")
fail() { echo "FAIL: $*" >&2; exit 1; }
ok() { echo "ok: $*"; }

health=$(curl -sf "$BASE/health") || fail "/health did not answer 200"
echo "$health" | grep -q '"status":"ok"' || fail "/health is not ok: $health"
ok "/health"

models=$(curl -sf "${AUTH[@]}" "$BASE/v1/models") || fail "/v1/models"
model=$(echo "$models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])') || fail "no model in /v1/models"
ok "/v1/models -> $model"

body=$(printf '{"model":"%s","messages":[{"role":"user","content":"What is the capital of France?"}],"max_tokens":24,"temperature":0}' "$model")
answer=$(curl -sf "${AUTH[@]}" -H 'content-type: application/json' -d "$body" "$BASE/v1/chat/completions") || fail "chat completion"
echo "$answer" | python3 -c 'import json,sys; r=json.load(sys.stdin); assert r["choices"][0]["message"]["content"], r' || fail "empty answer: $answer"
ok "chat completion: $(echo "$answer" | python3 -c 'import json,sys; print(json.load(sys.stdin)["choices"][0]["message"]["content"][:60])')"

stream=$(curl -sfN "${AUTH[@]}" -H 'content-type: application/json' -d "${body%\}},\"stream\":true}" "$BASE/v1/chat/completions") || fail "streaming"
echo "$stream" | grep -q '^data: \[DONE\]' || fail "stream did not end with [DONE]"
ok "streaming chat completion"

code=$(curl -s -o /dev/null -w '%{http_code}' "${AUTH[@]}" -H 'content-type: application/json' -d '{"model":"x"' "$BASE/v1/chat/completions")
[ "$code" = 400 ] || fail "malformed JSON gave $code, not 400"
ok "malformed JSON -> 400"

code=$(curl -s -o /dev/null -w '%{http_code}' "${AUTH[@]}" -H 'content-type: application/json' -d "{\"model\":\"no-such-model\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}" "$BASE/v1/chat/completions")
[ "$code" = 404 ] || fail "unknown model gave $code, not 404"
ok "unknown model -> 404"
echo "all smoke checks passed"
