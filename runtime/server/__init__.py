"""The OpenAI-compatible HTTP server: the aiohttp app, the wire format, Prometheus metrics and
the `kvfleet serve` command. Kept free of imports (the CLI imports the command lazily)."""
