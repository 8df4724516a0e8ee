"""The routing policy, as data: which backends a call tries, in what order.

Mechanism lives in the backends (each states what it can run, ``attnbias.backends``) and in the
walk (``attnbias.planner``); this module holds only the tables, set from the measurements in
``benchmarks/RESULTS.md`` and ``benchmarks/DECODE_RESULTS.md`` (the reasoning behind each entry
is in ``benchmarks/NOTES.md``). Adding a backend touches its own module and these tables.
"""

from __future__ import annotations

from dataclasses import dataclass

from attnbias.kinds import Form, Kind

__all__ = [
    "CAPTURED_FA4_FIRST",
    "COSTS",
    "FALLBACK",
    "FORM_ROUTES",
    "MOD_MASK_FA4_MIN_KEYS",
    "PRIORITY",
    "SWITCH_FACTOR",
    "CapturedFa4First",
    "Cost",
    "Order",
]


@dataclass(frozen=True)
class Order:
    """Backends to try first, for calls without and with gradients (``training``)."""

    inference: tuple[str, ...]
    training: tuple[str, ...] | None = None

    def pick(self, needs_grad: bool) -> tuple[str, ...]:
        return self.training if needs_grad and self.training is not None else self.inference


@dataclass(frozen=True)
class CapturedFa4First:
    """Decodes that, captured in a CUDA graph, try FlashAttention 4 before the decode kernel:
    masks of these ``kinds``, without gradients, with at least ``min_rows`` packed rows
    (``Hq / Hkv * L``) whose queries keep keys from a range of at most ``max_keys``."""

    kinds: frozenset[Kind]
    min_rows: int
    max_keys: int


# Per kind of bias (``Terms.kind``), the backends to try first; every backend a list leaves
# out follows in FALLBACK order. On Hopper FlashAttention 4 is the fastest on every kind it
# takes but ALiBi without gradients (the Triton kernel is as fast there); the decode kernel
# comes first because it takes only short queries without gradients, where it is fastest
# when called eagerly (FlashAttention 4's host time is far above their GPU time). The Gluon
# forward (no gradients; no mask, bands, documents, ALiBi, soft-cap) follows the Triton kernel
# or stock SDPA: its GPU time is lower from a few thousand keys on, its host time per call
# above theirs, so it is the choice where routing measures it faster, and the planner's own
# choice stays where nothing is measured (benchmarks/NOTES.md, "The Gluon forward in the
# routing lists").
_HOPPER: dict[Kind, Order] = {
    Kind.NONE: Order(("triton-decode", "fa4", "sdpa", "gluon"), training=("fa4", "sdpa")),
    Kind.CAUSAL: Order(
        ("triton-decode", "fa4", "sdpa", "gluon", "triton"), training=("fa4", "sdpa", "triton")
    ),
    Kind.BAND: Order(("triton-decode", "fa4", "triton", "gluon"), training=("fa4", "triton")),
    # Stock SDPA takes documents only where they are of one length (chunked attention), as
    # separate sequences: faster than FlashAttention 4 where its host time shows, slower where
    # the GPU's time decides, so the weighing below picks (benchmarks/NOTES.md, "Documents of
    # one length on stock SDPA").
    Kind.DOCUMENTS: Order(
        ("triton-decode", "fa4", "sdpa", "triton", "gluon"), training=("fa4", "sdpa", "triton")
    ),
    Kind.SOFTCAP: Order(("triton-decode", "fa4", "triton", "gluon"), training=("fa4", "triton")),
    Kind.ALIBI: Order(("triton-decode", "triton", "gluon", "fa4"), training=("fa4", "triton")),
    # ModBias functions: FlashAttention 4 with generated callbacks and block sparsity where it
    # takes them (on capability 9 only), the Triton kernels otherwise. In training FA4 first
    # (faster on most examples); without gradients masks alone ("mod mask") FA4 first, score
    # functions ("mod") the Triton kernel first, where FA4 was slower (the figures:
    # benchmarks/NOTES.md, "Figures behind the code's choices").
    Kind.MOD_MASK: Order(("triton-decode", "fa4", "triton"), training=("fa4", "triton")),
    Kind.MOD: Order(("triton-decode", "triton", "fa4"), training=("fa4", "triton")),
}
# ModBias masks without gradients take FlashAttention 4 first (the "mod mask" order above) only
# where their block lists visit at least this many keys per block of query rows; below, the
# Triton kernel first (the "mod" order): FA4 wins on long lists and loses on short ones, and the
# threshold sits between the two groups measured (benchmarks/NOTES.md, "Figures behind the
# code's choices").
MOD_MASK_FA4_MIN_KEYS = 1536
# Blackwell follows Hopper, unmeasured, but for ModBias functions, whose FlashAttention 4 form
# is laid out for Hopper's kernels, and the Gluon forward, written for Hopper only.
_BLACKWELL: dict[Kind, Order] = {
    kind: Order(
        tuple(name for name in order.inference if name != "gluon"),
        None if order.training is None else tuple(n for n in order.training if n != "gluon"),
    )
    for kind, order in _HOPPER.items()
    if kind not in (Kind.MOD, Kind.MOD_MASK)
}
# Other GPUs and the CPU: stock SDPA where it fuses the mask, then the library's kernels.
_DEFAULT: dict[Kind, Order] = {
    Kind.NONE: Order(("sdpa",)),
    Kind.CAUSAL: Order(("sdpa", "triton-decode", "triton")),
    Kind.DOCUMENTS: Order(("sdpa", "triton-decode", "triton")),  # equal documents only, as above
}
# Per GPU generation (``planner.generation``).
PRIORITY: dict[str, dict[Kind, Order]] = {
    "hopper": _HOPPER,
    "blackwell": _BLACKWELL,
    "cuda": _DEFAULT,
    "cpu": _DEFAULT,
}
FALLBACK = ("triton-decode", "triton", "sdpa", "sdpa+mask", "reference")

# A call captured in a CUDA graph pays its host time once, at capture: on these decodes
# FlashAttention 4's GPU time was lower than the decode kernel's in CUDA-graph replays.
CAPTURED_FA4_FIRST = CapturedFa4First(
    kinds=frozenset({Kind.CAUSAL, Kind.BAND}), min_rows=16, max_keys=8192
)


@dataclass(frozen=True)
class Cost:
    """What a call costs on a backend, per GPU generation: host time per call (µs: validation,
    planning, launches, the backend's own Python side) and the GPU's rate on the pairs a call
    keeps (TFLOP/s, counting 4·E flops per kept pair and head forward, 3.5 times that forward
    and backward), for calls without gradients and for training calls (forward + backward
    through autograd)."""

    host_us: float
    host_us_training: float
    tflops: float
    tflops_training: float


# Per GPU generation, the backends the planner weighs against each other (others are never
# moved ahead of the priority list's choice). Hopper: rates on causal bf16 calls at head dim
# 128 (benchmarks/RESULTS.md: FlashAttention 4 ~570 / 510 TFLOP/s, cuDNN through stock SDPA
# ~540 / 450, the Triton kernel ~400 / 350); host times of whole calls issued back to back on
# an H100 host at shapes from 1x1x128x64 to 1x16x2048x128 (benchmarks/NOTES.md, "Host time
# per backend"): FlashAttention 4 130-250 µs forward, 800-1000 forward + backward; the Triton
# kernel 30-75 and 780-1130; stock SDPA 40-60 and 310-380.
_HOPPER_COSTS: dict[str, Cost] = {
    "fa4": Cost(host_us=200.0, host_us_training=850.0, tflops=570.0, tflops_training=510.0),
    "sdpa": Cost(host_us=45.0, host_us_training=330.0, tflops=540.0, tflops_training=450.0),
    "triton": Cost(host_us=45.0, host_us_training=950.0, tflops=400.0, tflops_training=350.0),
}
COSTS: dict[str, dict[str, Cost]] = {"hopper": _HOPPER_COSTS, "blackwell": _HOPPER_COSTS}
# The planner leaves the priority list's choice for a weighed backend only when that one is
# predicted this many times faster: the lists are measured, the predictions are estimates.
SWITCH_FACTOR = 1.5

# The calls that are not a bias object lowering into the kernels' terms (``spec.FORMS``) have
# one route each, whatever the GPU and whatever use_backends says: a plain tensor mask and no
# mask go to stock SDPA unchanged, a bias that needs materialization to stock SDPA with its
# mask, a bias class with its own dispatch to that dispatch, and a call with no output element
# to no kernel at all.
FORM_ROUTES: dict[Form, str] = {
    Form.EMPTY: "empty",
    Form.TENSOR: "sdpa",
    Form.NO_MASK: "sdpa",
    Form.MATERIALIZE: "sdpa+mask",
    Form.DISPATCH: "dispatch",
}
