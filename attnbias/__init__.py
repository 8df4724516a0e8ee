"""Bias objects for scaled dot product attention, run on the fastest exact kernel."""

from importlib import metadata as _metadata

from attnbias.biases import (
    AlibiBias,
    AttnBias,
    CausalBias,
    CausalVariant,
    DocumentBias,
    KeyRangeBias,
    ModBias,
    PagedKV,
    SlidingWindowBias,
    SoftcapBias,
    TensorBias,
    causal_lower_right,
    causal_upper_left,
)
from attnbias.functional import check_errors, explain, patch_sdpa, sdpa
from attnbias.planner import use_backends
from attnbias.routing import clear_routing, set_routing, sync_routing

try:
    __version__: str = _metadata.version("attnbias")
except _metadata.PackageNotFoundError:  # run from a source tree that was not installed
    __version__ = "0+unknown"

__all__ = [
    "AlibiBias",
    "AttnBias",
    "CausalBias",
    "CausalVariant",
    "DocumentBias",
    "KeyRangeBias",
    "ModBias",
    "PagedKV",
    "SlidingWindowBias",
    "SoftcapBias",
    "TensorBias",
    "__version__",
    "causal_lower_right",
    "causal_upper_left",
    "check_errors",
    "clear_routing",
    "explain",
    "patch_sdpa",
    "sdpa",
    "set_routing",
    "sync_routing",
    "use_backends",
]
