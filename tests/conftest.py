"""Test configuration.

Without CUDA the Triton kernels run under Triton's interpreter on CPU tensors; the variable
must be set before Triton is first imported, which is why it is set here, at collection.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Routes as the policy gives them, and no decisions kept in the user's cache file: the
# tests of routing by measurement (tests/test_routing.py) switch it on themselves.
os.environ.setdefault("ATTNBIAS_ROUTING", "policy")
os.environ.setdefault("ATTNBIAS_ROUTING_CACHE", "off")

import pytest
from hypothesis import settings

if os.environ.get("TRITON_INTERPRET") == "1":
    from interpreter_calls import skip_repatching

    skip_repatching()

settings.register_profile("dev", max_examples=25, deadline=None)
settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True, print_blob=True)
settings.register_profile("thorough", max_examples=300, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _fresh_plan_cache() -> None:
    """Tests fake GPUs and backends: no test may run on a decision another test cached."""
    from attnbias import plan_cache

    plan_cache.clear()


@pytest.fixture
def generated_mods(monkeypatch: pytest.MonkeyPatch) -> None:
    """ModBias masks that are a band or equal chunks run as their functions, not as the
    built-ins they are (``ModBias.run_as_builtin``): for tests of the generated code."""
    from attnbias import ModBias

    monkeypatch.setattr(ModBias, "run_as_builtin", False)


@pytest.fixture
def lists_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner sees its priority lists alone: small calls would otherwise be weighed by
    predicted host time (the weighing's own tests set the costs they need)."""
    from attnbias import planner

    monkeypatch.setattr(planner, "COSTS", {})
