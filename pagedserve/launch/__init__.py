"""`pagedserve up`: an embedded redis-server, one engine and one gateway as child processes
on this machine.

Torch-free: it starts processes and waits for them; it imports neither the engine's
internals nor the gateway's."""
