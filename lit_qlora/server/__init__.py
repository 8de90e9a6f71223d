"""The OpenAI-compatible server: one base, several adapters chosen per request (`serve`: the engine,
`serve_http`: FastAPI routes and server-sent events)."""
