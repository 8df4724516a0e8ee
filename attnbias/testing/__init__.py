"""Testing a bias: :func:`check_bias` runs it on every route it can take here against an fp64
oracle in eager PyTorch; :mod:`attnbias.testing.strategies` (needs ``hypothesis``) draws valid
attention problems and built-in biases to sum with yours; :mod:`attnbias.testing.oracle` is
the oracle and the error budget themselves.

Example (pytest)::

    import torch
    from attnbias import ModBias
    from attnbias.testing import check_bias

    def test_prefix_lm():
        prefix_lm = ModBias(mask_mod=lambda b, h, q, kv: (kv <= q) | (kv < 4))
        check_bias(prefix_lm)   # raises AssertionError naming the route that is off
"""

from attnbias.testing.check import DEFAULT_SHAPES, CheckReport, check_bias

__all__ = ["DEFAULT_SHAPES", "CheckReport", "check_bias"]
