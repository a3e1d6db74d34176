"""The OpenAI-compatible HTTP server (`pegainfer serve`) and its load generator (`pegainfer bench serve`)."""
