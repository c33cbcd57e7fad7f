"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) over an EngineClient (lora_runner.engine.protocol,
implemented by AsyncLLMEngine): one module per concept."""
