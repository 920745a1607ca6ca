"""The OpenAI-compatible HTTP API: routes, request validation, response and SSE chunk
shapes, and the per-request generation driver.

May import aiohttp, `gateway.broker`, `gateway.text` and the torch-free engine modules
(`engine.protocol`, `engine.sampling_params`, `engine.log`)."""
