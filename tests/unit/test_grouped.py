"""Grouped GEMM with the routing on the device (moe_workers.model.grouped): the same layer output
as the per-expert loop in every family, and where the CPU takes it."""

from __future__ import annotations

import pytest
import torch

from checkpoints import make_family
from moe_workers.model import grouped, native
from moe_workers.model.checkpoint import Checkpoint
from moe_workers.model.dense import DenseModel
from moe_workers.model.experts import GROUPED_CPU_ROWS, LocalExperts
from moe_workers.model.family import SUPPORTED
from moe_workers.model.layers import combine, group_by_expert


@pytest.mark.parametrize("family", SUPPORTED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_give_the_loops_layer(tmp_path, family, dtype):
    make_family(tmp_path, family)
    ckpt = Checkpoint(tmp_path)
    cfg = ckpt.config
    experts = LocalExperts(ckpt, dtype)
    layer = cfg.sparse_layers[0]
    x = torch.randn(40, cfg.hidden_size, generator=torch.Generator().manual_seed(1)).to(dtype)
    indices, weights = DenseModel(cfg.with_dtype(dtype), ckpt.dense_state()).pick(layer, x)
    with torch.inference_mode():
        ours = grouped.moe(experts.cfg, x, indices, weights, experts.stacked[layer])
        groups = group_by_expert(indices)
        outs = {e: experts._compute(layer, [e], [rows.numel()], x[rows]) for e, (rows, _) in groups.items()}
        loop = combine(x.shape[0], x.shape[1], dtype, groups, outs, weights)
    # the same products, summed in another order: bf16 within its rounding, fp32 to 1e-6
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(ours, loop, atol=tol * float(loop.abs().max()), rtol=0)


def test_an_expert_missing_from_the_stack_is_routed_by_the_loop(tmp_path):
    """Experts held in part (a shard's share): no stack, so never grouped."""
    make_family(tmp_path, "mixtral")
    ckpt = Checkpoint(tmp_path)
    some = LocalExperts(ckpt, torch.float32, [(0, 0), (0, 1)])
    assert some.stacked == {} and set(some.weights) == {(0, 0), (0, 1)}


@pytest.mark.parametrize("tokens,grouped_", [(4, False), (80, True), (300, False)])
def test_the_cpu_takes_grouped_gemm_between_the_c_kernels_rows_and_large_gemms(tmp_path, tokens, grouped_):
    make_family(tmp_path, "mixtral")  # 8 experts, top-2
    experts = LocalExperts(Checkpoint(tmp_path), torch.float32)
    indices = torch.randint(0, 8, (tokens, 2), generator=torch.Generator().manual_seed(tokens))
    per_expert = tokens * 2 / 8
    assert (GROUPED_CPU_ROWS[0] < per_expert <= GROUPED_CPU_ROWS[1]) == grouped_
    assert GROUPED_CPU_ROWS[0] == native.ROWS_MAX
    assert experts.grouped(0, torch.zeros(tokens, 4), indices) == grouped_
