"""The gateway's side of Redis: submitting requests to the stream, the single pub/sub
listener that demultiplexes engine output into per-request collectors, aborts, and the
registry of live engines read from their heartbeats.

May import redis and `common.protocol`; never aiohttp or torch."""
