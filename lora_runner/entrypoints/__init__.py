"""HTTP entry points: an OpenAI-compatible server (FastAPI + uvicorn) over AsyncLLMEngine.

One module per concept: protocol (request bodies), tenants (keys), registry (served adapters),
adapter_root (runtime-load confinement), body_limit, metrics, state (settings and shared state),
sampling (body -> SamplingParams), prompts, generation (running a request), formatting (response
bodies), completions, admin (load/unload), app (routes), shutdown (SIGTERM drain), cli
(``lora-runner serve``), background (uvicorn in a thread for tests and benchmarks).
"""
