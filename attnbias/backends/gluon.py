"""The library's Hopper forward written in Triton's Gluon dialect (``kernels/gluon_forward.py``):
warp-specialized, two consumer warpgroups taking turns with their MMAs, TMA loads from a
producer warp (benchmarks/RESULTS.md, "A Hopper forward in Gluon"). On Hopper the priority
lists name it for calls without gradients after stock SDPA (no mask, causal) or the Triton
kernel (bands), so routing by measurement times it and takes it where it is faster;
``use_backends("gluon")`` pins it."""

from __future__ import annotations

import functools
import importlib.util
import inspect

import torch
from torch import Tensor

from attnbias.backends.base import Backend, Prepared
from attnbias.kernels.limits import MAX_ALIBI_LENGTH
from attnbias.kinds import Kind
from attnbias.spec import Spec

__all__ = ["GluonForward", "gluon_ready"]

# The head dims offered (of kernels/gluon_forward.py's HEAD_DIMS, repeated here so that planning
# imports no kernel module). At 256 the kernel (two stages of 64 keys) ran at the Triton kernel's
# speed and 0.55-0.6x stock SDPA's on an H200 (benchmarks/NOTES.md, "The Gluon forward at head
# dims 64 and 256"): not offered, so that routing spends no time on it.
_HEAD_DIMS = (64, 128)
_KINDS = (Kind.NONE, Kind.CAUSAL, Kind.BAND, Kind.DOCUMENTS, Kind.ALIBI, Kind.SOFTCAP)


@functools.cache
def gluon_ready() -> str | None:
    """Why the Gluon kernel cannot be built with the installed Triton (``None``: it can):
    Gluon's Hopper modules, and ``warp_specialize`` taking a list of (function, arguments)
    pairs (Triton 3.6 onwards)."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    try:
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.language.nvidia import hopper  # noqa: F401
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: F401
    except ImportError as error:
        return f"Triton's Gluon dialect for Hopper is not importable ({error})"
    parameters = list(inspect.signature(gl.warp_specialize).parameters)
    if not parameters or parameters[0] != "functions_and_args":
        return (
            "this Triton's gl.warp_specialize takes other arguments than the kernel was written "
            "for (a list of (function, arguments) pairs, as in Triton 3.6)"
        )
    return None


def _on_cuda(device: torch.device) -> bool:
    return device.type == "cuda"


def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _layout(x: Tensor) -> str | None:
    from attnbias.kernels.gluon_forward import layout_of

    return layout_of(x)


class GluonForward(Backend):
    """No mask or a band (causal in either alignment, sliding windows), packed documents,
    ALiBi and a soft-cap, fp16 / bf16, head dims 64 and 128, GQA, ``(B, H, L, E)`` tensors or
    ``(B, L, H, E)`` memory seen as ``(B, H, L, E)``, on Hopper (capability 9.x), forward
    only. A row that keeps no key gives 0; nothing past a row's ``S`` keys is read (TMA fills
    it with zeros)."""

    name = "gluon"
    dtypes = (torch.float16, torch.bfloat16)

    def reasons(self, spec: Spec) -> list[str]:
        reasons = []
        device = spec.device
        on_cuda = _on_cuda(device)
        if not on_cuda:
            reasons.append(f"the Gluon kernel needs CUDA tensors and these are on {device.type}")
        elif (capability := _capability(device))[0] != 9:
            major, minor = capability
            reasons.append(
                f"the Gluon kernel is written for Hopper (capability 9.x); this GPU is "
                f"{major}.{minor}"
            )
        if spec.needs_grad:
            reasons.append(
                "the Gluon kernel is forward only (its backward is not written yet); the "
                "inputs or the bias's tensors require grad"
            )
        if spec.dropout_p > 0.0:
            reasons.append(f"dropout_p={spec.dropout_p} is not fused in the Gluon kernel")
        if spec.compiling:
            reasons.append("the Gluon kernel is not registered for torch.compile to trace")
        terms = spec.terms
        if terms.kind not in _KINDS or terms.has_key_range:
            reasons.append(
                f"the Gluon kernel takes no mask, a band (causal, windows), documents, ALiBi and "
                f"soft-cap; not {terms.describe()}"
            )
        elif terms.slopes is not None:
            if terms.alibi_shift:
                reasons.append(
                    f"ALiBi shifted by {terms.alibi_shift} (a shard pair's) is not in the Gluon "
                    f"kernel"
                )
            _, _, length_q, length_kv = spec.shape
            if max(length_q, length_kv) > MAX_ALIBI_LENGTH:
                reasons.append(
                    f"ALiBi distances in (L, S)=({length_q}, {length_kv}) exceed "
                    f"{MAX_ALIBI_LENGTH}, beyond which the kernel's float32 distances are inexact"
                )
        if spec.head_dim not in _HEAD_DIMS or spec.head_dim_v != spec.head_dim:
            reasons.append(
                f"head dims (E, Ev)=({spec.head_dim}, {spec.head_dim_v}): the Gluon kernel "
                f"takes E = Ev in {_HEAD_DIMS}"
            )
        if spec.shape[3] == 0:
            reasons.append("S=0: the Gluon kernel needs at least one key")
        if spec.resolved_scale <= 0.0:
            reasons.append(f"scale={spec.resolved_scale}: the Gluon kernel takes scale > 0")
        problem = gluon_ready()
        if problem is not None:
            reasons.append(problem)
        elif on_cuda and not reasons:
            found = [_layout(x) for x in (spec.query, spec.key, spec.value)]
            if found[0] is None or found[1] is None or found[1] != found[2]:
                reasons.append(
                    f"strides q {tuple(spec.query.stride())}, k {tuple(spec.key.stride())}, v "
                    f"{tuple(spec.value.stride())}: the Gluon kernel's TMA descriptors take "
                    f"(B, H, L, E) tensors or (B, L, H, E) memory, 16-byte aligned, keys and "
                    f"values laid out alike"
                )
        return reasons

    def how(self, spec: Spec) -> str:
        return (
            "the Gluon forward (warp-specialized, ping-pong, TMA), its key loop bounded to the "
            "blocks the band and the documents keep"
        )

    def run(self, spec: Spec) -> Tensor:
        return self.prepare(spec)(spec.query, spec.key, spec.value)

    def prepare(self, spec: Spec) -> Prepared:
        """The band, the scale and the score terms bound once (the documents' ranges are read
        at each call); a call launches with its tensors. The plan cache's key holds the
        shapes, dtypes and strides the reasons were checked on, not the data pointers' 16-byte
        alignment, which the TMA descriptors need: a call with a misaligned tensor runs on
        aligned copies of its inputs (the output then contiguous)."""
        from attnbias.kernels.gluon_forward import gluon_forward, plan_gluon_forward

        program = spec.program
        band_lo, band_hi, scale = program.band_lo, program.band_hi, spec.resolved_scale
        terms = {
            "softcap": program.softcap,
            "slopes": program.alibi_slopes,
            "documents": None if program.q_doc is None else (program.q_doc, program.kv_doc),
        }
        planned = plan_gluon_forward(
            spec.query, spec.key, spec.value, band_lo, band_hi, scale, **terms
        )

        def run_prepared(query: Tensor, key: Tensor, value: Tensor) -> Tensor:
            if (query.data_ptr() | key.data_ptr() | value.data_ptr()) % 16:
                query, key, value = (
                    x.clone(memory_format=torch.contiguous_format) for x in (query, key, value)
                )
                return gluon_forward(query, key, value, band_lo, band_hi, scale, **terms)
            return planned(query, key, value)

        return run_prepared
