"""OpenAI-compatible HTTP gateway stage."""
