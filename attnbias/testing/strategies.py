"""Hypothesis strategies that build valid attention problems (never filter them): call
shapes (GQA, both memory layouts), dtypes, document ids and sequence lengths, padding masks,
each built-in bias and sums of them.

Needs ``hypothesis`` (``pip install "attnbias[test]"``). A test of your own bias against every
built-in it may be summed with::

    from hypothesis import given
    from attnbias.testing import check_bias, strategies

    @given(other=strategies.builtin_biases())
    def test_my_bias(other):
        check_bias(MyBias() + other)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

try:
    from hypothesis import strategies as st
except ImportError as missing:  # pragma: no cover - depends on the environment
    raise ImportError(
        "attnbias.testing.strategies needs hypothesis: pip install 'attnbias[test]' "
        "(or pip install hypothesis); attnbias.testing.check_bias works without it"
    ) from missing

from attnbias import (
    AlibiBias,
    AttnBias,
    CausalBias,
    CausalVariant,
    DocumentBias,
    KeyRangeBias,
    SlidingWindowBias,
    SoftcapBias,
    TensorBias,
)

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass
class Problem:
    batch: int
    heads_q: int
    heads_kv: int
    length_q: int
    length_kv: int
    head_dim: int
    dtype: torch.dtype
    bias: AttnBias | None
    is_causal: bool
    scale: float | None
    rows_first: bool = False  # tensors (B, L, H, E) in memory, viewed as (B, H, L, E)

    def tensors(self, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        shape = (self.batch, self.heads_q, self.heads_kv, self.length_q, self.length_kv)
        return draw_inputs(shape, self.head_dim, self.dtype, seed, rows_first=self.rows_first)


def draw_inputs(
    shape: tuple[int, int, int, int, int],
    head_dim: int,
    dtype: torch.dtype,
    seed: int = 0,
    device: torch.device | str = "cpu",
    *,
    rows_first: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q, k, v, grad_out`` of a ``(B, Hq, Hkv, L, S)`` call, standard normal, drawn in that
    order from a generator seeded with ``seed``, in ``dtype`` on ``device``; ``rows_first``:
    each ``(B, L, H, E)`` in memory (as a projection leaves it), viewed as ``(B, H, L, E)``."""
    batch, heads_q, heads_kv, length_q, length_kv = shape
    generator = torch.Generator().manual_seed(seed)

    def draw(heads: int, length: int) -> torch.Tensor:
        if rows_first:
            x = torch.randn(batch, length, heads, head_dim, generator=generator).transpose(1, 2)
        else:
            x = torch.randn(batch, heads, length, head_dim, generator=generator)
        return x.to(device=device, dtype=dtype)

    return (
        draw(heads_q, length_q),
        draw(heads_kv, length_kv),
        draw(heads_kv, length_kv),
        draw(heads_q, length_q),
    )


@st.composite
def seqlens(draw: st.DrawFn, total: int, count: int) -> list[int]:
    """``count`` non-negative lengths summing to ``total`` (cut points drawn in [0, total])."""
    cuts = sorted(draw(st.lists(st.integers(0, total), min_size=count - 1, max_size=count - 1)))
    bounds = [0, *cuts, total]
    return [bounds[n + 1] - bounds[n] for n in range(count)]


@st.composite
def document_bias(draw: st.DrawFn, batch: int, length_q: int, length_kv: int) -> DocumentBias:
    count = draw(st.integers(1, 4))
    if length_q == length_kv and draw(st.booleans()):
        if length_q > 0 and draw(st.integers(0, 3)) == 0:  # documents of one length (chunks)
            count = draw(st.sampled_from([n for n in range(1, 9) if length_q % n == 0]))
            return DocumentBias.from_seqlens([length_q // count] * count)
        if draw(st.booleans()) and batch > 1:
            rows = [draw(seqlens(length_q, count)) for _ in range(batch)]
            ids = torch.stack(
                [torch.repeat_interleave(torch.arange(count), torch.tensor(r)) for r in rows]
            )
            return DocumentBias(ids)
        return DocumentBias.from_seqlens(draw(seqlens(length_q, count)))
    return DocumentBias.from_seqlens(
        draw(seqlens(length_q, count)), draw(seqlens(length_kv, count))
    )


@st.composite
def key_range_bias(draw: st.DrawFn, batch: int, length_kv: int) -> KeyRangeBias:
    """Valid keys per batch row, one range each or one shared by the batch: left padding
    (``start`` only), right padding or a cache's filled prefix (``end`` only), both ends, or
    a ``(B, S)`` padding mask; empty ranges and ranges of every key included."""
    rows = draw(st.sampled_from([1, batch]))
    bounds = [
        sorted(draw(st.lists(st.integers(0, length_kv), min_size=2, max_size=2)))
        for _ in range(rows)
    ]
    start = [lo for lo, _ in bounds]
    end = [hi for _, hi in bounds]
    form = draw(st.sampled_from(["start", "end", "both", "padding_mask"]))
    if form == "start":
        return KeyRangeBias(start=torch.tensor(start))
    if form == "end":
        return KeyRangeBias(end=torch.tensor(end))
    if form == "both":
        return KeyRangeBias(start=torch.tensor(start), end=torch.tensor(end))
    positions = torch.arange(length_kv)[None, :]
    mask = (positions >= torch.tensor(start)[:, None]) & (positions < torch.tensor(end)[:, None])
    return KeyRangeBias.from_padding_mask(mask.expand(batch, -1))


def _builtin_part(
    draw: st.DrawFn,
    kind: str,
    batch: int,
    heads_q: int | None,
    length_q: int | None,
    length_kv: int | None,
    reach: int,
    generator: torch.Generator,
) -> AttnBias:
    """One built-in bias of ``kind`` valid for the call: causal in either corner, a sliding
    window with sides up to ``reach`` (either open), documents, key ranges, ALiBi (the
    paper's slopes or drawn ones, per head or per batch row), soft-cap, a tensor bias. The
    lengths (and ``heads_q`` for ALiBi) must be given for the kinds that need them."""
    if kind == "causal":
        return CausalBias(draw(st.sampled_from(list(CausalVariant))))
    if kind == "window":
        left = draw(st.one_of(st.none(), st.integers(0, reach)))
        right = draw(st.one_of(st.none(), st.integers(0, reach)))
        return SlidingWindowBias(left, right)
    if kind == "softcap":
        return SoftcapBias(draw(st.sampled_from([0.5, 2.0, 20.0])))
    if kind == "alibi" and heads_q is not None:
        if draw(st.booleans()):
            return AlibiBias(num_heads=heads_q)
        rows = draw(st.sampled_from([None, 1, batch]))
        shape = (heads_q,) if rows is None else (rows, heads_q)
        return AlibiBias(slopes=torch.rand(shape, generator=generator) * 0.5)
    if length_q is None or length_kv is None:
        raise ValueError(f"a {kind!r} bias needs the call's lengths")
    if kind == "docs":
        return draw(document_bias(batch, length_q, length_kv))
    if kind == "keys":
        return draw(key_range_bias(batch, length_kv))
    if kind == "tensor":
        return TensorBias(torch.randn(length_q, length_kv, generator=generator))
    raise ValueError(f"no built-in bias of kind {kind!r}")


@st.composite
def problems(
    draw: st.DrawFn,
    *,
    max_len: int = 40,
    head_dims: tuple[int, ...] = (16, 32),
    dtypes: tuple[torch.dtype, ...] = DTYPES,
    allow_tensor_bias: bool = True,
) -> Problem:
    batch = draw(st.integers(1, 2))
    heads_kv = draw(st.integers(1, 2))
    heads_q = heads_kv * draw(st.integers(1, 2))
    length_q = draw(st.integers(1, max_len))
    length_kv = draw(st.integers(1, max_len))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    parts: list[AttnBias] = []
    kinds = draw(
        st.lists(
            st.sampled_from(["causal", "window", "docs", "keys", "alibi", "softcap", "tensor"]),
            max_size=3,
            unique=True,
        )
    )
    for kind in kinds:
        if kind != "tensor" or allow_tensor_bias:
            parts.append(
                _builtin_part(draw, kind, batch, heads_q, length_q, length_kv, max_len, generator)
            )
    bias: AttnBias | None = None
    for part in parts:
        bias = part if bias is None else bias + part
    return Problem(
        batch=batch,
        heads_q=heads_q,
        heads_kv=heads_kv,
        length_q=length_q,
        length_kv=length_kv,
        head_dim=draw(st.sampled_from(head_dims)),
        dtype=draw(st.sampled_from(dtypes)),
        bias=bias,
        is_causal=draw(st.booleans()) if bias is not None else False,
        scale=draw(st.sampled_from([None, 0.3])),
    )


@dataclass
class Garbage:
    """Where non-finite values go in an attention problem: ``(tensor, b, h, position, e)``
    entries with ``tensor`` one of ``"query"``, ``"key"``, ``"value"``."""

    entries: list[tuple[str, int, int, int, int]]
    values: list[float]

    def apply(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, clean: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Copies of ``q, k, v`` with the garbage in, or with zeros in its place (``clean``)."""
        tensors = {"query": q.clone(), "key": k.clone(), "value": v.clone()}
        for (name, b, h, position, e), value in zip(self.entries, self.values, strict=True):
            tensors[name][b, h, position, e] = 0.0 if clean else value
        return tensors["query"], tensors["key"], tensors["value"]


@st.composite
def garbage(draw: st.DrawFn, problem: Problem) -> Garbage:
    """One to three NaN / +Inf / -Inf entries anywhere in the query, key or value: which rows
    attend them is up to the bias, so draws land both in attended and in unattended positions."""
    entries = []
    for _ in range(draw(st.integers(1, 3))):
        name = draw(st.sampled_from(["query", "key", "value"]))
        heads = problem.heads_q if name == "query" else problem.heads_kv
        length = problem.length_q if name == "query" else problem.length_kv
        entries.append(
            (
                name,
                draw(st.integers(0, problem.batch - 1)),
                draw(st.integers(0, heads - 1)),
                draw(st.integers(0, length - 1)),
                draw(st.integers(0, problem.head_dim - 1)),
            )
        )
    values = [draw(st.sampled_from([math.nan, math.inf, -math.inf])) for _ in entries]
    return Garbage(entries, values)


@st.composite
def unattended_keys(draw: st.DrawFn) -> tuple[AttnBias, int, int, list[int]]:
    """``(bias, L, S, keys)``: a bias under which no query row attends the listed keys, so
    non-finite keys and values there must change nothing, gradients included."""
    length_q = draw(st.integers(1, 8))
    extra = draw(st.integers(1, 6))
    length_kv = length_q + extra
    kind = draw(st.sampled_from(["causal", "window", "docs", "keys", "tensor"]))
    if kind == "causal":  # upper-left: keys j >= L are never attended
        bias: AttnBias = CausalBias(CausalVariant.UPPER_LEFT)
        keys = list(range(length_q, length_kv))
    elif kind == "window":  # bottom-right aligned, right side 0: the first keys drop out
        bias = SlidingWindowBias(draw(st.integers(0, extra - 1)))
        keys = list(range(0, length_kv - length_q - bias.window_left))  # type: ignore[operator]
    elif kind == "docs":  # a last key document with no query tokens
        bias = DocumentBias.from_seqlens([length_q, 0], [length_q, extra])
        keys = list(range(length_q, length_kv))
    elif kind == "keys":  # padding before a range shared by the batch, unused slots after it
        start = draw(st.integers(0, extra))
        end = draw(st.integers(start, length_kv - 1))
        bias = KeyRangeBias(start=torch.tensor([start]), end=torch.tensor([end]))
        keys = [*range(0, start), *range(end, length_kv)]
    else:
        keep = torch.ones(length_q, length_kv, dtype=torch.bool)
        keys = sorted(draw(st.sets(st.integers(0, length_kv - 1), min_size=1, max_size=extra)))
        keep[:, keys] = False
        bias = TensorBias(keep)
    if draw(st.booleans()):
        bias = bias + AlibiBias(num_heads=2)
    return bias, length_q, length_kv, keys


# --------------------------------------------------------------------------------------------
# The kernel route: built-in biases with a kernel form, any finite scale


@st.composite
def kernel_bias(
    draw: st.DrawFn, batch: int, heads_q: int, length_q: int, length_kv: int
) -> AttnBias:
    """A sum of one to four built-in biases that lowers to the kernel's form (a band,
    documents, key ranges, ALiBi, soft-cap): causal in either corner, sliding windows (open
    sides, widths from 0 past the lengths), one or two document layouts, one or two key ranges
    (per batch row or shared, empty ones included), the paper's or given ALiBi slopes
    (``(Hq,)``, ``(1, Hq)`` or ``(B, Hq)``, zero included), one or two of them, soft-cap."""
    kinds = draw(
        st.lists(
            st.sampled_from(["causal", "window", "docs", "keys", "alibi", "softcap"]),
            min_size=1,
            max_size=4,
        )
    )
    parts: list[AttnBias] = []
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    for kind in kinds:
        if kind == "causal":
            parts.append(CausalBias(draw(st.sampled_from(list(CausalVariant)))))
        elif kind == "window":
            side = st.one_of(st.none(), st.integers(0, max(length_q, length_kv) + 2))
            parts.append(SlidingWindowBias(draw(side), draw(side)))
        elif kind == "docs":
            parts.append(draw(document_bias(batch, length_q, length_kv)))
        elif kind == "keys":
            parts.append(draw(key_range_bias(batch, length_kv)))
        elif kind == "alibi":
            shape = draw(st.sampled_from([None, (heads_q,), (1, heads_q), (batch, heads_q)]))
            if shape is None:
                parts.append(AlibiBias(num_heads=heads_q))
            else:
                parts.append(AlibiBias(slopes=torch.rand(shape, generator=generator)))
        elif not any(isinstance(p, SoftcapBias) for p in parts):
            parts.append(SoftcapBias(draw(st.sampled_from([0.5, 3.0, 30.0]))))
    bias = parts[0]
    for part in parts[1:]:
        bias = bias + part
    return bias


def finite_scales() -> st.SearchStrategy[float]:
    """Finite scales of either sign: 0 and -0, below float32's smallest normal (the GPU may
    flush those to 0), and up to 0.7 in size (scores up to about +-15 at the head dims and
    magnitudes drawn here).

    Larger scores are right too, but in float32 no flash-attention backward stays within twice
    stock PyTorch's error there: it recomputes the probabilities from a stored log-sum-exp,
    which costs about ``eps * (|s| + |lse|)`` (``tests/test_kernels.py`` budgets for that).
    """
    return st.one_of(
        st.sampled_from([0.0, -0.0, 1e-45, -1e-40, 1e-38, -0.5]),
        st.floats(-0.7, 0.7, allow_nan=False, allow_infinity=False),
    )


@st.composite
def kernel_problems(
    draw: st.DrawFn,
    *,
    max_len: int = 32,
    head_dims: tuple[int, ...] = (16, 24),
    dtypes: tuple[torch.dtype, ...] = DTYPES,
    scales: st.SearchStrategy[float | None] | None = None,
) -> Problem:
    """A call the Triton kernel can take: a kernel-form bias (never ``None``), lengths from 1
    to ``max_len`` (L < S, L = S, L > S), GQA groups of 1 to 3. At most 3 (batch, query head)
    pairs, which keeps Triton's interpreter fast; per-batch ids and slopes come with B = 2."""
    batch, heads_kv, group = draw(
        st.sampled_from([(1, 1, 1), (1, 1, 2), (1, 1, 3), (1, 2, 1), (2, 1, 1)])
    )
    heads_q = heads_kv * group
    length_q = draw(st.integers(1, max_len))
    length_kv = draw(st.integers(1, max_len))
    return Problem(
        batch=batch,
        heads_q=heads_q,
        heads_kv=heads_kv,
        length_q=length_q,
        length_kv=length_kv,
        head_dim=draw(st.sampled_from(head_dims)),
        dtype=draw(st.sampled_from(dtypes)),
        bias=draw(kernel_bias(batch, heads_q, length_q, length_kv)),
        is_causal=draw(st.booleans()),
        scale=draw(scales if scales is not None else st.sampled_from([None, 0.3])),
    )


# --------------------------------------------------------------------------------------------
# For testing a bias of your own (``attnbias.testing.check_bias``)


def shapes(
    *, max_batch: int = 2, max_heads_kv: int = 2, max_group: int = 2, max_len: int = 32,
    head_dims: tuple[int, ...] = (16, 32),
) -> st.SearchStrategy[tuple[int, int, int, int, int, int]]:  # fmt: skip
    """``(B, Hq, Hkv, L, S, E)`` call shapes as :func:`~attnbias.testing.check_bias` takes
    them: ``Hq`` a multiple of ``Hkv`` (GQA groups up to ``max_group``), L and S from 1 to
    ``max_len`` independently (L < S, L = S, L > S)."""

    @st.composite
    def draw_shape(draw: st.DrawFn) -> tuple[int, int, int, int, int, int]:
        heads_kv = draw(st.integers(1, max_heads_kv))
        return (
            draw(st.integers(1, max_batch)),
            heads_kv * draw(st.integers(1, max_group)),
            heads_kv,
            draw(st.integers(1, max_len)),
            draw(st.integers(1, max_len)),
            draw(st.sampled_from(head_dims)),
        )

    return draw_shape()


def dtypes() -> st.SearchStrategy[torch.dtype]:
    """The dtypes a call may have: float32, float16 and bfloat16 (on the CPU as on CUDA)."""
    return st.sampled_from(DTYPES)


@st.composite
def padding_masks(draw: st.DrawFn, batch: int, length_kv: int) -> torch.Tensor:
    """A ``(B, S)`` bool padding mask (``True`` = a real token): each row one contiguous run
    of real tokens, left or right padded, possibly empty or whole (what
    :meth:`attnbias.KeyRangeBias.from_padding_mask` takes)."""
    positions = torch.arange(length_kv)[None, :]
    rows = []
    for _ in range(batch):
        start, end = sorted(draw(st.lists(st.integers(0, length_kv), min_size=2, max_size=2)))
        rows.append((positions >= start) & (positions < end))
    return torch.cat(rows)


@st.composite
def builtin_biases(
    draw: st.DrawFn,
    length_q: int | None = None,
    length_kv: int | None = None,
    *,
    batch: int | None = None,
    heads_q: int | None = None,
    max_parts: int = 3,
) -> AttnBias:
    """A built-in bias, or a sum of up to ``max_parts`` of them, valid for a call with these
    lengths (and ``batch``, ``heads_q`` where given).

    With no lengths only biases that fit any call are drawn: causal (either corner), sliding
    windows and soft-cap, and ALiBi (the paper's slopes or drawn ones) where ``heads_q`` is
    given. With
    ``length_q`` and ``length_kv`` also documents, key ranges (``batch`` rows, or one shared)
    and a tensor bias. So ``@given(other=builtin_biases())`` sums with a bias of your own for
    any shape you check it on::

        @given(other=strategies.builtin_biases())
        def test_my_bias(other):
            check_bias(MyBias() + other)
    """
    sized = length_q is not None and length_kv is not None
    kinds = ["causal", "window", "softcap"]
    if heads_q is not None:
        kinds.append("alibi")
    if sized:
        kinds += ["docs", "keys", "tensor"]
    chosen = draw(st.lists(st.sampled_from(kinds), min_size=1, max_size=max_parts, unique=True))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    reach = 2 * max(length_q or 16, length_kv or 16)
    parts = [
        _builtin_part(draw, kind, batch or 1, heads_q, length_q, length_kv, reach, generator)
        for kind in chosen
    ]
    bias = parts[0]
    for part in parts[1:]:
        bias = bias + part
    return bias
