"""The OpenAI-compatible HTTP server (`kestrel serve`): see api_server.py."""
