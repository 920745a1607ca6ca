"""The OpenAI-compatible HTTP API: routes, request validation, response and SSE chunk
shapes, and the per-request generation driver.

May import aiohttp, llguidance (to check output constraints; never to build token masks),
`gateway.broker`, `gateway.text` and the torch-free engine modules (`common.protocol`,
`common.sampling_params`, `common.log`)."""
