"""OpenAI tool calling, free of I/O: the request's `tools` validated, the schema that forces a
call, the parsers of each model family's native call format (whole and streamed), and the
history's tool messages made ready for a chat template."""
