"""Starlette ASGI server: OpenAI, Responses and Anthropic APIs."""
