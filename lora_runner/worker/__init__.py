"""The device side of a step: the model runner, its persistent request rows, the flat batch, the
host->device upload, the forward context, decode CUDA graphs, the paged KV cache and its sizing."""
