"""`pagedserve chat`: a terminal chat that streams the assistant's answer as it is generated."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

import aiohttp

from gateway.clients.sse_reader import sse_events


async def stream_reply(session: aiohttp.ClientSession, url: str, payload: dict[str, Any],
                       headers: dict[str, str], out: Any = sys.stdout) -> str:
    """POST a streaming chat request, print deltas as they come, return the full reply."""
    parts: list[str] = []
    async with session.post(url, json=payload, headers=headers) as resp:
        if resp.status != 200:
            body = await resp.json(content_type=None)
            raise RuntimeError(body.get("error", {}).get("message", f"HTTP {resp.status}"))
        async for obj in sse_events(resp):
            if "error" in obj:
                raise RuntimeError(obj["error"]["message"])
            for choice in obj.get("choices", []):
                text = choice["delta"].get("content") or ""
                parts.append(text)
                out.write(text)
                out.flush()
    out.write("\n")
    return "".join(parts)


async def _loop(args: argparse.Namespace) -> int:
    url = args.url.rstrip("/") + "/v1/chat/completions"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    messages: list[dict[str, str]] = [{"role": "system", "content": args.system}] if args.system else []
    async with aiohttp.ClientSession() as session:
        model = args.model or await _first_model(session, args.url, headers)
        print(f"chatting with {model} (empty line or Ctrl-D to quit, /reset to forget)", file=sys.stderr)
        while True:
            try:
                line = await asyncio.to_thread(input, "you> ")
            except EOFError:
                return 0
            if not line.strip():
                return 0
            if line.strip() == "/reset":
                del messages[int(bool(args.system)):]
                continue
            messages.append({"role": "user", "content": line})
            payload = {"model": model, "messages": messages, "stream": True, "max_tokens": args.max_tokens,
                       "temperature": args.temperature}
            sys.stdout.write("assistant> ")
            try:
                reply = await stream_reply(session, url, payload, headers)
            except (RuntimeError, aiohttp.ClientError) as exc:
                print(f"\nerror: {exc}", file=sys.stderr)
                messages.pop()
                continue
            messages.append({"role": "assistant", "content": reply})


async def _first_model(session: aiohttp.ClientSession, base: str, headers: dict[str, str]) -> str:
    async with session.get(base.rstrip("/") + "/v1/models", headers=headers) as resp:
        data = (await resp.json(content_type=None)).get("data", [])
    if not data:
        raise SystemExit("the gateway serves no model yet (no live engine)")
    return str(data[0]["id"])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="gateway base URL")
    parser.add_argument("--model", default=None, help="model name (default: the first the gateway lists)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--system", default=None, help="system prompt")
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--temperature", type=float, default=0.7)


def run(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(_loop(args))
    except KeyboardInterrupt:
        return 130
