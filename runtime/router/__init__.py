"""`kvfleet router`: an OpenAI-compatible front that spreads requests over runtime replicas by
prompt prefix (so each prefix meets the cache that holds it) and by load. Torch-free: it never
imports the engine, the models or the kernels (tests/test_layout.py)."""
