"""Serving a trained agent to other programs: the OpenAI-compatible API."""
