"""Speculative decoding: draft tokens proposed per request (ngram: prompt lookup in its own tokens, no
second model; draft_model: the greedy tokens of a smaller model with the same tokenizer, run over its own
paged KV cache without adapters, or with the request's own draft adapter: draft_adapters), scheduled
after its last token (Scheduler, SchedulerOutput.scheduled_spec_decode_tokens), computed in one forward
pass with the request's own adapters and verified so that every request keeps its tokens (greedy) or its
output distribution (sampled): rejection_sampler. Every request may speculate: penalties, min_tokens and
bad words are applied per verified position, and grammars get one mask per position with drafts cut
where the grammar rejects them (grammar_masks); adaptive decides who proposes (acceptance and batch
size). The k-tokens-per-row path (InputBatch.commit, Scheduler.postprocess, OutputProcessor.append)
takes the verified tokens and rolls the rejected drafts' KV back."""
