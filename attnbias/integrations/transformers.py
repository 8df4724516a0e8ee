"""Hugging Face transformers models on attnbias: ``attn_implementation="attnbias"``.

::

    import attnbias.integrations.transformers as attnbias_hf
    from transformers import AutoModelForCausalLM

    attnbias_hf.register()
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="attnbias")

:func:`register` adds two functions to transformers under the name ``"attnbias"``:

- a mask function (``AttentionMaskInterface``): where transformers would build an ``(B, 1, L, S)``
  mask for a model, it returns a :class:`ModelMask`, the same pattern as a bias object:
  causal (:func:`attnbias.causal_lower_right`, aligned with the end of the key/value cache),
  the sliding window (``SlidingWindowBias(W - 1)`` for transformers' ``sliding_window=W``, which
  counts the query's own key), packed sequences found from ``position_ids``
  (:class:`attnbias.DocumentBias`) and left or right padding from the 2-D ``attention_mask``
  (:meth:`attnbias.KeyRangeBias.from_padding_mask`);
- an attention function (``AttentionInterface``): adds the layer's soft-cap
  (:class:`attnbias.SoftcapBias`, Gemma 2's ``attn_logit_softcapping``) to the layer's mask and
  calls :func:`attnbias.sdpa` with the layer's ``scaling``, dropout and grouped key/value heads
  (``enable_gqa``, no copies of the key/value heads).

Each layer gets the mask of its kind (transformers builds one per kind, ``full_attention`` and
``sliding_attention`` in ``config.layer_types``), so models whose layers alternate (Gemma 2 and
3) run each layer with its own bias.

A mask that no bias expresses exactly (a 4-D mask passed by the user, a mask function of the
model's own such as Gemma 3's bidirectional image tokens, a padding mask with holes, a static
cache's offset while ``torch.compile`` traces) is materialised, by transformers' own SDPA mask
function, and passed as :class:`attnbias.TensorBias`; a warning names the model, the layer and
the reason, once per reason.

Continuous batching (``model.generate_batch``, transformers' paged cache): :func:`register`
also adds :func:`paged_attention_forward` under :data:`CB_IMPLEMENTATION`; run the batching
inside :func:`continuous_batching`::

    with attnbias_hf.continuous_batching(model):
        outputs = model.generate_batch(prompts, generation_config=config)

Each step's rows (prefill chunks and decode tokens packed together) run as one
:class:`attnbias.PagedKV` call with ``causal_lower_right()``, the layer's window and soft-cap
aligned per row, over the cache's own pages: no ``(L, S)`` mask is built.

Shape legend: B batch, Hq query heads, Hkv key/value heads, L query length, S key length,
E head dimension.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import operator
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from attnbias.biases import (
    AttnBias,
    DocumentBias,
    KeyRangeBias,
    PagedKV,
    SlidingWindowBias,
    SoftcapBias,
    TensorBias,
    causal_lower_right,
    causal_upper_left,
)
from attnbias.functional import explain, sdpa
from attnbias.spec import capturing

__all__ = [
    "ATTN_IMPLEMENTATION",
    "CB_IMPLEMENTATION",
    "ModelMask",
    "attention_forward",
    "continuous_batching",
    "explain_model",
    "make_mask",
    "paged_attention_forward",
    "register",
]

# The name models are loaded with: attn_implementation="attnbias".
ATTN_IMPLEMENTATION = "attnbias"
# The name continuous batching runs under (see continuous_batching()): transformers 5.19 and
# later batch continuously only with "sdpa", "paged|eager" or a name that contains "flash"
# (then without a dense mask), and read no version number after it ("flash...2" selects its
# FlashAttention 2 decode path). 5.17 and 5.18 batch under a registered name with the
# "paged|" prefix (and warn from 5.19 on where a "flash" name carries it): both are registered,
# continuous_batching() sets the one the installed version reads.
CB_IMPLEMENTATION = "attnbias_paged_flash"

# What the recogniser below reads from transformers' mask functions: they are closures, and
# closures made by one `def` share its code object, so a function is identified exactly by
# comparing code objects, and its parameters are read from its closure cells.
_CODES: dict[str, Any] | None = None
_LOCK = threading.Lock()
_WARNED: set[str] = set()


def register() -> None:
    """Register attnbias in transformers under ``attn_implementation="attnbias"``.

    Adds :func:`attention_forward` to ``transformers.AttentionInterface`` and :func:`make_mask`
    to ``transformers.masking_utils.AttentionMaskInterface``, and
    :func:`paged_attention_forward` under :data:`CB_IMPLEMENTATION` (continuous batching, see
    :func:`continuous_batching`). Calling it again does nothing more.
    Then ``AutoModelForCausalLM.from_pretrained(name, attn_implementation="attnbias")`` (or
    ``from_config``, or ``model.set_attn_implementation("attnbias")``) runs the model's
    attention through :func:`attnbias.sdpa` with bias objects.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, make_mask)
    AttentionInterface.register(CB_IMPLEMENTATION, paged_attention_forward)
    AttentionInterface.register(f"paged|{CB_IMPLEMENTATION}", paged_attention_forward)


@dataclass(frozen=True, eq=False)
class ModelMask:
    """What :func:`make_mask` gives a model in place of an ``(B, 1, L, S)`` mask tensor.

    Attributes:
        bias: the mask as a bias object for calls of shape ``(B, Hq, L, keys)``; ``None`` keeps
            every pair.
        keys: how many keys, from the first, the layer's call attends to: ``kv_length``, or
            fewer where the keys after them are kept by no query (the unfilled end of a static
            cache), which the attention function then leaves out (a view, no copy).
        kv_length: the number of keys transformers sized the mask for; the layer's keys must
            have this length.
        window: transformers' ``sliding_window`` (keys per query, its own included) when the
            mask is a sliding window, else ``None``.
        notes: why part or all of the mask is materialised (warned about once per note).
    """

    bias: AttnBias | None
    keys: int
    kv_length: int
    window: int | None = None
    notes: tuple[str, ...] = field(default=())
    batch_size: int = 1
    q_length: int = 1

    # transformers handles a prepared mask as a tensor in a few places (generate() prepares the
    # masks of a static cache ahead and calls .contiguous() on them; the model's mask creation
    # then reads .ndim and passes it back to make_mask, which returns it as is).
    ndim = 4

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(B, 1, L, S)``: the shape of the mask tensor this stands for."""
        return (self.batch_size, 1, self.q_length, self.kv_length)

    def contiguous(self) -> ModelMask:
        return self

    def __repr__(self) -> str:
        parts = [f"bias={self.bias!r}", f"keys={self.keys}", f"kv_length={self.kv_length}"]
        if self.window is not None:
            parts.append(f"window={self.window}")
        if self.notes:
            parts.append(f"notes={list(self.notes)}")
        return f"ModelMask({', '.join(parts)})"


# --------------------------------------------------------------------------------------------
# Recognising transformers' mask functions


@dataclass
class _Pattern:
    """A mask function as ``lo <= kv_position - q_position <= hi`` (``None``: unbounded),
    within the documents ``doc_ids`` (``(B, L)``) when set."""

    lo: int | None = None
    hi: int | None = None
    window: int | None = None
    doc_ids: Tensor | None = None
    remapped: bool = False


class _Unexpressible(Exception):
    """The mask is exact only as a tensor; the message says why."""


def _codes() -> dict[str, Any]:
    global _CODES
    with _LOCK:
        if _CODES is None:
            from transformers import masking_utils as mu

            ids = torch.zeros(1, 1, dtype=torch.long)
            codes = {
                "and": mu.and_masks(mu.causal_mask_function).__code__,
                "causal": mu.causal_mask_function.__code__,
                "bidirectional": mu.bidirectional_mask_function.__code__,
                "sliding": mu.sliding_window_overlay(1).__code__,
                "sliding_bidirectional": mu.sliding_window_bidirectional_overlay(1).__code__,
                "packed": mu.packed_sequence_mask_function(ids).__code__,
            }
            # transformers >= 5.18 also maps the packed positions back to each sequence's own
            remap = getattr(mu, "remap_positions_for_packed_sequence", None)
            if remap is not None:
                codes["remap"] = remap(mu.causal_mask_function, ids).__code__
            _CODES = codes
        return _CODES


def _closure(function: Callable[..., Any]) -> dict[str, Any]:
    cells = function.__closure__ or ()
    return dict(zip(function.__code__.co_freevars, (c.cell_contents for c in cells), strict=True))


def _intersect(pattern: _Pattern, lo: int | None, hi: int | None) -> None:
    if lo is not None:
        pattern.lo = lo if pattern.lo is None else max(pattern.lo, lo)
    if hi is not None:
        pattern.hi = hi if pattern.hi is None else min(pattern.hi, hi)


def _read(function: Any, pattern: _Pattern, inside_remap: bool) -> None:
    """Intersect ``pattern`` with what ``function`` keeps; raise :class:`_Unexpressible` for a
    function that is not one of transformers' band, window or packed-sequence functions."""
    codes = _codes()
    code = getattr(function, "__code__", None)
    if code is None:
        raise _Unexpressible(f"its mask function {function!r} is not a Python function")
    if code is codes["and"]:
        for part in _closure(function)["mask_functions"]:
            _read(part, pattern, inside_remap)
    elif code is codes["causal"]:
        _intersect(pattern, None, 0)
    elif code is codes["bidirectional"]:
        pass
    elif code is codes["sliding"]:
        window = int(_closure(function)["sliding_window"])
        # kv_idx > q_idx - window: `window` keys, the query's own included
        _intersect(pattern, 1 - window, None)
        pattern.window = window if pattern.window is None else min(pattern.window, window)
    elif code is codes["sliding_bidirectional"]:
        window = int(_closure(function)["sliding_window"])
        _intersect(pattern, -window, window)
    elif code is codes["packed"] and not inside_remap:
        pattern.doc_ids = _closure(function)["packed_sequence_mask"]
    elif code is codes.get("remap") and not inside_remap:
        # Positions restart in each packed sequence; within one they step by 1 (that is how
        # transformers finds the sequences), so a band on positions is the same band on
        # indices there. Exact only beside the packed-sequence function, checked after.
        pattern.remapped = True
        _read(_closure(function)["mask_function"], pattern, True)
    else:
        name = getattr(function, "__qualname__", repr(function))
        raise _Unexpressible(f"its mask function {name} is none of the patterns attnbias knows")


def _recognise(mask_function: Any) -> _Pattern:
    pattern = _Pattern()
    _read(mask_function, pattern, False)
    if pattern.remapped and pattern.doc_ids is None:
        raise _Unexpressible("positions are remapped without packed sequences")
    return pattern


# --------------------------------------------------------------------------------------------
# The mask function


def _band(pattern: _Pattern, shift: int, lo_ij: int | None, hi_ij: int | None) -> AttnBias | None:
    """The band ``lo_ij <= j - i <= hi_ij`` for calls with ``S - L = shift``, as a bias."""
    left = None if lo_ij is None else shift - lo_ij
    right = None if hi_ij is None else hi_ij - shift
    if left is not None and left < 0:
        raise _Unexpressible(
            f"its band starts {-left} keys after the diagonal of the last query and key"
        )
    assert right is None or right >= 0  # the keys after the band were cut off by the caller
    if right == 0:
        causal = causal_lower_right()
        return causal if left is None else causal + SlidingWindowBias(left)
    if left is None and right is None:
        return None
    return SlidingWindowBias(left, right)


def _padding(
    attention_mask: Tensor, kv_offset: int, keys: int
) -> tuple[AttnBias | None, tuple[str, ...]]:
    """The ``(B, >= kv_offset + keys)`` padding mask (``True`` = a real token) for the call's
    keys, as a key range; a mask with holes as a ``(B, 1, 1, keys)`` tensor."""
    padding = attention_mask[:, kv_offset : kv_offset + keys].bool()
    if padding.shape[1] < keys:
        # transformers pads a short mask with "padding" too (a static cache's unused slots)
        padding = F.pad(padding, (0, keys - padding.shape[1]), value=False)
    if bool(padding.all()):
        return None, ()
    try:
        return KeyRangeBias.from_padding_mask(padding), ()
    except ValueError:
        note = (
            "its 2-D attention_mask has padding between real tokens (no single key range "
            "per row), so the padding runs as a (B, 1, 1, S) TensorBias"
        )
        return TensorBias(padding[:, None, None, :]), (note,)


def _structured(
    pattern: _Pattern,
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int,
    kv_offset: int,
    attention_mask: Tensor | None,
) -> ModelMask:
    # Query index i has position i + q_offset, key index j position j + kv_offset, so a band
    # lo <= kv_position - q_position <= hi is lo + d <= j - i <= hi + d:
    d = q_offset - kv_offset
    lo_ij = None if pattern.lo is None else pattern.lo + d
    hi_ij = None if pattern.hi is None else pattern.hi + d
    keys = kv_length
    if hi_ij is not None and hi_ij + q_length < kv_length:
        # The keys after the band of the last query (a static cache's unfilled end) are kept
        # by no query: the call leaves them out.
        keys = hi_ij + q_length
    if keys <= 0:
        raise _Unexpressible(f"no query keeps any of its {kv_length} keys")
    parts: list[AttnBias] = []
    band = _band(pattern, keys - q_length, lo_ij, hi_ij)
    if band is not None:
        parts.append(band)
    if pattern.doc_ids is not None:
        ids = pattern.doc_ids
        if d != 0 or not (q_length == keys == ids.shape[-1]):
            raise _Unexpressible(
                f"packed sequences with L={q_length}, S={keys} and ids of shape "
                f"{tuple(ids.shape)} (offsets {q_offset}, {kv_offset})"
            )
        parts.append(DocumentBias(ids.expand(batch_size, -1).contiguous()))
    notes: tuple[str, ...] = ()
    if attention_mask is not None:
        padding, notes = _padding(attention_mask, kv_offset, keys)
        if padding is not None:
            parts.append(padding)
    bias = functools.reduce(operator.add, parts) if parts else None
    return ModelMask(bias, keys, kv_length, pattern.window, notes, batch_size, q_length)


def make_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | Tensor = 0,
    kv_offset: int = 0,
    mask_function: Callable[..., Any] | None = None,
    attention_mask: Tensor | None = None,
    use_vmap: bool = False,
    device: torch.device | str = "cpu",
    config: Any = None,
    **kwargs: Any,
) -> ModelMask:
    """transformers' mask function for ``attn_implementation="attnbias"``.

    Called by ``create_causal_mask`` and its siblings once per forward and kind of layer, with
    the arguments of transformers' ``sdpa_mask``: the sizes (``L = q_length``,
    ``S = kv_length``), the positions of the first query and key (``q_offset``, ``kv_offset``:
    the cache), the mask function (causal, sliding window, packed sequences, a model's own) and
    the ``(B, >= kv_offset + S)`` padding mask. Returns the same pattern as a
    :class:`ModelMask`, materialised by transformers' ``sdpa_mask`` only where no bias
    expresses it exactly (``ModelMask.notes`` says why).
    """
    from transformers import masking_utils

    if isinstance(attention_mask, ModelMask):
        # prepared ahead by generate() with these same arguments (static caches)
        return attention_mask
    if mask_function is None:
        mask_function = masking_utils.causal_mask_function
    try:
        if isinstance(q_offset, Tensor):
            if torch.compiler.is_compiling():
                raise _Unexpressible(
                    "a static cache's query offset is a tensor that torch.compile traces"
                )
            q_offset = int(q_offset)
        pattern = _recognise(mask_function)
        return _structured(
            pattern, batch_size, q_length, kv_length, q_offset, kv_offset, attention_mask
        )
    except _Unexpressible as reason:
        # a static cache's q_offset is a tensor, which sdpa_mask takes too
        offset: Any = q_offset
        keep = masking_utils.sdpa_mask(
            batch_size=batch_size,
            q_length=q_length,
            kv_length=kv_length,
            q_offset=offset,
            kv_offset=kv_offset,
            mask_function=mask_function,
            attention_mask=attention_mask,
            allow_is_causal_skip=False,
            allow_is_bidirectional_skip=False,
            use_vmap=use_vmap,
            device=device,
        )
        note = f"{reason}, so it runs as a materialised (B, 1, L, S) TensorBias"
        # None: sdpa_mask found that every pair is kept
        bias = None if keep is None else TensorBias(keep)
        return ModelMask(bias, kv_length, kv_length, None, (note,), batch_size, q_length)


# --------------------------------------------------------------------------------------------
# The attention function


def _warn_once(module: Any, note: str) -> None:
    if note in _WARNED:
        return
    _WARNED.add(note)
    config = getattr(module, "config", None)
    model = getattr(config, "model_type", None) or "model"
    layer = getattr(module, "layer_idx", None)
    where = f"{model} {type(module).__name__}" + ("" if layer is None else f" (layer {layer})")
    warnings.warn(f"attnbias: {where}: {note}; said once per reason", UserWarning, stacklevel=3)


def attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: ModelMask | Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention function for ``attn_implementation="attnbias"``.

    Args:
        module: the attention layer (its ``config``, ``layer_idx`` and ``is_causal`` are read).
        query: ``(B, Hq, L, E)``.
        key: ``(B, Hkv, S, E)``.
        value: ``(B, Hkv, S, Ev)``.
        attention_mask: the layer's :class:`ModelMask` (from :func:`make_mask`); a tensor (a
            mask the model or the user built) runs as a :class:`attnbias.TensorBias`, with a
            warning; ``None`` means causal (upper-left, as transformers' SDPA function) for a
            causal layer with ``L > 1``, else no mask.
        dropout: dropout probability on the attention weights (transformers passes 0 outside
            training).
        scaling: the score scale (Gemma's ``query_pre_attn_scalar ** -0.5``); ``None`` is
            ``1 / sqrt(E)``.
        softcap: Gemma 2's ``attn_logit_softcapping``: ``s = softcap * tanh(s / softcap)``.
        kwargs: the rest of the layer's arguments. ``sliding_window`` is what the layer's mask
            was built with and is not read again; ``is_causal`` matters only without a mask;
            ``position_bias`` (an additive ``(B, Hq, L, S)`` tensor) is added as a
            :class:`attnbias.TensorBias`.

    Returns:
        ``(attn_output, None)``: the output ``(B, L, Hq, Ev)``, contiguous, and no attention
        weights (as transformers' SDPA function).

    Raises:
        TypeError: an ``attention_mask`` of another type (e.g. flex attention's ``BlockMask``).
        ValueError: keys of another length than the mask was made for, or attention sinks
            (``s_aux``), which attnbias does not compute.
    """
    if kwargs.get("s_aux") is not None:
        raise ValueError(
            f"attnbias: {type(module).__name__} passes attention sinks (s_aux), which "
            f"attnbias.sdpa does not compute; load the model with attn_implementation='eager'"
        )
    bias: AttnBias | None
    if isinstance(attention_mask, ModelMask):
        if key.shape[2] != attention_mask.kv_length:
            raise ValueError(
                f"attnbias: {type(module).__name__} got keys of length S={key.shape[2]} but its "
                f"mask was made for kv_length={attention_mask.kv_length}; the cache and the "
                f"mask disagree"
            )
        for note in attention_mask.notes:
            _warn_once(module, note)
        if attention_mask.keys < key.shape[2]:
            key = key[:, :, : attention_mask.keys]
            value = value[:, :, : attention_mask.keys]
        bias = attention_mask.bias
    elif isinstance(attention_mask, Tensor):
        _warn_once(
            module,
            f"it got a {attention_mask.dim()}-D tensor mask (built by the model or passed by "
            f"the user, not by attnbias's mask function), which runs as a TensorBias",
        )
        bias = TensorBias(attention_mask)
    elif attention_mask is None:
        is_causal = kwargs.get("is_causal")
        causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        bias = causal_upper_left() if causal and query.shape[2] > 1 else None
    else:
        raise TypeError(
            f"attnbias: {type(module).__name__} got an attention_mask of type "
            f"{type(attention_mask).__name__}; attn_implementation='attnbias' takes the mask "
            f"its own mask function makes, a tensor or None (load the model with "
            f"attn_implementation='attnbias' after attnbias.integrations.transformers.register())"
        )
    position_bias = kwargs.get("position_bias")
    if position_bias is not None:
        extra = TensorBias(position_bias[..., : key.shape[2]])
        bias = extra if bias is None else bias + extra
    if softcap is not None:
        bias = SoftcapBias(softcap) if bias is None else bias + SoftcapBias(softcap)
    enable_gqa = query.shape[1] != key.shape[1]
    recorder = _RECORDER.get()
    if recorder is not None:
        route = explain(
            query, key, value, bias, dropout_p=dropout, scale=scaling, enable_gqa=enable_gqa
        )
        recorder.append(_LayerRoute(module, bias, route))
    output = sdpa(
        query, key, value, attn_mask=bias, dropout_p=dropout, scale=scaling, enable_gqa=enable_gqa
    )
    return output.transpose(1, 2).contiguous(), None


# --------------------------------------------------------------------------------------------
# Continuous batching


@dataclass
class _StepRows:
    """One kind of layer's rows in a continuous-batching step, as a :class:`PagedKV`: row
    ``b``'s queries ``cu_seq_lens_q[b]:cu_seq_lens_q[b + 1]``; the queries past
    ``cu_seq_lens_q[-1]`` (a step padded for CUDA graphs) belong to no row and cost no
    attention (their outputs are zeros). The tables are written in place on the device when a
    step's lengths change (no host synchronisation), so one bias serves every step of the
    same shape and its sums keep their plans."""

    table: Tensor  # int32 (B, W)
    lens: Tensor  # int32 (B,)
    cu_q: Tensor  # int32 (B + 1,)
    paged: PagedKV
    sums: dict[tuple[int | None, float | None], AttnBias] = field(default_factory=dict)
    # the step's tensors the tables were written from, and their versions and key count
    sources: tuple[Tensor, ...] = ()
    filled: tuple[int, ...] = ()
    # written inside a CUDA-graph capture: the graph writes and reads these tensors at each
    # replay, so they are kept as long as the process
    captured: bool = False


# (thread, device, stream, rows, width, page, queries, window, max_seqlen_q) -> the rows of
# that shape; a few shapes live at once (steps bucket their widths to powers of two). Tables
# are written in place in stream order: a batching loop on another thread or stream
# (double-buffered steps) gets tables of its own, and each kind of layer (a window or none)
# too, so that alternating layers do not write them back and forth.
_STEP_ROWS: dict[tuple[Any, ...], _StepRows] = {}
_STEP_ROWS_KEPT = 32


def _step_bias(
    cu_q: Tensor,
    cu_k: Tensor,
    max_k: int,
    queries: int,
    window: int | None,
    softcap: float | None,
    *,
    keys: int = 0,
    read_index: Tensor | None = None,
    page: int = 1,
    max_q: int | None = None,
) -> AttnBias:
    """``PagedKV + causal_lower_right()`` (+ the layer's window and soft-cap) for a step whose
    ``queries`` packed query tokens are split into rows by ``cu_q`` and their keys by ``cu_k``
    (int32 ``(B + 1,)``, on the device; the tokens past ``cu_q[-1]``, a padded step's, in no
    row), the longest row ``max_k`` keys and, where given, ``max_q`` queries (the rows then
    run at that many queries each, not at ``queries``; a captured step runs without it).
    The pages: the step's ``keys`` gathered keys, each a page of one token (``read_index``
    ``None``); or the cache's own pages of ``page`` tokens, where ``read_index`` (the keys'
    rows in the cache, per row in order, a row starting on a page) says which."""
    rows = cu_q.shape[0] - 1
    # a power of two above the longest row's keys and the step's queries
    width = 1 << (-(-max(max_k, queries, 1) // page)).bit_length()
    stream = torch.cuda.current_stream(cu_q.device).cuda_stream if cu_q.is_cuda else 0
    capture = capturing(cu_q)
    bound = None
    if max_q is not None and not capture and 0 < max_q < queries:
        bound = min(queries, 1 << (max_q - 1).bit_length())  # a power of two: fewer shapes
    key = (threading.get_ident(), cu_q.device, stream, rows, width, page, queries, window, bound)
    found = _STEP_ROWS.get(key)
    if found is None:
        table = torch.zeros((rows, width), dtype=torch.int32, device=cu_q.device)
        lens = torch.zeros((rows,), dtype=torch.int32, device=cu_q.device)
        cu = torch.zeros((rows + 1,), dtype=torch.int32, device=cu_q.device)
        # made on zeros (valid tables for PagedKV's checks), filled whole below
        found = _StepRows(table, lens, cu, PagedKV(table, lens, cu, max_seqlen_q=bound))
        if len(_STEP_ROWS) >= _STEP_ROWS_KEPT:  # the oldest that no graph holds go
            for old in [k for k, rows_of in _STEP_ROWS.items() if not rows_of.captured]:
                del _STEP_ROWS[old]
                if len(_STEP_ROWS) < _STEP_ROWS_KEPT // 2:
                    break
        _STEP_ROWS[key] = found
    sources = (cu_q, cu_k) if read_index is None else (cu_q, cu_k, read_index)
    filled = (*(t._version for t in sources), keys)
    if (
        capture  # the graph must write the tables at each replay
        or len(found.sources) != len(sources)
        or any(a is not b for a, b in zip(found.sources, sources, strict=True))
        or found.filled != filled
    ):
        first = cu_k[:-1, None]  # (B, 1): each row's first key in the step's key order
        if read_index is None:  # gathered: the key itself
            slots = torch.arange(width, dtype=torch.int32, device=cu_q.device)
            table = (first + slots).clamp_(max=max(keys - 1, 0))
        else:  # the page of each row's first token of each of its pages
            starts = torch.arange(0, width * page, page, dtype=torch.int32, device=cu_q.device)
            at = (first + starts).clamp_(max=read_index.shape[0] - 1)
            table = read_index[at.long()] // page
        found.table.copy_(table)
        torch.sub(cu_k[1:], cu_k[:-1], out=found.lens)
        found.cu_q.copy_(cu_q)
        # after a capture the tables hold what the last replay wrote: written again next time
        found.sources, found.filled = ((), ()) if capture else (sources, filled)
        found.captured |= capture
    sum_key = (window, softcap)
    bias = found.sums.get(sum_key)
    if bias is None:
        bias = found.paged + causal_lower_right()
        if window is not None:
            bias = bias + SlidingWindowBias(window - 1)
        if softcap is not None:
            bias = bias + SoftcapBias(softcap)
        found.sums[sum_key] = bias
    return bias


def _cache_pages(cache: Any, layer_idx: int) -> Any:
    """The allocator of ``layer_idx`` where each row's keys lie in the cache's pages in order
    (full attention: row ``b``'s token ``t`` in page ``t // page_size`` of its pages), else
    ``None`` (a sliding window's ring of slots, another allocator, a transformers whose cache
    is laid out otherwise: the keys are then gathered)."""
    try:
        from transformers.generation.continuous_batching.cache_allocators.full_attention import (
            FullAttentionCacheAllocator,
        )
    except ImportError:
        return None
    allocator = getattr(cache, "layer_to_allocator", {}).get(layer_idx)
    needed = ("index", "tokens_per_page", "get_cache_for_block_table")
    if type(allocator) is not FullAttentionCacheAllocator or not all(
        hasattr(allocator, name) for name in needed
    ):
        return None
    return allocator


def _host_int(value: Any) -> int | None:
    """``value`` where it is a Python int (transformers' bound on a step's queries per row),
    else ``None``."""
    return value if type(value) is int else None


@functools.cache
def _updates_by_indices(cache_type: Any) -> bool:
    """Whether ``cache_type.update`` takes the read and write indices as arguments of their
    own (transformers before 5.19) rather than the step's arguments (``kwargs``)."""
    return "kwargs" not in inspect.signature(cache_type.update).parameters


def _update_by_indices(
    cache: Any, key: Tensor, value: Tensor, layer: int, step: dict[str, Any], window: Any
) -> tuple[Tensor, Tensor]:
    """Writes the step's keys into transformers' (before 5.19) paged cache, whose ``update``
    takes the indices one by one and gives every row's keys gathered ``(S, Hkv, E)``; the
    keys' lengths come in the step's arguments (per layer type where a dict), set in ``step``
    under the names :func:`_update` leaves them. The pools: the gathered keys as pages of
    one token."""
    key, value = cache.update(
        key_states=key,
        value_states=value,
        layer_idx=layer,
        read_index=step["read_index"],
        write_index=step["write_index"],
    )
    kind = "sliding_attention" if window else "full_attention"
    for given, used in (("cu_seq_lens_k", "cu_seq_lens_k"), ("max_seqlen_k", "max_length_k")):
        found = step[given]
        step[used] = found[kind] if isinstance(found, dict) else found
    return key.unsqueeze(1), value.unsqueeze(1)


def _update(
    cache: Any, key: Tensor, value: Tensor, layer: int, step: dict[str, Any]
) -> tuple[Tensor, Tensor, int, Tensor | None]:
    """Writes the step's keys into transformers' (5.19 and later) paged cache and gives the
    pools the call reads, their page size and, where they are the cache's own pages, the
    indices the keys would have been gathered by (``None`` for gathered keys)."""
    allocator = _cache_pages(cache, layer)
    read_index = None if allocator is None else step["read_index"][allocator.index]
    if read_index is not None and read_index.shape[0] == 0:
        read_index = None  # no cached key: the step's keys are the new ones
    if read_index is not None:
        # the cache's own pages, read in place: the new keys written (an update that reads
        # nothing back), then each row's pages from the indices it would have read
        indices = list(step["read_index"])
        indices[allocator.index] = read_index[:0]
        step["read_index"] = indices
        cache.update(key_states=key, value_states=value, layer_idx=layer, kwargs=step)
        pool_k, pool_v = allocator.get_cache_for_block_table(layer)
        return pool_k, pool_v, allocator.tokens_per_page, read_index
    key, value = cache.update(key_states=key, value_states=value, layer_idx=layer, kwargs=step)
    # (1, Hkv, S, E) -> pools of one-token pages (S, 1, Hkv, E), views
    pool_k, pool_v = (t[0].transpose(0, 1).unsqueeze(1) for t in (key, value))
    return pool_k, pool_v, 1, None


def paged_attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
    sliding_window: int | None = None,
    cache: Any = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention function for continuous batching (:data:`CB_IMPLEMENTATION`,
    inside :func:`continuous_batching`).

    Writes the step's new keys and values into transformers' paged cache (``cache.update``)
    and runs the packed rows as one :class:`attnbias.PagedKV` call: ``causal_lower_right()``
    per row, the layer's ``sliding_window`` (``SlidingWindowBias(W - 1)``) and soft-cap, its
    ``scaling``; no mask. Full-attention layers read the cache's own pages in place (the
    pages of each row found from the indices transformers would read them back by); layers
    whose cache is a sliding window's ring of slots read the keys ``cache.update`` gathers,
    each a page of one token.

    Args:
        module: the attention layer (its ``layer_idx`` and ``is_causal`` are read).
        query: ``(1, Hq, L, E)``, the step's query tokens packed (rows by ``cu_seq_lens_q``).
        key: ``(1, Hkv, L, E)``, the step's new keys (``value`` likewise).
        attention_mask: ``None`` (continuous batching builds none for this implementation).
        cache: transformers' ``PagedAttentionCache``; the step's ``cu_seq_lens_q``,
            ``cu_seq_lens_k``, ``max_length_k``, ``read_index`` and ``write_index`` come in
            ``kwargs``.

    Returns:
        ``(attn_output, None)``: ``(1, L, Hq, E)``, contiguous.

    Raises:
        ValueError: called without a paged cache (outside continuous batching: load the model
            with ``attn_implementation="attnbias"``), for a layer that is not causal, with a
            mask, or with attention sinks (``s_aux``).
        NotImplementedError: the cache's block-table decode path (continuous batching's
            ``max_blocks_per_request`` > 0), which writes the cache inside the attention call.
    """
    from transformers.generation.continuous_batching import PagedAttentionCache

    name = type(module).__name__
    if not isinstance(cache, PagedAttentionCache):
        raise ValueError(
            f"attnbias: {name} ran {CB_IMPLEMENTATION!r} without transformers' paged cache; it "
            f"serves continuous batching only (inside attnbias.integrations.transformers."
            f"continuous_batching(model)); load the model with attn_implementation="
            f"{ATTN_IMPLEMENTATION!r} for other calls"
        )
    if kwargs.get("s_aux") is not None:
        raise ValueError(
            f"attnbias: {name} passes attention sinks (s_aux), which attnbias.sdpa does not "
            f"compute; batch it with attn_implementation='paged|eager'"
        )
    if kwargs.get("block_table") is not None:
        raise NotImplementedError(
            f"attnbias: {name} got the paged cache's block table (its decode path that writes "
            f"the cache inside the attention call); pass ContinuousBatchingConfig("
            f"max_blocks_per_request=0)"
        )
    if attention_mask is not None:
        raise ValueError(
            f"attnbias: {name} got a {type(attention_mask).__name__} attention_mask in "
            f"continuous batching; {CB_IMPLEMENTATION!r} builds its rows from the cache's "
            f"sequence lengths and takes no mask"
        )
    is_causal = kwargs.get("is_causal")
    if not (getattr(module, "is_causal", True) if is_causal is None else is_causal):
        raise ValueError(
            f"attnbias: {name} is not causal; continuous batching generates with causal layers"
        )
    step = dict(kwargs)  # cache.update sets the layer's cu_seq_lens_k and max_length_k in it
    layer = cast(int, module.layer_idx)  # an attribute nn.Module's types do not know
    if _updates_by_indices(cast(Any, type(cache))):
        pool_k, pool_v = _update_by_indices(cache, key, value, layer, step, sliding_window)
        page, read_index = 1, None
    else:
        pool_k, pool_v, page, read_index = _update(cache, key, value, layer, step)
    bias = _step_bias(
        step["cu_seq_lens_q"],
        step["cu_seq_lens_k"],
        int(step["max_length_k"]),
        query.shape[2],
        sliding_window,
        softcap,
        keys=pool_k.shape[0] if read_index is None else 0,
        read_index=read_index,
        page=page,
        max_q=_host_int(step.get("max_length_q", step.get("max_seqlen_q"))),
    )
    output = sdpa(
        query,
        pool_k,
        pool_v,
        attn_mask=bias,
        dropout_p=dropout,
        scale=scaling,
        enable_gqa=query.shape[1] != pool_k.shape[2],
    )
    return output.transpose(1, 2).contiguous(), None


def _cb_name() -> str:
    """:data:`CB_IMPLEMENTATION` as the installed transformers' batching reads it: with the
    ``paged|`` prefix before 5.19 (which would otherwise add it and look the name up again)."""
    import transformers

    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    return f"paged|{CB_IMPLEMENTATION}" if (major, minor) < (5, 19) else CB_IMPLEMENTATION


@contextlib.contextmanager
def continuous_batching(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Run ``model``'s continuous batching (``generate_batch``, ``init_continuous_batching``,
    ``continuous_batching_context_manager``) on attnbias inside this block::

        with attnbias_hf.continuous_batching(model):
            outputs = model.generate_batch(prompts, generation_config=config)

    Sets the model's attention implementation to :data:`CB_IMPLEMENTATION` (registering it
    if needed) and restores the one it had on leaving; a batching manager must not outlive
    the block. Pass ``ContinuousBatchingConfig(max_blocks_per_request=0)`` if you set that
    option (the block-table decode path writes the cache inside the attention call).

    With CUDA graphs (transformers' default here), ``generate_batch`` and a new manager's
    ``warmup()`` first run the largest step: one made-up request of the most new tokens a
    step takes reading as many cached keys as the cache holds, a full attention of that size
    in every layer (seconds for a 1B model with a cache of millions of tokens). Pass
    ``warmup=False`` to ``generate_batch`` (each step's graph is captured when first met, the
    graphs' memory pool growing with the largest step met), or warm one persistent manager up
    once and reuse it.
    """
    register()
    config = getattr(model, "config", None)
    if config is None:
        raise TypeError(
            f"attnbias: continuous_batching takes a transformers model, got "
            f"{type(model).__name__} (it has no config)"
        )
    previous = config._attn_implementation
    # set on the config directly: set_attn_implementation() would look the name up as a
    # FlashAttention package, since it contains "flash"
    config._attn_implementation = _cb_name()
    try:
        yield model
    finally:
        config._attn_implementation = previous


# --------------------------------------------------------------------------------------------
# Explaining a model's routes


@dataclass(frozen=True)
class _LayerRoute:
    module: Any
    bias: AttnBias | None
    route: str


# The routes of the calls made inside explain_model(), per thread and task.
_RECORDER: contextvars.ContextVar[list[_LayerRoute] | None] = contextvars.ContextVar(
    "attnbias_transformers_recorder", default=None
)


def explain_model(model: torch.nn.Module, *args: Any, **kwargs: Any) -> str:
    """Run ``model(*args, **kwargs)`` once without gradients and say, for each attention call,
    the bias it ran with and the route :func:`attnbias.sdpa` took (the first line of
    :func:`attnbias.explain`), one line a call::

        >>> print(explain_model(model, input_ids, attention_mask=padding))  # doctest: +SKIP
        layer 0 Gemma2Attention: CausalBias(LOWER_RIGHT) + SlidingWindowBias(...) + ...
          triton: band -4095 <= j - i <= 0, soft-cap 50 runs in the block-sparse Triton kernel...

    The model must have been loaded with ``attn_implementation="attnbias"``.
    """
    routes: list[_LayerRoute] = []
    token = _RECORDER.set(routes)
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        _RECORDER.reset(token)
    if not routes:
        raise ValueError(
            f"explain_model: {type(model).__name__} made no attention call through attnbias; "
            f"load it with attn_implementation={ATTN_IMPLEMENTATION!r} after register()"
        )
    lines = []
    for call in routes:
        layer = getattr(call.module, "layer_idx", None)
        where = f"layer {layer} " if layer is not None else ""
        lines.append(f"{where}{type(call.module).__name__}: {call.bias!r}")
        lines.append(f"  {call.route.splitlines()[0]}")
    return "\n".join(lines)
