"""Text on the gateway: the torch-free tokenizer and chat template, incremental
detokenization that never emits half a UTF-8 character, and stop-string matching.

Imports only `tokenizers` and jinja2."""
