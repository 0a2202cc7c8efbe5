"""Which modules are stage 3's units, and the check that a parameter is used only while gathered.

Chapter 5, used by ``ShardedUnits`` (ZeRO stage 3 and FSDP). A unit's parameters are
gathered by a hook on the unit module's ``forward`` (Rajbhandari et al. 2020, §5.3; Zhao et
al. 2023, "PyTorch FSDP", §3: a unit is all-gathered just before its forward), so a unit
must be a module whose forward *runs*. An ``nn.ModuleList`` or ``nn.ModuleDict`` is never
called: the model indexes it and calls its children, and a unit built from the container
would never be gathered (issue 26: the branches of a trunk-and-branches model computed on
freed memory, NaN after 3 steps). Units are therefore found by descending into containers.

A parameter used while its unit is not gathered must fail loudly. Freed parameters hold a
zero-element tensor (``ShardedUnits._free``: any op on them fails instead of reading freed
memory, as PyTorch's FSDP1 points its freed views at an empty tensor), and every module that
owns sharded parameters checks, in a forward pre-hook, that their units are gathered, so the
error names the parameter as in the original module's ``named_parameters()``.
"""

from __future__ import annotations

import functools

from torch import nn

# Containers whose parameters are held for others. ModuleList and ModuleDict have no forward.
# A Sequential has one, but a model may also index it like a list (``self.layers[i](x)``),
# and then its forward never runs. Descending into it is right in both cases — its children
# run whenever it does — at the price of one unit (one gather) per child when it is called
# whole; keeping it as one unit would be wrong whenever it is indexed. So: descend.
CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


class UngatheredParameterError(RuntimeError):
    """A sharded parameter was used while its unit was not gathered (it holds no data)."""


def default_units(module: nn.Module) -> list:
    """``module.blocks`` if it has them (a GPT: one unit per block), else the modules found by
    descending from ``module``'s children into every container (``CONTAINERS``), in
    registration order, each module once."""
    blocks = getattr(module, "blocks", None)
    if blocks:
        return list(blocks)
    out = []

    def visit(children):
        for child in children:
            if isinstance(child, CONTAINERS):
                visit(child.children())
            else:
                out.append(child)

    visit(module.children())
    seen = set()  # a module registered twice (shared) is one unit, gathered by its first hook
    return [m for m in out if not (id(m) in seen or seen.add(id(m)))]


def split_into_units(module: nn.Module, named: list, units=None, exclude=()) -> tuple:
    """(blocks, parts): ``units`` (default: ``default_units(module)``), one part ``(name,
    [(param name, param)])`` per block, then a "root" part with every other parameter. A
    parameter shared by several blocks goes to the first; ids in ``exclude`` (FSDP's
    replicated parameters) go to none."""
    blocks = list(units) if units is not None else default_units(module)
    parts, taken = [], set(exclude)
    for i, block in enumerate(blocks):
        ids = {id(q) for q in block.parameters()}
        mine = [(n, p) for n, p in named if id(p) not in taken and id(p) in ids]
        taken.update(id(p) for _, p in mine)
        parts.append((f"block {i}", mine))
    parts.append(("root", [(n, p) for n, p in named if id(p) not in taken]))
    return blocks, parts


def guard_parameter_use(wrapper, units: list) -> None:
    """Register on every module of ``wrapper.module`` that directly owns a parameter of
    ``units`` a forward pre-hook raising ``UngatheredParameterError`` if that unit is not
    gathered. Registered after the units' own gathering hooks, so a unit module's check runs
    once it is gathered. (FSDP keeps the original parameters as plain attributes: looked up
    there too.) Cost: one state check per unit a module owns, per call."""
    where = {id(p): (u, name) for u in units for name, p in zip(u.names, u.params)}
    module_names = {id(m): n for n, m in wrapper.module.named_modules()}
    block_of = {id(u): _describe(module_names.get(id(b)), b)
                for b, u in zip(wrapper.blocks, wrapper.units)}  # fmt: skip
    for m in wrapper.module.modules():
        mine = {}
        for t in list(m._parameters.values()) + list(vars(m).values()):
            if id(t) in where:
                u, name = where[id(t)]
                mine.setdefault(id(u), (u, [], block_of.get(id(u))))[1].append(name)
        if mine:
            check = functools.partial(_check_gathered, type(wrapper).__name__, list(mine.values()))
            m.register_forward_pre_hook(check)


def _describe(name, block) -> str:
    kind = type(block).__name__
    never = f", an nn.{kind} whose forward never runs" if kind in ("ModuleList", "ModuleDict") else ""
    return f"{name!r}{never}"


def _check_gathered(who: str, owned: list, module, args) -> None:
    for u, names, block_name in owned:
        if u.state != "full":
            also = f" (and {', '.join(map(repr, names[1:]))})" if len(names) > 1 else ""
            where = (
                f"its unit {u.name!r} (module {block_name})" if block_name is not None
                else "the root unit (parameters outside every unit: gathered only during "
                "the wrapper's forward)"
            )
            raise UngatheredParameterError(
                f"{who}: parameter {names[0]!r}{also} was used while {where} was not "
                f"gathered: it holds no data. A unit's parameters are whole only while that unit's own "
                f"forward runs; call the unit module itself (not its parameters or submodules "
                f"from elsewhere), or pass units=[...] so that each parameter belongs to a "
                f"module whose forward is called."
            )


def note_ungathered(exc: Exception, wrapper, limit: int = 32) -> None:
    """Add to an error raised inside the wrapped forward the parameters that were not gathered
    at that moment (an op on one of them, read outside its module, fails with a shape error
    that cannot name it)."""
    names = [n for u in wrapper.live_units() if u.state != "full" for n in u.names]
    if names:
        more = f" and {len(names) - limit} more" if len(names) > limit else ""
        exc.add_note(
            f"({type(wrapper).__name__}: when this was raised, these parameters were not "
            f"gathered and held no data (zero elements): {', '.join(names[:limit])}{more}. If "
            f"the model reads one of them outside the forward of its unit, that is the cause.)"
        )


def ungathered_gradient_error(wrapper, u, k: int, grad) -> UngatheredParameterError:
    """The error for a gradient of the wrong shape: its parameter was read (outside its
    module, e.g. a penalty ``w.pow(2).sum()``) while it held the empty tensor of a freed unit,
    so the forward computed on nothing; backward is where that shows."""
    return UngatheredParameterError(
        f"{type(wrapper).__name__}: parameter {u.names[k]!r} was used while its unit "
        f"{u.name!r} was not gathered: it held no data (zero elements), so what the forward "
        f"computed from it is wrong, and its gradient has shape {list(grad.shape)}, not "
        f"{list(u.shapes[k])}. Use a parameter only inside the forward of its unit's module."
    )
