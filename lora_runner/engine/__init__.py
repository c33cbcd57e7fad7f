"""The engine layer: requests in, RequestOutputs out.

``llm_engine`` wires the layers and runs the step loop; ``async_llm_engine`` steps it from a
background thread for asyncio callers; ``adapters`` is its seam to the adapter manager;
``output_processor`` / ``detokenizer`` / ``parallel_sampling`` turn sampled tokens into outputs;
``tokenizer`` and ``chat`` turn prompts into token ids.
"""
