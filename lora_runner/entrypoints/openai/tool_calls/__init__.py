"""Tool calls on chat completions: OpenAI's ``tools`` / ``tool_choice``, checked (definitions), turned
into a plan per request (choice: what the template sees, which constraint the output gets, how the
output is read) and read back out of the model's text (hermes_parser for ``auto``, or with
--tool-call-parser whole_call_parsers (llama3_json, pythonic), mistral_parser, qwen3_xml_parser
(qwen3_xml, qwen3_coder); forced_parsers for ``required`` and a named function), one call delta at a
time (deltas)."""
