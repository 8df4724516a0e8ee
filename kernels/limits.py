"""What the kernels take, importable without Triton (the front-end checks calls against it)."""

import os

import torch

__all__ = ["DTYPES", "MAX_ALIBI_LENGTH", "MAX_DECODE_QUERIES", "MAX_HEAD_DIM", "interpreting"]

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# One tile holds the whole head dim (rounded up to a power of two), and values share it.
MAX_HEAD_DIM = 256
# ALiBi distances |i + S - L - j| are computed in float32, exact for integers up to 2^24.
MAX_ALIBI_LENGTH = 2**24
# The decode kernel packs the query heads of a key/value group and the queries into tiles of
# rows: it serves short queries (decoding, speculative decoding), up to this many.
MAX_DECODE_QUERIES = 64


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``, CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET") == "1"
