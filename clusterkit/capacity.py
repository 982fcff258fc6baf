"""How many DDP ranks a cluster offers: one formula for profiles (before start) and live workers.

A worker with GPUs runs one rank per GPU it owns (at most one per thread); a worker without
GPUs runs one rank. The search runner's slots follow the same rule with ``resources={"GPU": 1}``.
"""

from __future__ import annotations

from collections.abc import Iterable


def ranks_per_worker(threads: int, gpus: float) -> int:
    """Ranks one Dask worker runs, from its thread count and its ``GPU`` resource."""
    whole = int(gpus)
    return max(1, min(whole, threads)) if whole else 1


def rank_capacity(shapes: Iterable[tuple[int, int, float]]) -> int:
    """Ranks of workers given as ``(count, threads, gpus)`` groups."""
    return sum(count * ranks_per_worker(threads, gpus) for count, threads, gpus in shapes)
