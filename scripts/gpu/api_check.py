"""The client half of scripts/gpu/api_check.sh: each check a property of the GPU server's answers, a table last."""

import asyncio
import json
import sys
import time

import httpx

URL = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000"
MESSAGES = [{"role": "user", "content": "What is the weather?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def post(path: str, **body) -> dict:
    reply = httpx.post(URL + path, json={"model": "small", **body}, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def stream(path: str, **body) -> list[dict]:
    with httpx.stream("POST", URL + path, json={"model": "small", "stream": True, **body}, timeout=120) as reply:
        lines = [line[6:] for line in reply.iter_lines() if line.startswith("data: ")]
    return [json.loads(line) for line in lines if line != "[DONE]"]


def complete(**body) -> dict:
    base = dict(prompt="The weather today", max_tokens=16, temperature=0, ignore_eos=True, return_token_ids=True)
    return post("/v1/completions", **(base | body))["choices"][0]


def allowed_ids() -> str:
    allowed = [40, 41, 97, 120]
    drawn = [t for seed in range(4)
             for t in complete(temperature=1.0, seed=seed, allowed_token_ids=allowed)["token_ids"]]
    free = complete(max_tokens=1, logprobs=0)
    listed = complete(max_tokens=1, logprobs=0, allowed_token_ids=free["token_ids"])
    gap = abs(free["logprobs"]["token_logprobs"][0] - listed["logprobs"]["token_logprobs"][0])
    assert set(drawn) <= set(allowed) and len(drawn) == 64 and gap < 0.05, (drawn, gap)
    return f"64 draws within the list; raw logprob gap {gap:.4f}"


def mixed_batch() -> str:
    """Rows with allowed_token_ids (drawn on the host) beside plain greedy rows in the same steps."""
    solo = complete()["token_ids"]

    async def run() -> list[dict]:
        async with httpx.AsyncClient(timeout=120) as client:
            bodies = [{"allowed_token_ids": [40, 41, 97, 120], "temperature": 1.0, "seed": i} if i % 2 else {}
                      for i in range(8)]
            replies = await asyncio.gather(*(client.post(URL + "/v1/completions", json={
                "model": "small", "prompt": "The weather today", "max_tokens": 16, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True, **b}) for b in bodies))
            return [r.json()["choices"][0] for r in replies]
    plain = [c["token_ids"] for i, c in enumerate(asyncio.run(run())) if i % 2 == 0]
    assert all(ids == solo for ids in plain), (solo, plain)
    return "4 plain rows equal to the solo greedy run"


def stop_strings() -> str:
    text = complete()["text"]
    stop = text[4:6]
    kept = complete(stop=[stop], include_stop_str_in_output=True)
    assert kept["text"] == text[:text.find(stop) + len(stop)] and kept["stop_reason"] == stop, (text, kept)
    chunks = stream("/v1/completions", prompt="The weather today", max_tokens=16, temperature=0, ignore_eos=True,
                    return_token_ids=True)
    ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    assert ids == complete()["token_ids"]
    return "stop string kept, named; streamed token ids equal"


def responses() -> str:
    """A stream's text deltas build its final response's text (whole and streamed runs of a random model may part
    at a near tie: the prefix cache changes the prompt's float sums)."""
    body = dict(input="Tell me a story", max_output_tokens=16, temperature=0, reasoning={"effort": "none"})
    whole = post("/v1/responses", **body)
    events = stream("/v1/responses", **body)
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed" and whole["status"] == final["status"] == "incomplete"
    assert text == final["output"][0]["content"][0]["text"], (text, final["output"])
    return f"{len(events)} events build the final response"


def messages() -> str:
    """A required call, whole and streamed: its input an object within the schema (two runs of a random model may
    part at a near tie, so each is checked on its own)."""
    tool = {"name": "get_weather", "input_schema": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "maxLength": 12}}, "additionalProperties": False}}
    body = dict(messages=MESSAGES, max_tokens=80, temperature=1.0, seed=3, tools=[tool],
                tool_choice={"type": "any", "disable_parallel_tool_use": True}, thinking={"type": "disabled"})
    whole = post("/v1/messages", **body)
    uses = [b["input"] for b in whole["content"] if b["type"] == "tool_use"]
    events = stream("/v1/messages", **body)
    streamed = json.loads("".join(e["delta"].get("partial_json", "") for e in events
                                  if e["type"] == "content_block_delta"))
    for value in (*uses, streamed):
        assert set(value) == {"city"} and isinstance(value["city"], str) and len(value["city"]) <= 12, whole
    assert len(uses) == 1 and whole["stop_reason"] == "tool_use", whole
    return f"tool_use {uses[0]}; streamed {streamed}"


def main() -> None:
    for _ in range(600):
        try:
            if httpx.get(URL + "/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    else:
        sys.exit("the server did not start")
    rows = []
    for check in (allowed_ids, mixed_batch, stop_strings, responses, messages):
        try:
            rows.append((check.__name__, "ok", check()))
        except Exception as error:  # noqa: BLE001  every check reported, the first failure not hiding the rest
            rows.append((check.__name__, "FAIL", f"{type(error).__name__}: {error}"[:300]))
    print(f"{'check':<14}{'':6}detail")
    for name, status, detail in rows:
        print(f"{name:<14}{status:<6}{detail}")


if __name__ == "__main__":
    main()
