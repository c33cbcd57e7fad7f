"""Quantized base weights: the checkpoint formats that are read (compressed-tensors, GPTQ, AWQ, online
FP8), the layouts the weights keep in device memory, and the linear methods that multiply by them."""
