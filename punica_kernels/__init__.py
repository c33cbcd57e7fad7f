"""Batched LoRA math for one LoRA-aware layer over a flat batch where each token has its own slot.

```
meta = LoRAMeta(max_num_tokens, max_loras, device)
load_table(meta, token_slots, slot_ranks=None)  # once per step; token_slots [T], -1 = no adapter
add_lora(y, x, lora_a, lora_b, meta, slice_sizes, slice_scales=None, column_scales=None, bias=None,
         backend="auto")
# y[t, off_j:off_j+N_j] += (x[t] @ lora_a[s, j].T) @ lora_b[s, off_j:off_j+N_j].T, s = token_slots[t] >= 0
# slice_scales [max_loras, n]: LoRA scaling on the fp32 intermediate; column_scales [max_loras, N]:
# DoRA's per-row scale of base output and delta (bias unscaled); see punica_kernels.scales
```
The table is built on the host (punica_kernels.host_tiles.HostTileTable); ``load_table`` / ``TableLoader``
upload it and point the meta at it, while the engine's batch builder sends it in the step's one staged
upload (``LoRAMeta.use_table``). ``lora_shrink`` / ``lora_expand`` are the two halves;
``embedding_shrink`` is the gather shrink of an embedding LoRA (punica_kernels.embedding), expanded by
``lora_expand``. Backends: Triton SGMV kernels (CUDA, or
the interpreter on CPU tensors) and a vectorized torch path (CPU serving path and oracle);
``triton_available()`` says whether the Triton one imported.

Quantized base layers: ``w4a16_matmul`` (punica_kernels.w4a16: a 4-bit weight in the Int4Weight layout,
dequantized inside a Triton GEMM on CUDA, a torch path elsewhere) and ``fp8_linear`` (punica_kernels.fp8:
float8_e4m3fn weights with per-channel scales, torch._scaled_mm on sm_89+, dequantize-and-matmul elsewhere).
"""

from .embedding import embedding_shrink
from .fp8 import fp8_linear
from .host_tiles import HostTileTable, TableLoader, load_table
from .meta import LoRAMeta, TileTable
from .ops import (BACKENDS, BackendUnavailableError, add_lora, lora_expand, lora_shrink,
                  triton_available, triton_import_error)
from .w4a16 import w4a16_matmul

__all__ = ["LoRAMeta", "TileTable", "HostTileTable", "TableLoader", "load_table", "add_lora", "lora_shrink",
           "lora_expand", "embedding_shrink", "BackendUnavailableError", "BACKENDS", "triton_available",
           "triton_import_error", "w4a16_matmul", "fp8_linear"]
