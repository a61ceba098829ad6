"""OpenAI-compatible HTTP server: `ostinato serve`."""
