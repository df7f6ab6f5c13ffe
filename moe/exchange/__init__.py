"""How the rows of an expert-parallel MoE layer reach the ranks of their experts and come back.

- moe.exchange.exact: exactly the rows each rank needs, split sizes on the host (one sync per
  layer and micro-batch), the all-to-alls overlapped with the rank's rows for its own experts;
- moe.exchange.fixed_blocks: blocks of a fixed size between every two ranks
  (`--moe-expert-parallel-buffer-factor`): no host sync, fixed shapes that torch.compile traces
  whole, optionally cut in chunks whose all-to-alls run under the other chunks' experts
  (`--moe-expert-parallel-chunked-overlap`);
- moe.exchange.capacity_slots: the capacity-limited MoE's slots, balanced by construction;
- moe.exchange.primitives: the all-to-alls and the count exchange they are made of.
"""
