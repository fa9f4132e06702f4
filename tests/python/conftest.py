"""Shared helpers of the Python tests: the reference module on the path, seeded generators,
and the markers that skip torch / CUDA tests where those are absent."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))

# Tests run one OpenMP thread each (as the C++ tests do): CI has two cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _torch():
    try:
        import torch

        return torch
    except ImportError:
        return None


torch = _torch()
HAS_TORCH = torch is not None
HAS_CUDA = False
if HAS_TORCH:
    import pagedattn

    HAS_CUDA = bool(pagedattn.with_cuda and torch.cuda.is_available())

needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="needs torch")
needs_cuda = pytest.mark.skipif(
    not HAS_CUDA, reason="needs torch with a CUDA device and pagedattn built with CUDA")


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)
