"""The engine worker: an asyncio process that consumes the Redis request stream, runs the
`LLMEngine` on its own thread, publishes tokens and checkpoints, heartbeats, claims dead
engines' requests, and serves Prometheus metrics; plus `pagedserve engine`.

May import redis, `common.protocol`, `engine.config` and the engine's public API
(`engine.llm_engine`, imported on the engine thread). Importing this package does not import
torch; constructing the engine does."""
