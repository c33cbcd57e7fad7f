"""The 4-bit in-memory layout (lora_runner.model.quant.int4_layout) against a float64 reference
written from its docstring: lowest nibble first, zero point 8 when symmetric, g_idx groups."""

import pytest
import torch

from lora_runner.model.quant.int4_layout import Int4Weight, pack_int4


def _reference(values, scales, zeros, groups):
    z = zeros.double()[:, groups] if zeros is not None else 8.0
    return (values.double() - z) * scales.double()[:, groups]


@pytest.mark.parametrize("zero_points", [False, True])
@pytest.mark.parametrize("act_order", [False, True])
def test_dequantize_matches_the_documented_layout(zero_points, act_order):
    g = torch.Generator().manual_seed(0)
    n, k, group = 12, 128, 32
    values = torch.randint(0, 16, (n, k), generator=g)
    scales = torch.rand(n, k // group, generator=g) + 0.1
    zeros = torch.randint(0, 16, (n, k // group), generator=g).to(torch.uint8) if zero_points else None
    g_idx = (torch.randperm(k, generator=g) // group).int() if act_order else None
    weight = Int4Weight(pack_int4(values), scales, zeros, g_idx, group)
    weight.check()
    assert int(weight.qweight[0, 0]) & 0xF == int(values[0, 0])  # column 0 in the lowest nibble
    groups = g_idx.long() if act_order else torch.arange(k) // group
    torch.testing.assert_close(weight.dequantize(torch.float64), _reference(values, scales, zeros, groups))


def test_concat_packs_slices_along_rows_and_refuses_different_layouts():
    g = torch.Generator().manual_seed(1)
    parts = [Int4Weight(pack_int4(torch.randint(0, 16, (n, 64), generator=g)), torch.rand(n, 2, generator=g),
                        None, None, 32) for n in (8, 4, 4)]
    packed = Int4Weight.concat(parts)
    torch.testing.assert_close(packed.dequantize(torch.float64),
                               torch.cat([p.dequantize(torch.float64) for p in parts]))
    other = Int4Weight(parts[1].qweight, torch.rand(4, 4, generator=g), None, None, 16)
    with pytest.raises(ValueError, match="group_size"):
        Int4Weight.concat([parts[0], other])
    with pytest.raises(ValueError, match="divide"):
        Int4Weight(parts[0].qweight, parts[0].scales, None, None, 48).check()
