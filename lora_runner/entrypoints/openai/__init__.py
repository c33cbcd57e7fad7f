"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) over AsyncLLMEngine: one module per concept."""
