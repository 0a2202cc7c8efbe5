"""What every rank ``launch`` starts runs first: functions registered by tools (the grader).

Ranks come from a forkserver started earlier (``launch.py``), so they do not see changes made
in the parent since (a monkeypatch, a function swapped in). A tool that makes such a change
registers here how to make it again in each rank; ``launch`` sends the list (by cloudpickle)
and ``rank.py`` runs it before unpickling the rank's own function. The modeled link and the
strict point-to-point canary add theirs per launch (``link.rank_initializers``,
``strict_p2p.rank_initializers``).
"""

from __future__ import annotations

_rank_initializers: list = []


def add_rank_initializer(fn):
    """Run ``fn()`` in every rank that ``launch`` starts from now on, before the rank's own
    function is unpickled; return a function that removes it again.

    The course's grader uses it to put a learner's functions into every rank; ``fn`` travels
    by cloudpickle, like the rank function (module docstring).
    """
    if not callable(fn):
        raise TypeError(f"add_rank_initializer: fn must be callable, got {type(fn).__name__}")
    _rank_initializers.append(fn)

    def remove():
        if fn in _rank_initializers:
            _rank_initializers.remove(fn)

    return remove


def registered_initializers() -> list:
    """The functions registered now, in registration order (a copy)."""
    return list(_rank_initializers)
