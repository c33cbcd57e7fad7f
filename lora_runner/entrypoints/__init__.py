"""How users reach the engine: ``llm`` (the offline ``LLM`` API), ``cli`` (``lora-runner serve``),
``launch`` (configs -> a running server's state), ``openai/`` (the OpenAI-compatible HTTP server)
and ``ray/`` (its replicas on Ray Serve)."""
