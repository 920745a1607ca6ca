"""The two browser pages (chat at `/`, the live KV cache at `/kv`), their static files, and
`GET /v1/engines/stream`, the SSE relay of engine heartbeats that feeds `/kv`."""
