"""pagedserve gateway: the OpenAI-compatible HTTP front end. Never imports torch."""
