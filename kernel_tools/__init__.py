"""Tools around the kernels that are not kernels: ``kernel_tools.aot`` compiles every Triton kernel
configuration the engine launches ahead of time, without a GPU (used by tests/test_kernels_compile.py,
tests/test_kernels_pipeline.py and benchmarks/kernel_report.py). Nothing in the serving path imports it;
it may import the engine's modules (the model's paged-attention kernels), which punica_kernels never does.
"""
