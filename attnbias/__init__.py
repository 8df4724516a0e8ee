"""Bias objects for scaled dot product attention, run on the fastest exact kernel."""

from attnbias.biases import (
    AlibiBias,
    AttnBias,
    CausalBias,
    CausalVariant,
    DocumentBias,
    KeyRangeBias,
    ModBias,
    SlidingWindowBias,
    SoftcapBias,
    TensorBias,
    causal_lower_right,
    causal_upper_left,
)
from attnbias.functional import explain, patch_sdpa, sdpa
from attnbias.planner import use_backends

__all__ = [
    "AlibiBias",
    "AttnBias",
    "CausalBias",
    "CausalVariant",
    "DocumentBias",
    "KeyRangeBias",
    "ModBias",
    "SlidingWindowBias",
    "SoftcapBias",
    "TensorBias",
    "causal_lower_right",
    "causal_upper_left",
    "explain",
    "patch_sdpa",
    "sdpa",
    "use_backends",
]
