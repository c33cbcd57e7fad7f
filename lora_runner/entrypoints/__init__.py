"""How users reach the engine: ``llm`` (the offline ``LLM`` API), ``cli`` (``lora-runner serve``; its options:
``serve_args``, parsed before anything heavy loads),
``launch`` (configs -> a running server's state), ``openai/`` (the OpenAI-compatible HTTP server)
and ``ray/`` (its replicas on Ray Serve)."""
