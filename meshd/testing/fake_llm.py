"""A small OpenAI-compatible engine of our own, for unit tests of the LLM runtime's process
handling (start-up failures, crash loops) where a real engine cannot be made to misbehave
on cue. Never the only test of a feature: tests/llm runs real llama.cpp engines.

    python -m meshd.testing.fake_llm --port P --name NAME [--exit-at-start CODE] [--die-after S]

It answers /v1/models, and /v1/completions with the prompt's words echoed back (streamed as
Server-Sent Events with `"stream": true`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading

from aiohttp import web


def app(name: str) -> web.Application:
    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": name, "object": "model"}]})

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        words = str(body.get("prompt", "")).split()
        if not body.get("stream"):
            choice = {"text": " ".join(words), "index": 0, "finish_reason": "stop"}
            return web.json_response({"object": "text_completion", "model": body.get("model"), "choices": [choice]})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i, word in enumerate(words):
            done = "stop" if i == len(words) - 1 else None
            chunk = {"object": "text_completion", "choices": [{"text": word, "index": 0, "finish_reason": done}]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
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
    a = p.parse_args()
    if a.exit_at_start is not None:
        print("fake engine: told to fail at start", flush=True)
        sys.exit(a.exit_at_start)
    if a.die_after is not None:
        threading.Timer(a.die_after, os._exit, args=(1,)).start()
    web.run_app(app(a.name), host="127.0.0.1", port=a.port, print=None)


if __name__ == "__main__":
    main()
