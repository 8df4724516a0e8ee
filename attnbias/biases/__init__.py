"""The bias kinds, one module each, and the base class they derive from."""

from attnbias.biases.alibi import AlibiBias, alibi_slopes
from attnbias.biases.band import BandBias
from attnbias.biases.base import AttnBias, CompositeBias, KernelBias, KernelMask, parts_of
from attnbias.biases.causal import (
    CausalBias,
    CausalVariant,
    causal_lower_right,
    causal_upper_left,
)
from attnbias.biases.documents import DocumentBias
from attnbias.biases.key_range import KeyRangeBias
from attnbias.biases.mod import ModBias
from attnbias.biases.paged import PagedKV
from attnbias.biases.softcap import SoftcapBias
from attnbias.biases.tensor import TensorBias
from attnbias.biases.window import SlidingWindowBias

__all__ = [
    "AlibiBias",
    "AttnBias",
    "BandBias",
    "CausalBias",
    "CausalVariant",
    "CompositeBias",
    "DocumentBias",
    "KernelBias",
    "KernelMask",
    "KeyRangeBias",
    "ModBias",
    "PagedKV",
    "SlidingWindowBias",
    "SoftcapBias",
    "TensorBias",
    "alibi_slopes",
    "causal_lower_right",
    "causal_upper_left",
    "parts_of",
]
