"""Which rank owns which parameters: ZeRO-1's partition of the optimizer state.

Chapter 5, notebooks/05_zero.ipynb; used by ``ShardedOptimizer`` (optimizer.py). Every rank
must compute the same answer, so the rule is deterministic.
"""

from __future__ import annotations


def partition_parameters(sizes: list[int], world_size: int) -> list[list[int]]:
    """Assign parameters (by index) to ranks so every rank owns about the same number of elements.

    Greedy "largest first" (Graham 1969, LPT): visit the sizes from largest to smallest (ties:
    lower index first) and give each to the rank with the fewest elements so far (ties: lower
    rank). Returns, per rank, its indices in increasing order. Every rank must get the same
    answer, so the rule is deterministic. E.g. sizes [4, 3, 3, 2, 2] on 2 ranks → [[0, 3, 4], [1, 2]]
    (8 and 6 elements; the best split is 7 and 7: greedy's largest load is within 4/3 of the best).
    """
    ### BEGIN SOLUTION
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    loads, owned = [0] * world_size, [[] for _ in range(world_size)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(world_size), key=lambda r: (loads[r], r))
        owned[r].append(i)
        loads[r] += sizes[i]
    return [sorted(o) for o in owned]
    ### END SOLUTION
