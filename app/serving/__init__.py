"""Serving the OpenAI-compatible API: wire models, prompts and tools, and engine chunks into streams and responses."""
