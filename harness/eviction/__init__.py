"""The eviction core, free of vLLM: what the patched engine's worker and the Hugging Face reference
both run. Settings and the per-step messages (``settings``, ``messages``), a paged KV cache seen as
token slots (``kv_view``), per-request policy state between evictions (``state``), and one eviction
carried out on one request's blocks (``evictor``). A vLLM upgrade does not touch this package;
``harness.engine`` holds everything that knows vLLM's internals."""
