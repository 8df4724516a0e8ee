"""Attention over a sequence split across the ranks of a group: :func:`sdpa` and
:func:`explain`, which choose between the sequence mode (the selective exchange) and the head
mode (all-to-all) and say why."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from attnbias.biases import AttnBias
from attnbias.functional import _validate
from attnbias.spec import with_causal
from attnbias.terms import Call

from .blocks import Kept, grain, keep_grid
from .exchange import Needs, Schedule, exchange_sdpa, exchanged_runs
from .heads import heads_sdpa
from .layouts import Layout, as_group, world_of
from .model import Choice, StepShape, choose_mode
from .sharding import resolve_layout

__all__ = ["MODES", "explain", "sdpa"]

#: How :func:`sdpa` splits the work: ``"sequence"`` (each rank its queries, key/value blocks
#: exchanged where pairs are kept), ``"heads"`` (all-to-all: each rank the whole sequence for
#: ``H / W`` heads) or ``"auto"`` (the one of least predicted time).
MODES = ("auto", "sequence", "heads")


def sdpa(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: AttnBias | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    group: Any = None,
    layout: str | Layout = "zigzag",
    mode: str = "auto",
) -> Tensor:
    """:func:`attnbias.sdpa` over a sequence split across the ranks of ``group``.

    Every rank passes its part of the queries, keys and values along the sequence (dim 2, as
    :func:`shard` lays them out) and the same ``attn_mask``, a bias over the *whole* sequence
    (any bias: sums and ``ModBias`` included); each gets back its part of the output.

    Two modes (``mode``):

    * ``"sequence"``: each rank attends its own queries. From the bias's keep grid (blocks of
      up to 256 positions) every rank works out which runs of the other ranks' key/value parts
      hold kept pairs for its queries and receives exactly those, straight from their owner,
      one owner per step, each transfer overlapped with the attention of the part in hand;
      partial outputs merge by their log-sum-exp. A window shorter than a part exchanges only
      the window's reach with the neighbours, documents only within documents. No rank holds
      the whole keys and values (memory ``O(S / W)`` plus two parts in flight). Each pair of a
      query chunk and a run of keys is an ordinary call with the bias's block there
      (:meth:`AttnBias.sub_block`), planned among the backends that give the log-sum-exp.
    * ``"heads"``: all-to-all, so that each rank holds the whole sequence for ``Hq / W`` query
      heads (and the key/value heads they read, replicated where ``Hkv < W``), runs the
      single-GPU :func:`attnbias.sdpa` with the bias of its heads
      (:meth:`AttnBias.sub_heads`), and all-to-all back. Needs ``Hq`` divisible by ``W``.
    * ``"auto"`` (default): the mode of least predicted time (the kept blocks' work against
      the bytes each mode moves; :func:`explain` prints both); the sequence mode where the
      head mode cannot run.

    Differentiable in both modes: the backward of the sequence mode sends the same runs again
    (recomputing each pair) and returns their key/value gradients straight to their owners.
    Gradients are of the sum of every rank's loss. A tensor of the bias that requires grad
    (ALiBi slopes, a :class:`TensorBias`, a ``ModBias`` table) gets on each rank the part of
    that gradient from its own queries (sequence mode) or its own heads (head mode): sum it
    over ``group`` (as data parallelism does for every other parameter) to get the whole.

    Args:
        query: ``(B, Hq, L / W, E)``, this rank's part of ``(B, Hq, L, E)``.
        key: ``(B, Hkv, S / W, E)``.
        value: ``(B, Hkv, S / W, Ev)``.
        attn_mask: a bias over the whole ``(L, S)`` (the same on every rank), or ``None``.
        dropout_p: must be 0 (dropout is not supported here).
        is_causal, scale, enable_gqa: as :func:`attnbias.sdpa` (``is_causal`` is upper-left
            over the whole sequence).
        group: the process group (``None``: the default group), or a one-dimensional
            ``DeviceMesh`` (``mesh["cp"]``).
        layout: how the sequence is split: ``"zigzag"``, ``"contiguous"``, ``"auto"`` (the
            layout :func:`layout_for` gives for ``attn_mask``; shard the tensors with the same
            one) or a :class:`Layout`.
        mode: ``"auto"``, ``"sequence"`` or ``"heads"`` (:data:`MODES`).

    Returns:
        ``(B, Hq, L / W, Ev)``: this rank's rows of the whole attention output.

    Raises:
        RuntimeError: no initialised process group.
        TypeError / ValueError: as :func:`attnbias.sdpa` for this rank's tensors; a plain
            tensor ``attn_mask`` (pass a :class:`TensorBias` of the whole ``(L, S)``);
            ``dropout_p > 0``; a length the layout cannot split evenly (naming the length,
            ``W`` and the layout); ``mode="heads"`` where it cannot run (naming why); ranks
            whose parts differ in shape, dtype, layout or flags (naming each rank's).

    Under ``torch.compile`` the call runs eagerly, with a graph break around it: the
    transfers and their schedule, which depends on the bias's values, do not trace
    (``fullgraph=True`` refuses it).
    """
    return _sdpa(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, group, layout,
        mode,
    )  # fmt: skip


@torch.compiler.disable(
    reason="attnbias.distributed.sdpa runs eagerly: its point-to-point transfers and their "
    "schedule, which depends on the bias's values, does not trace"
)
def _sdpa(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Any,
    dropout_p: Any,
    is_causal: Any,
    scale: Any,
    enable_gqa: Any,
    group: Any,
    layout: Any,
    mode: Any,
) -> Tensor:
    group = as_group(group)
    rank, world = world_of(group)
    # A rank that refuses its call still joins the one gather of the call, so that the others
    # learn it and raise too instead of waiting for it.
    try:
        local: _Local | None = _Local.make(
            query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, world,
            layout, mode,
        )  # fmt: skip
        failure: Exception | None = None
    except (TypeError, ValueError) as error:
        local, failure = None, error
    if local is not None and local.choice.mode == "sequence":
        # the sequence mode gathers the headers while it launches its own pairs' attention,
        # and waits for them before any transfer
        schedule = _schedule(local, rank, group)
        return exchange_sdpa(
            query,
            key,
            value,
            schedule,
            local.params,
            lambda: _start_agreeing(local, None, group, world),
        )
    # the head mode posts the gather, packs its parts for the exchange while the headers
    # travel, and waits for them before its first collective
    agreed = _start_agreeing(local, failure, group, world)
    if local is None:
        agreed()  # raises this rank's failure
    assert local is not None
    return heads_sdpa(
        query, key, value, local.bias, scale=local.scale, enable_gqa=local.enable_gqa,
        group=group, layout=local.layout, before_exchange=agreed,
    )  # fmt: skip


def _start_agreeing(
    local: _Local | None, failure: Exception | None, group: Any, world: int
) -> Callable[[], None]:
    """The call's one gather of every rank's header, in two halves: the gather is posted now
    (the host can launch work meanwhile), and the function returned waits for it and raises
    this rank's ``failure``, or ``ValueError`` where another rank refused its call or the
    ranks' calls differ. Every rank of the group calls it once per call and waits before the
    call's first collective or transfer."""
    headers_group = _headers_group(group)
    summary = _summary(local, _gather_device(headers_group))
    gathered = [torch.empty_like(summary) for _ in range(world)]
    work = dist.all_gather(gathered, summary, group=headers_group, async_op=True)

    def finish() -> None:
        work.wait()
        rows = [g.tolist() for g in gathered]
        if failure is not None:
            raise failure
        refused = [r for r, row in enumerate(rows) if row[0]]
        if refused:
            raise ValueError(
                f"attnbias.distributed.sdpa: rank(s) {refused} of the group refused their part "
                f"of the call (their error says why); every rank must make the same call"
            )
        _check_agreement([row[1:] for row in rows])

    return finish


_SCHEDULES: Kept[Schedule] = Kept(32)


def _schedule(local: _Local, rank: int, group: Any) -> Schedule:
    """The exchange's schedule of this rank's call, kept for the identical calls after it
    where the bias has a plan-cache key (its blocks then stay what they are)."""
    identity = None if local.bias is None else local.bias.cache_key()
    key = (identity, local.call, local.layout, rank, id(group), local.scale, local.enable_gqa,
           local.needs_grad)  # fmt: skip
    cacheable = local.bias is None or identity is not None
    found = _SCHEDULES.get(key) if cacheable else None
    if found is not None and found.group is group:
        return found
    schedule = Schedule.make(
        local.bias, local.call, local.layout, rank, group, scale=local.scale,
        enable_gqa=local.enable_gqa, needs_grad=local.needs_grad, grid=local.grid,
        needs=local.needs,
    )  # fmt: skip
    return _SCHEDULES.put(key, schedule) if cacheable else schedule


@dataclass(frozen=True, eq=False)
class _Local:
    """This rank's call, checked, with the layout and the mode it takes."""

    bias: AttnBias | None
    call: Call
    layout: Layout
    grid: Tensor  # the bias's keep grid at the layout's grains
    needs: Needs  # the runs each rank receives of each other's part (exchange.exchanged_runs)
    choice: Choice
    scale: float | None
    enable_gqa: bool
    needs_grad: bool
    params: tuple[Tensor, ...]
    header: list[int]

    @classmethod
    def make(
        cls,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attn_mask: Any,
        dropout_p: Any,
        is_causal: Any,
        scale: Any,
        enable_gqa: Any,
        world: int,
        layout: Any,
        mode: Any,
    ) -> _Local:
        if isinstance(attn_mask, Tensor):
            raise TypeError(
                "attnbias.distributed.sdpa takes a bias object over the whole sequence as "
                "attn_mask, not a plain tensor; wrap the whole (L, S) mask in "
                "attnbias.TensorBias"
            )
        if attn_mask is not None and not isinstance(attn_mask, AttnBias):
            raise TypeError(
                f"attnbias.distributed.sdpa: attn_mask must be an AttnBias over the whole "
                f"sequence or None, got {type(attn_mask).__name__}"
            )
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}: expected one of {', '.join(map(repr, MODES))}")
        # this rank's tensors as an ordinary call; the bias is checked against the whole call
        dropout, scale = _validate(query, key, value, None, dropout_p, is_causal, scale, enable_gqa)
        if dropout != 0.0:
            raise ValueError(
                f"attnbias.distributed.sdpa: dropout_p={dropout_p!r} is not supported (each "
                f"part would need the dropout mask of the whole sequence); pass 0.0"
            )
        if query.dtype not in _DTYPES:
            raise TypeError(f"attnbias.distributed.sdpa: dtype {query.dtype} is not supported")
        length_q, length_kv = query.shape[2] * world, key.shape[2] * world
        bias = with_causal(attn_mask, is_causal)
        batch, heads_q = query.shape[0], query.shape[1]
        call = Call(batch, heads_q, length_q, length_kv, query.device)
        if bias is not None:
            bias.validate_call(call)
        chosen = resolve_layout(layout, world, bias, length_q, length_kv, query.device)
        chosen.chunk_size(length_q)  # a length it cannot split: ValueError
        chosen.chunk_size(length_kv)
        params = () if bias is None else bias.parameters()
        tensors = [query, key, value, *params]
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
        grid, needs, choice = _decision(mode, bias, call, chosen, key.shape[1], query.shape[-1],
                                 value.shape[-1], query.element_size(), needs_grad)  # fmt: skip
        header = [
            *query.shape, *key.shape, value.shape[-1], _DTYPES.index(query.dtype),
            int(enable_gqa), int(scale is None), MODES.index(choice.mode),
            *(c for rank in chosen.chunks for c in rank),
        ]  # fmt: skip
        return cls(bias, call, chosen, grid, needs, choice, scale, enable_gqa, needs_grad, params,
                   header)  # fmt: skip


_DECISIONS: Kept[tuple[Tensor, Needs, Choice]] = Kept(32)


def _decision(
    mode: str,
    bias: AttnBias | None,
    call: Call,
    layout: Layout,
    heads_kv: int,
    dim: int,
    dim_v: int,
    element: int,
    needs_grad: bool,
) -> tuple[Tensor, Needs, Choice]:
    """The keep grid at the layout's grains, the runs each rank receives and the mode, kept
    for the identical calls after it where the bias has a plan-cache key: a call then does no
    tensor arithmetic on the host (small CPU reductions cost milliseconds where several
    processes share the cores)."""
    identity = None if bias is None else bias.cache_key()
    key = (identity, call, layout, mode, heads_kv, dim, dim_v, element, needs_grad)
    cacheable = bias is None or identity is not None
    found = _DECISIONS.get(key) if cacheable else None
    if found is not None:
        return found
    grid = keep_grid(
        bias, call, grain(call.length_q, layout.pieces), grain(call.length_kv, layout.pieces)
    )
    needs = exchanged_runs(grid, call, layout)
    shape = StepShape(heads_kv, dim, dim_v, element, needs_grad)
    decided = grid, needs, choose_mode(mode, bias, call, layout, grid, needs, shape)
    return _DECISIONS.put(key, decided) if cacheable else decided


def explain(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: AttnBias | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    group: Any = None,
    layout: str | Layout = "zigzag",
    mode: str = "auto",
) -> str:
    """What :func:`sdpa` would do with these arguments on this rank, and why: the mode and
    both modes' predicted time, the layout, and what the sequence mode does or would do: the
    key/value positions each rank receives (of those held elsewhere) and from whom, and this
    rank's pairs per step. Runs no collective (every rank can call it alone)."""
    group = as_group(group)
    rank, world = world_of(group)
    local = _Local.make(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                        world, layout, mode)  # fmt: skip
    lines = [
        f"attnbias.distributed.sdpa on rank {rank} of {world}: query "
        f"{tuple(query.shape)} of (B, Hq, L, E) = {(query.shape[0], query.shape[1], local.call.length_q, query.shape[3])}",  # noqa: E501
        f"  {local.choice.describe()}",
        f"  layout {local.layout}",
    ]
    schedule = Schedule.make(
        local.bias, local.call, local.layout, rank, group, scale=local.scale,
        enable_gqa=local.enable_gqa, needs_grad=local.needs_grad, grid=local.grid,
        needs=local.needs,
    )  # fmt: skip
    part = local.call.length_kv // world
    taken = "takes" if local.choice.mode == "sequence" else "would take"
    lines.append(f"  the sequence mode {taken}:")
    for r in range(world):
        peers = [o for o in range(world) if schedule.needs[r][o]]
        lines.append(
            f"    rank {r} receives {schedule.received(r)} key/value positions of "
            f"{part * (world - 1)} held elsewhere, from rank(s) {peers}"
        )
    for step, pairs in enumerate(schedule.pairs):
        owner = (rank - step) % world
        if pairs:
            blocks = ", ".join(
                f"q[{p.block.q_start}:{p.block.q_start + p.block.length_q}] x "
                f"k[{p.block.kv_start}:{p.block.kv_start + p.block.length_kv}]"
                for p in pairs
            )
            lines.append(f"    step {step} (rank {owner}'s keys): {blocks}")
    return "\n".join(lines)


_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _summary(local: _Local | None, device: torch.device) -> Tensor:
    """What this rank tells the others, int64: whether it refused the call, then its header
    (shapes, dtype, flags, mode, layout), padded to one size on every rank."""
    header = [1] if local is None else [0, *local.header]
    found = torch.full((_SUMMARY,), -1, dtype=torch.int64)
    found[: len(header)] = torch.tensor(header[:_SUMMARY], dtype=torch.int64)
    found[-1] = len(header)
    return found.to(device)


# room for the header and a layout of up to 256 chunks; a longer one is compared by its length
_SUMMARY = 1 + 13 + 256 + 1


_HEADERS_GROUPS: dict[Any, Any] = {}


def _headers_group(group: Any) -> Any:
    """The group the ranks' headers are gathered over: ``group`` itself where its collectives
    take CPU tensors, else (NCCL) a gloo group of the same ranks, made at the group's first
    call: reading a gather on NCCL back to the host would wait for every kernel queued before
    it, and the GPU would then idle while the host plans the call (measured on two H100s:
    ~0.7 ms a call). Only the group's ranks take part in making it (every rank of the group
    makes the same call)."""
    if dist.get_backend(group) != "nccl":
        return group
    found = _HEADERS_GROUPS.get(group)
    if found is None:
        try:
            found = dist.new_group(
                dist.get_process_group_ranks(group), backend="gloo",
                use_local_synchronization=True,
            )  # fmt: skip
        except (RuntimeError, ValueError):  # no gloo in this build: gather over NCCL
            found = group
        _HEADERS_GROUPS[group] = found
    return found


def _gather_device(group: Any) -> torch.device:
    """Where the group's collectives take tensors: the current CUDA device for NCCL."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_agreement(headers: list[list[int]]) -> None:
    if all(h == headers[0] for h in headers):
        return

    def describe(h: list[int]) -> str:
        chunks = [c for c in h[13:-1] if c >= 0]
        return (
            f"query {tuple(h[0:4])}, key {tuple(h[4:8])}, Ev={h[8]}, "
            f"{_DTYPES[h[9]] if 0 <= h[9] < len(_DTYPES) else '?'}, "
            f"enable_gqa={bool(h[10])}, scale {'default' if h[11] else 'given'}, "
            f"mode {MODES[h[12]] if 0 <= h[12] < len(MODES) else '?'!r}, layout chunks {chunks}"
        )

    lines = "; ".join(f"rank {r}: {describe(h)}" for r, h in enumerate(headers))
    raise ValueError(
        f"attnbias.distributed.sdpa: the ranks' parts do not match ({lines}); every rank must "
        f"pass parts of the same shape and dtype ((B, H, L / W, E), as shard() gives) and the "
        f"same flags and layout"
    )
