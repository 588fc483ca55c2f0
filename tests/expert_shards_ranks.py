"""Run on two gloo ranks by tests/test_torchrun_experts.py: a Mixtral layer's experts sharded over them, against the whole.

Rank 0 routes its tokens to every expert, rank 1 only to rank 0's (0 and 1): rank 1 sends its own
experts nothing. Each rank checks its tokens' outputs and gradients, and the experts' gathered
gradients, against the unsplit experts computing both ranks' tokens; prints ``rank R ok``.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh

from pipexplore.export import expert_parts


def main() -> None:
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    config = transformers.MixtralConfig(num_local_experts=4, hidden_size=8, intermediate_size=6)
    whole = transformers.models.mixtral.modeling_mixtral.MixtralExperts(config)
    torch.nn.init.normal_(whole.gate_up_proj, std=0.3)
    torch.nn.init.normal_(whole.down_proj, std=0.3)
    x, weights = torch.randn(2, 5, 8), torch.rand(2, 5, 2)
    index = torch.tensor([[[0, 3], [1, 0], [3, 2], [2, 1], [0, 2]], [[1, 0], [0, 1], [1, 0], [0, 1], [1, 0]]])
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    shard = expert_parts.ExpertShard(whole, mesh)
    mine = [t[rank].clone().requires_grad_(t.is_floating_point()) for t in (x, index, weights)]
    out = shard(*mine)
    out.pow(2).sum().backward()
    both = [t.flatten(0, 1).clone().requires_grad_(t.is_floating_point()) for t in (x, index, weights)]
    expected = whole(*both)
    expected.pow(2).sum().backward()
    rows, close = slice(5 * rank, 5 * rank + 5), dict(rtol=1e-5, atol=1e-5)  # (summed in another order)
    torch.testing.assert_close(out, expected[rows], **close)
    torch.testing.assert_close(mine[0].grad, both[0].grad[rows], **close)
    torch.testing.assert_close(mine[2].grad, both[2].grad[rows], **close)
    for name in ("gate_up_proj", "down_proj"):
        torch.testing.assert_close(getattr(shard, name).grad.full_tensor(), getattr(whole, name).grad, **close)
    holder = torch.nn.Module()
    holder.experts = whole
    assert expert_parts.shard_experts(holder, mesh) == 1 and isinstance(holder.experts, expert_parts.ExpertShard)
    print("rank", rank, "ok")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
