"""OpenAI-compatible HTTP server: `voltllm serve`."""
