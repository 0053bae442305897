"""Models: the Hugging Face config as the engine needs it, loading weights (a folder, a GGUF
file, the bundled model, random weights for benchmarks) and the Llama-family forward pass."""
