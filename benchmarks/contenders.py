"""The contenders: each prepares, for one case and its inputs, a forward call whose output and
gradients are checked against the reference and then timed."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import attnbias

# isort: split
# Siblings, found through the folder of bench.py on sys.path.
from cases import Case, Config, Inputs

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import FlexKernelOptions

Forward = Callable[[], Tensor]


@dataclass
class Prepared:
    forward: Forward
    note: str = ""
    has_backward: bool = True


class NotApplicable(Exception):
    """The contender cannot express this case at all (no row is reported)."""


class Skipped(Exception):
    """The contender applies but is not run here (a row with the reason is reported)."""


def describe(exc: BaseException) -> str:
    """The exception's type and the first line of its message, for a one-line note."""
    # torch.compile wraps what a backend raised; the inner exception says why.
    inner = getattr(exc, "inner_exception", None)
    while isinstance(inner, BaseException):
        exc, inner = inner, getattr(inner, "inner_exception", None)
    text = str(exc).strip()
    message = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {message[:160]}"


def prepare_attnbias(case: Case, inputs: Inputs, cfg: Config) -> Prepared:
    bias = case.make_bias()
    q, k, v = inputs.leaves()
    return Prepared(lambda: attnbias.sdpa(q, k, v, attn_mask=bias))


def _prepare_pinned(
    backend: str, case: Case, inputs: Inputs, cfg: Config, forward_only: bool = False
) -> Prepared:
    """attnbias on one backend: the measurements behind the planner's priority lists. A
    ``forward_only`` backend is called without gradients (no forward + backward row)."""
    bias = case.make_bias()
    q, k, v = inputs.leaves()
    grad = torch.no_grad if forward_only else contextlib.nullcontext

    def forward() -> Tensor:
        with grad(), attnbias.use_backends(backend):
            return attnbias.sdpa(q, k, v, attn_mask=bias)

    try:
        forward()
    except ValueError as exc:  # the backend cannot take this case: its reasons
        raise Skipped(str(exc).split(". ", 1)[-1]) from exc
    if forward_only:
        return Prepared(forward, note="forward only", has_backward=False)
    return Prepared(forward)


def _prepare_flex(
    case: Case, inputs: Inputs, cfg: Config, kernel_options: FlexKernelOptions | None = None
) -> Prepared:
    q, k, v = inputs.leaves()
    _, _, q_len, _ = q.shape
    kv_len = k.shape[2]
    block_mask = None
    if case.mask_mod is not None:
        # The masks do not depend on batch or head, so one (1, 1) block mask broadcasts.
        block_mask = create_block_mask(case.mask_mod, None, None, q_len, kv_len, device=q.device)
    score_mod = case.score_mod
    if cfg.compile_flex:
        flex = torch.compile(flex_attention, dynamic=False)
        return Prepared(
            lambda: flex(
                q,
                k,
                v,
                score_mod=score_mod,
                block_mask=block_mask,
                kernel_options=kernel_options,
            )
        )

    # Uncompiled FlexAttention (the CPU smoke run) has no backward: check the forward only.
    def forward() -> Tensor:
        return flex_attention(
            q.detach(), k.detach(), v.detach(), score_mod=score_mod, block_mask=block_mask
        )

    return Prepared(forward, "uncompiled, forward only", has_backward=False)


def prepare_flex(case: Case, inputs: Inputs, cfg: Config) -> Prepared:
    return _prepare_flex(case, inputs, cfg)


def _flash_attn_cute() -> Any:
    """FlashAttention 4's module; Skipped where it cannot be imported."""
    try:
        import flash_attn.cute
    except Exception as exc:  # absent, or present without the CUDA libraries it loads
        raise Skipped(
            f"flash_attn.cute (FlashAttention 4) not importable: {describe(exc)}"
        ) from exc
    return flash_attn.cute


def prepare_flex_flash(case: Case, inputs: Inputs, cfg: Config) -> Prepared:
    _flash_attn_cute()
    if cfg.device.type != "cuda" or not cfg.compile_flex:
        raise Skipped("FlexAttention's FLASH backend needs CUDA and torch.compile")
    prepared = _prepare_flex(case, inputs, cfg, kernel_options={"BACKEND": "FLASH"})
    # Compiling here turns a case the FLASH backend rejects into a skipped row that gives
    # its reason, instead of a failed run.
    try:
        prepared.forward()
    except Exception as exc:
        raise Skipped(f"the FLASH backend cannot run this case: {describe(exc)}") from exc
    return prepared


def prepare_fa4(case: Case, inputs: Inputs, cfg: Config) -> Prepared:
    args = case.flash
    if args is None:
        raise NotApplicable
    fa4 = _flash_attn_cute()
    if cfg.device.type != "cuda":
        raise Skipped("FlashAttention 4 needs CUDA")
    q, k, v = inputs.leaves()
    batch, heads, q_len, head_dim = q.shape
    kv_len = k.shape[2]
    # FlashAttention takes (B, S, H, E): transposed views of the (B, H, S, E) inputs, its
    # output transposed back.
    if args.doc_seqlens is None:

        def forward() -> Tensor:
            out = fa4.flash_attn_func(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                causal=args.causal,
                window_size=args.window_size,
                softcap=args.softcap,
            )[0]
            return out.transpose(1, 2)

        return Prepared(forward, "(B, S, H, E) views")

    if sum(args.doc_seqlens) != q_len or q_len != kv_len:
        raise NotApplicable
    # Every batch row holds the same documents; flattened, the rows' documents follow one
    # another as the variable-length sequences.
    seqlens = torch.tensor(args.doc_seqlens * batch, device=q.device)
    cu_seqlens = F.pad(seqlens.cumsum(0), (1, 0)).to(torch.int32)
    max_seqlen = max(args.doc_seqlens)

    def forward_varlen() -> Tensor:
        q_flat, k_flat, v_flat = (
            t.transpose(1, 2).reshape(batch * t.shape[2], heads, head_dim) for t in (q, k, v)
        )
        out = fa4.flash_attn_varlen_func(
            q_flat,
            k_flat,
            v_flat,
            cu_seqlens_q=cu_seqlens,
            cu_seqlens_k=cu_seqlens,
            max_seqlen_q=max_seqlen,
            max_seqlen_k=max_seqlen,
            causal=args.causal,
            window_size=args.window_size,
            softcap=args.softcap,
        )[0]
        return out.view(batch, q_len, heads, head_dim).transpose(1, 2)

    # With B > 1 the (B, H, S, E) inputs cannot flatten to (B·S, H, E) without a copy, which
    # the times include.
    note = "varlen, " + ("(B·S, H, E) views" if batch == 1 else "q, k, v copied to (B·S, H, E)")
    return Prepared(forward_varlen, note)


def _prepare_stock(case: Case, inputs: Inputs, backend: SDPBackend) -> Forward:
    if case.stock_is_causal is None:
        raise NotApplicable
    q, k, v = inputs.leaves()
    is_causal = case.stock_is_causal

    def forward() -> Tensor:
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)

    return forward


def prepare_sdpa_flash(case: Case, inputs: Inputs, cfg: Config) -> Prepared:
    return Prepared(_prepare_stock(case, inputs, SDPBackend.FLASH_ATTENTION))


def prepare_sdpa_cudnn(case: Case, inputs: Inputs, cfg: Config) -> Prepared:
    if case.stock_is_causal is not None and cfg.device.type != "cuda":
        raise Skipped("cuDNN needs CUDA")
    return Prepared(_prepare_stock(case, inputs, SDPBackend.CUDNN_ATTENTION))


def prepare_sdpa_mask(case: Case, inputs: Inputs, cfg: Config) -> Prepared:
    return _prepare_mask(case, inputs, cfg, backend=None)


def prepare_sdpa_eff_mask(case: Case, inputs: Inputs, cfg: Config) -> Prepared:
    if cfg.device.type != "cuda":
        raise Skipped("the memory-efficient kernel with a mask is measured on CUDA")
    return _prepare_mask(case, inputs, cfg, backend=SDPBackend.EFFICIENT_ATTENTION)


def _prepare_mask(case: Case, inputs: Inputs, cfg: Config, backend: SDPBackend | None) -> Prepared:
    if case.mask_mod is None and case.score_mod is None:
        raise NotApplicable
    if not case.materializable:
        raise Skipped("SoftcapBias cannot be materialised")
    q, k, v = inputs.leaves()
    batch, heads, q_len, _ = q.shape
    kv_len = k.shape[2]
    if cfg.device.type == "cuda":
        # Worst case: one mask value per (head, i, j), plus a temporary of the same size.
        worst_bytes = 2 * heads * q_len * kv_len * q.element_size()
        free_bytes, _ = torch.cuda.mem_get_info(cfg.device)
        if worst_bytes > 0.8 * free_bytes:
            raise Skipped(
                f"a materialised mask may need {worst_bytes / 2**30:.1f} GiB, "
                f"{free_bytes / 2**30:.1f} GiB free"
            )
    bias = case.make_bias()
    mask = bias.materialize(q.device, shape=(batch, heads, q_len, kv_len), dtype=q.dtype)
    # A 4-D view (leading singleton dims, no copy) lets stock SDPA pick cuDNN, which on
    # torch 2.11 / H100 is ~2.5x faster with a float mask than the memory-efficient kernel
    # it falls back to for a 3-D (H, L, S) mask. The peer gets its best stock route.
    mask = mask[(None,) * (4 - mask.dim())]

    def forward() -> Tensor:
        if backend is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    note = (
        f"{'default dispatch' if backend is None else 'pinned'} "
        f"({stock_backend_used(forward)}), mask "
        f"{'x'.join(map(str, mask.shape))} {mask.numel() * mask.element_size() / 2**20:.0f} MiB"
    )
    return Prepared(forward, note)


def stock_backend_used(forward: Forward) -> str:
    """Which of stock SDPA's kernels one call runs, read from the profiler's op names."""
    backends = {
        "aten::_scaled_dot_product_cudnn_attention": "cuDNN",
        "aten::_scaled_dot_product_efficient_attention": "efficient",
        "aten::_scaled_dot_product_flash_attention": "flash",
        "aten::_scaled_dot_product_flash_attention_for_cpu": "flash (CPU)",
        "aten::_scaled_dot_product_fused_attention_overrideable": "overrideable",
        "aten::_scaled_dot_product_attention_math": "math",
    }
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        forward()
    ops = {event.key for event in profile.key_averages()}
    used = [name for op, name in backends.items() if op in ops]
    return "+".join(used) if used else "unknown backend"


CONTENDERS: dict[str, Callable[[Case, Inputs, Config], Prepared]] = {
    "attnbias": prepare_attnbias,
    "attnbias-fa4": functools.partial(_prepare_pinned, "fa4"),
    "attnbias-triton": functools.partial(_prepare_pinned, "triton"),
    "attnbias-gluon": functools.partial(_prepare_pinned, "gluon", forward_only=True),
    "flex": prepare_flex,
    "flex-flash": prepare_flex_flash,
    "fa4": prepare_fa4,
    "sdpa-flash": prepare_sdpa_flash,
    "sdpa-cudnn": prepare_sdpa_cudnn,
    "sdpa-eff-mask": prepare_sdpa_eff_mask,
    "sdpa-mask": prepare_sdpa_mask,
}
CONTENDER_NAMES = tuple(CONTENDERS)
