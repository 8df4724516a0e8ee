"""Triton block-sparse flash-attention kernels.

Importing this package does not import Triton: each name below loads its module on first
access (module ``__getattr__``), so CPU-only users of ``attnbias`` never pay for Triton.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["attention_backward", "attention_forward", "block_sparse_attention", "decode_forward"]

_MODULE_OF = {
    "attention_backward": ".backward",
    "attention_forward": ".forward",
    "block_sparse_attention": ".ops",
    "decode_forward": ".decode",
}

if TYPE_CHECKING:
    from .backward import attention_backward
    from .decode import decode_forward
    from .forward import attention_forward
    from .ops import block_sparse_attention


def __getattr__(name: str) -> Any:
    if name in _MODULE_OF:
        value = getattr(importlib.import_module(_MODULE_OF[name], __name__), name)
        globals()[name] = value  # later lookups find it without this hook
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
