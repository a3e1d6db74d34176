#!/usr/bin/env bash
# On the GPU: structured outputs, tool calls and penalties through `pegainfer serve --device cuda` on the small
# checkpoint (grammar bitmasks and penalties applied in the sampler tail). Needs the serving wheels
# (scripts/gpu/serve_wheels.sh) and xgrammar's for Python 3.12 in .gpu/xg (pip download xgrammar==0.2.9
# apache-tvm-ffi==0.1.12 --python-version 3.12 --only-binary=:all: --no-deps -d .gpu/xg).
#   carry [".gpu/small", ".gpu/cache_qwen3", ".gpu/wheels", ".gpu/xg"]:
#       PEGAINFER_CACHE=$PWD/.gpu/cache_qwen3 bash scripts/gpu/structured_check.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/wheels/*.whl .gpu/xg/*.whl || exit 1
. scripts/gpu/env.sh
export PYTHONPATH=$PYTHONPATH:/tmp/site PEGAINFER_CACHE=${PEGAINFER_CACHE:-$PWD/.gpu/cache_smoke}
python3 -m pegainfer.cli serve --model-path .gpu/small --device cuda --port 8000 --served-model-name small \
    --gpu-memory-utilization 0.2 --tool-call-parser hermes >"$OUT/serve.log" 2>&1 &
pid=$!
python3 - <<'PY'
import json, sys, time, httpx
url = "http://127.0.0.1:8000"
for _ in range(600):
    try:
        if httpx.get(url + "/health", timeout=2).status_code == 200:
            break
    except httpx.TransportError:
        pass
    time.sleep(0.5)
else:
    sys.exit("the server did not start")
schema = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0,
                                                                             "maximum": 99}}}
chat = lambda **b: httpx.post(url + "/v1/chat/completions", timeout=120, json={
    "model": "small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64, "temperature": 1.0, **b})
ok = 0
for seed in range(10):
    r = chat(seed=seed, response_format={"type": "json_schema", "json_schema": {"name": "u", "schema": schema}})
    value = json.loads(r.json()["choices"][0]["message"]["content"], strict=False)
    ok += set(value) == {"name", "age"} and 0 <= value["age"] <= 99
print(f"json_schema: {ok}/10 valid")
tools = [{"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {
    "n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"], "additionalProperties": False}}}]
r = chat(seed=1, tools=tools, tool_choice="required").json()["choices"][0]
print("tool_choice required:", r["finish_reason"], r["message"].get("tool_calls"))
r = httpx.post(url + "/v1/completions", timeout=120, json={"model": "small", "prompt": "x", "max_tokens": 8, "n": 4,
               "temperature": 1.0, "structured_outputs": {"choice": ["red", "green"]}}).json()
print("choice, n=4:", [c["text"] for c in r["choices"]])
r = httpx.post(url + "/v1/completions", timeout=120, json={"model": "small", "prompt": "x", "max_tokens": 8})
print("plain:", r.status_code, r.json()["choices"][0]["finish_reason"])

import asyncio
KINDS = {"no grammar": {}, "a regex grammar": {"structured_outputs": {"regex": "[a-z ]{256}"}},
         "penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.3, "logit_bias": {"7": -5}}}
async def load(extra: dict, clients: int = 16, tokens: int = 64) -> float:
    """Output tok/s of `clients` concurrent chats of `tokens` tokens (ignore_eos), with `extra` in each body."""
    async with httpx.AsyncClient(timeout=300) as client:
        began = time.perf_counter()
        replies = await asyncio.gather(*(client.post(url + "/v1/chat/completions", json={
            "model": "small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens,
            "temperature": 1.0, "seed": i, "ignore_eos": True, **extra}) for i in range(clients)))
        done = sum(r.json()["usage"]["completion_tokens"] for r in replies)
    return done / (time.perf_counter() - began)
for kind, extra in KINDS.items():
    print(f"16 concurrent chats, {kind}: {asyncio.run(load(extra)):.0f} output tok/s")
PY
kill $pid; wait $pid
grep -c Traceback "$OUT/serve.log"
