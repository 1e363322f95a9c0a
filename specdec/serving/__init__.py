"""specdec serve: the OpenAI-compatible server, a queue around the engine."""
