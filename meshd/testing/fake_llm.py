"""A small OpenAI-compatible engine of our own, for unit tests of the LLM runtime's process
handling (start-up failures, crash loops) where a real engine cannot be made to misbehave
on cue. Never the only test of a feature: tests/llm runs real llama.cpp engines.

    python -m meshd.testing.fake_llm --port P --name NAME [--exit-at-start CODE] [--die-after S]

It answers /v1/models, and /v1/completions with the prompt's words echoed back (`"repeat": N`
times; streamed as Server-Sent Events with `"stream": true`, `--token-interval-ms` apart, each
stamped with the time it was sent, for bench/llm.py's relay delay). A word is a token: the
answer says how many in its `usage`, as does a stream's last event when asked
(`"stream_options": {"include_usage": true}`, as vLLM does).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time

from aiohttp import web


def app(name: str, interval_s: float = 0.0) -> web.Application:
    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": name, "object": "model"}]})

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        words = str(body.get("prompt", "")).split()
        pieces = words * max(1, int(body.get("repeat", 1)))
        usage = {"prompt_tokens": len(words), "completion_tokens": len(pieces)}
        if not body.get("stream"):
            choice = {"text": " ".join(pieces), "index": 0, "finish_reason": "stop"}
            answer = {"object": "text_completion", "model": body.get("model"), "choices": [choice], "usage": usage}
            return web.json_response(answer)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i, word in enumerate(pieces):
            if interval_s and i:
                await asyncio.sleep(interval_s)
            done = "stop" if i == len(pieces) - 1 else None
            chunk: dict[str, object] = {"object": "text_completion", "sent_ns": time.time_ns()}
            chunk["choices"] = [
                {"text": word, "index": 0, "finish_reason": done}
            ]  # when it left the engine: bench/llm.py's relay delay
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        options = body.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage"):  # as vLLM: one last event
            last = {"object": "text_completion", "choices": [], "usage": usage}
            await response.write(f"data: {json.dumps(last)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response

    application = web.Application()
    application.router.add_get("/v1/models", models)
    application.router.add_post("/v1/completions", completions)
    return application


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--name", default="fake")
    p.add_argument("--exit-at-start", type=int, help="print a line and exit with this status at once")
    p.add_argument("--die-after", type=float, help="exit (status 1) this many seconds after start")
    p.add_argument("--token-interval-ms", type=float, default=0.0, help="between streamed pieces")
    a = p.parse_args()
    if a.exit_at_start is not None:
        print("fake engine: told to fail at start", flush=True)
        sys.exit(a.exit_at_start)
    if a.die_after is not None:
        threading.Timer(a.die_after, os._exit, args=(1,)).start()
    web.run_app(app(a.name, a.token_interval_ms / 1000), host="127.0.0.1", port=a.port, print=None)


if __name__ == "__main__":
    main()
