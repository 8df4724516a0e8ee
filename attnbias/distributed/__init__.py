"""Sequences split across the processes of a ``torch.distributed`` group (context parallelism).

Each of the group's ``W`` ranks holds a part of the sequence dimension, as a :class:`Layout`
says: ``"contiguous"`` (rank ``r`` holds chunk ``r`` of ``W``), ``"zigzag"`` (chunks ``r`` and
``2W - 1 - r`` of ``2W``: balanced under causal masks) or ``"auto"`` (chunks assigned by their
cost under a bias, :func:`layout_for`).

:func:`shard` takes this rank's part of a tensor every rank holds whole; :func:`unshard` gathers
the parts back into the whole tensor on every rank. Both are differentiable. :func:`sdpa` is
attention over the whole sequence with each rank holding its part of the queries, keys and
values: in the sequence mode the ranks exchange only the key/value blocks that hold kept pairs,
in the head mode an all-to-all gives each rank whole sequences for ``H / W`` heads;
:func:`explain` says which and why.

Example, on every rank of an initialised group::

    x = torch.randn(2, 8, 4096, 64)                 # the same tensor on every rank
    part = attnbias.distributed.shard(x)            # (2, 8, 4096 // W, 64)
    assert torch.equal(attnbias.distributed.unshard(part), x)

    q, k, v = (attnbias.distributed.shard(t) for t in (q_all, k_all, v_all))
    out = attnbias.distributed.sdpa(q, k, v, attn_mask=causal_lower_right())  # this rank's rows
"""

from .attention import MODES, explain, sdpa
from .layouts import LAYOUTS, Layout
from .sharding import layout_for, positions, shard, unshard

__all__ = [
    "LAYOUTS",
    "MODES",
    "Layout",
    "explain",
    "layout_for",
    "positions",
    "sdpa",
    "shard",
    "unshard",
]
