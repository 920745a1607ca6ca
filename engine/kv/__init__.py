"""The paged KV block manager: a pool of fixed-size device blocks (and host blocks for swap),
per-sequence block tables, on-demand allocation, copy-on-write sharing, swap, prefix caching,
and the pool's figures and invariants.

Pure bookkeeping on integer ids: imports only the standard library and `common.log`; never
torch (the runner does the tensor work the manager asks for)."""
