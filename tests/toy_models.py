"""Small models and data shared by the data-parallel tests (ZeRO, FSDP).

Sizes are chosen so that sharding is awkward: ``Toy``'s parameters have 35, 7, 49, 7, 7, 7,
..., 21 and 3 elements, none divisible by 2, 3 or 4 all together, so every shard boundary
and every padding path is exercised. ``Branchy`` uses different parameters on different
ranks (decided by the data) and one parameter no rank ever uses.
"""

import torch
from torch import nn

BATCH = 12  # global rows per step: divisible by 1, 2, 3 and 4 ranks


class Block(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.fc = nn.Linear(h, h)
        self.ln = nn.LayerNorm(h)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.ln(x)))


class Toy(nn.Module):
    def __init__(self, n=3):
        super().__init__()
        self.inp = nn.Linear(5, 7)
        self.blocks = nn.ModuleList(Block(7) for _ in range(n))
        self.out = nn.Linear(7, 3)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


class Branchy(nn.Module):
    """Rank-dependent use: ``even`` only for inputs whose first feature is > 0, ``never`` never."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(5, 7)
        self.even, self.odd, self.never = nn.Linear(7, 3), nn.Linear(7, 3), nn.Linear(7, 3)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        pos = x[:, 0] > 0
        out = torch.zeros(x.shape[0], 3)
        if pos.any():
            out[pos] = self.even(h[pos])
        if (~pos).any():
            out[~pos] = self.odd(h[~pos])
        return out


def toy_batch(step, rank=0, world=1):
    """Step ``step``'s global batch (the same on every rank), and rank ``rank``'s slice of it:
    the ranks' slices together are exactly what one process sees."""
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(BATCH, 5, generator=g), torch.randn(BATCH, 3, generator=g)
    b = BATCH // world
    return x[rank * b : (rank + 1) * b], y[rank * b : (rank + 1) * b]


def mse(out, y):
    return ((out.float() - y) ** 2).mean()


class Branched(nn.Module):
    """A trunk, then one branch per rank (rank r's rows go through branch r only), the
    branches held in a container whose own ``forward`` never runs (issue 26): ``kind``
    "list" (``nn.ModuleList``), "dict" (``nn.ModuleDict`` of ``nn.Sequential`` branches,
    each called whole) or "seq" (an ``nn.Sequential`` indexed like a list). The trunk is an
    ``nn.Sequential`` that is called; ``inp`` and ``gain`` belong to no container."""

    def __init__(self, kind="list", n=3):
        super().__init__()
        self.kind = kind
        self.inp = nn.Linear(5, 7)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 3))
        self.trunk = nn.Sequential(nn.Linear(7, 7), nn.Tanh(), Block(7))
        if kind == "list":
            self.branches = nn.ModuleList(nn.Linear(7, 3) for _ in range(n))
        elif kind == "dict":
            self.branches = nn.ModuleDict(
                {f"b{i}": nn.Sequential(nn.Linear(7, 4), nn.Tanh(), nn.Linear(4, 3))
                 for i in range(n)}
            )
        elif kind == "seq":
            self.branches = nn.Sequential(*(nn.Linear(7, 3) for _ in range(n)))
        else:
            raise ValueError(f"kind must be 'list', 'dict' or 'seq', got {kind!r}")

    def branch(self, i):
        return self.branches[f"b{i}"] if self.kind == "dict" else self.branches[i]

    def forward(self, x, branch):
        return self.branch(branch)(self.trunk(torch.tanh(self.inp(x)))) * self.gain


class PerRankBranches(nn.Module):
    """A trunk, then rank r's rows through branch r only, whose output *is* the model's
    output (issue 40: that branch's backward hook then fires before the output's). Branch i
    is ``Linear(7, 4 + i) → Tanh → Linear(4 + i, 3)``: sizes differ, so a gather paired with
    another branch's aborts instead of mixing data. ``n`` branches (one more than ranks: a
    branch no rank runs), in an ``nn.ModuleList`` (``kind`` "list") or ``nn.ModuleDict``
    ("dict"); ``trunk_first=False`` registers the branches before the trunk, so units run
    out of their listed order."""

    def __init__(self, n, kind="list", trunk_first=True):
        super().__init__()
        if kind not in ("list", "dict"):
            raise ValueError(f"kind must be 'list' or 'dict', got {kind!r}")
        self.kind = kind
        made = [
            nn.Sequential(nn.Linear(7, 4 + i), nn.Tanh(), nn.Linear(4 + i, 3)) for i in range(n)
        ]
        if not trunk_first:
            self.branches = self._container(made)
        self.trunk = nn.Linear(5, 7)
        if trunk_first:
            self.branches = self._container(made)

    def _container(self, made):
        if self.kind == "list":
            return nn.ModuleList(made)
        return nn.ModuleDict({f"b{i}": b for i, b in enumerate(made)})

    def forward(self, x, branch):
        b = self.branches[branch] if self.kind == "list" else self.branches[f"b{branch}"]
        return b(torch.tanh(self.trunk(x)))


def branch_of(rank, trunk_first):
    """Rank r's branch of ``PerRankBranches(world + 1, ...)``. The spare one (no rank runs it)
    is the farthest from the trunk: with the trunk last, rank N-1's branch is the unit just
    before it, and its prefetch of the trunk (already run and freed) is one a rank alone would
    issue."""
    return rank if trunk_first else rank + 1


def branches_reference(model, trunk_first, world, steps, lr):
    """One process, plain torch: ``model``'s parameters after each SGD step on the mean of the
    ranks' losses, rank r running its branch (``branch_of``) on its rows (``toy_batch``)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    states = []
    for s in range(steps):
        opt.zero_grad()
        loss = 0.0
        for r in range(world):
            x, y = toy_batch(s, r, world)
            loss = loss + mse(model(x, branch_of(r, trunk_first)), y)
        (loss / world).backward()
        opt.step()
        states.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return states
