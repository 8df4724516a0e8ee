"""Cases that run in one dtype each, in turn, where the kernels are interpreted (a case costs
seconds there), and in every dtype where they are compiled."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TypeVar

import torch

Case = TypeVar("Case")


def in_turn(
    cases: Iterable[Case], dtypes: Sequence[tuple[torch.dtype, str]], interpreted: bool
) -> list[tuple[Case, torch.dtype, str]]:
    """``(case, dtype, label)`` for every case and every dtype of ``dtypes`` (``(dtype,
    label)`` pairs); where ``interpreted``, the ``i``-th case in the ``i % len(dtypes)``-th
    dtype only, so that each dtype still runs, over its share of the cases."""
    return [
        (case, dtype, label)
        for index, case in enumerate(cases)
        for turn, (dtype, label) in enumerate(dtypes)
        if not interpreted or index % len(dtypes) == turn
    ]
