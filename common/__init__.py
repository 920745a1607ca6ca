"""What the gateway and the engine share, and nothing else: the contract between their processes
and the service plumbing both run on.

- `protocol`: the wire messages (msgpack) and every Redis key name;
- `sampling_params`: `SamplingParams`, the one parameter type (gateway → wire → engine);
- `redis_conn`: the Redis connection factory, metered pool, epoch;
- `pubsub`: the shared pub/sub listener; `shutdown`: the bounded service shutdown;
- `log`: structured logging; `sizes`: byte sizes for flags.

Imports neither `gateway` nor `engine`, and never torch (tests/test_import_boundaries.py)."""
