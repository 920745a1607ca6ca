"""Clients of a running gateway: `pagedserve bench` (serving benchmark), `pagedserve chat`
(terminal chat) and the SSE reader they share. Torch-free."""
