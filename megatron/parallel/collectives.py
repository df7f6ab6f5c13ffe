"""The one-tensor collectives under the names the running torch gives them.

torch 2.13 names them `reduce_scatter_single` and `all_gather_single` and deprecates the older
`reduce_scatter_tensor` and `all_gather_into_tensor`, which are all that torch 2.4-2.12 have.
Gloo runs these one-tensor forms on every supported torch (its list-form reduce_scatter only
from torch 2.8).
"""

from __future__ import annotations

import torch.distributed as dist

reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
