"""Which points of a large test grid run: a seeded sample on CPU-only machines (CI has two
cores), a larger one with a GPU, every point with PAGEDATTN_FULL_GRIDS=1;
PAGEDATTN_GRID_POINTS=N samples N points everywhere (a quick pass on a GPU lease)."""

from __future__ import annotations

import os
import random
from typing import List, Sequence, TypeVar

T = TypeVar("T")

FULL_GRIDS = os.environ.get("PAGEDATTN_FULL_GRIDS") == "1"
GRID_POINTS = os.environ.get("PAGEDATTN_GRID_POINTS")


def sample_grid(points: Sequence[T], cpu_count: int, gpu_count: int, has_cuda: bool,
                seed: int = 0) -> List[T]:
    """All points under PAGEDATTN_FULL_GRIDS=1, else a seeded sample (the same every run) of
    gpu_count points with a GPU or cpu_count without one."""
    if FULL_GRIDS:
        return list(points)
    n = min(len(points), int(GRID_POINTS) if GRID_POINTS else
            gpu_count if has_cuda else cpu_count)
    return random.Random(seed).sample(list(points), n)
