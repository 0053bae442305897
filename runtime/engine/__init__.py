"""The engine: requests, the scheduler, the KV cache manager, the model runner, the sampler, the
engine loop (`LLMEngine`, and `AsyncEngine` for the server) and the offline `LLM`.

Never imports `kvfleet.runtime.server` or `kvfleet.runtime.bench`. Kept free of imports so that
importing one module here does not load the others (or torch).
"""
