"""The package's shape (docs/design.md, "Layout"): layers, public names only, no import circles.

Read from the source with ``ast``, so each rule names the file and line that breaks it.
"""

import ast
import builtins
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "minitrain"

# layer 1: the distributed runtime is the package minitrain/runtime/ (a path rule: a new file
# there is runtime, a runtime file elsewhere fails the count below); layer 3: what is built on
# the techniques
TOP = {"widgets", "bench", "course", "exercises", "grade", "hint"}
MAX_TOP_LEVEL_MODULES = 8  # docs/design.md: the top of minitrain/ stays small


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _imports(path: Path, module_level_only: bool):
    """(line, imported module, names) for every import of a minitrain module in ``path``."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if module_level_only else ast.walk(tree)
    for node in nodes:
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("minitrain"):
                    yield node.lineno, a.name, []
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("minitrain"):
            names = [a.name for a in node.names]
            # `from minitrain.runtime import trace` imports the module minitrain.runtime.trace
            subs = [f"{node.module}.{n}" for n in names if f"{node.module}.{n}" in MODULES]
            for sub in subs:
                yield node.lineno, sub, []
            rest = [n for n in names if f"{node.module}.{n}" not in MODULES]
            if rest:
                yield node.lineno, node.module, rest


def _layer(module: str) -> str:
    first = module.split(".")[1] if "." in module else ""
    if first == "runtime":
        return "runtime"
    if first in TOP:
        return first
    return "technique"


def test_no_module_imports_another_modules_private_names():
    bad = []
    for name, path in MODULES.items():
        for line, target, names in _imports(path, module_level_only=False):
            private = [n for n in names if n.startswith("_")]
            if private and target != name:
                bad.append(
                    f"{path.relative_to(PACKAGE.parent)}:{line} imports {private} from {target}"
                )
        for node in ast.walk(ast.parse(path.read_text())):  # minitrain.x._helper
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                base = ast.unparse(node.value)
                if base.startswith("minitrain."):
                    bad.append(
                        f"{path.relative_to(PACKAGE.parent)}:{node.lineno} uses {base}.{node.attr}"
                    )
    assert not bad, "private names shared between modules:\n" + "\n".join(bad)


def test_the_top_of_the_package_stays_small():
    top = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert len(top) <= MAX_TOP_LEVEL_MODULES, (
        f"{len(top)} modules at the top of minitrain/ (at most {MAX_TOP_LEVEL_MODULES}): {top}; "
        "put a technique's files in its package, the runtime's in minitrain/runtime/"
    )
    runtime = {"launch.py", "launch_errors.py", "rank.py", "point_to_point.py", "trace.py"}
    assert runtime <= {p.name for p in (PACKAGE / "runtime").glob("*.py")}


def test_module_level_imports_form_no_circle():
    graph = {
        name: {
            t for _, t, _ in _imports(path, module_level_only=True) if t in MODULES and t != name
        }
        for name, path in MODULES.items()
    }
    state: dict[str, str] = {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycle = stack[stack.index(nxt) :] + [nxt]
                pytest.fail("import circle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_each_layer_imports_only_those_below_it():
    allowed = {
        "runtime": {"runtime"},
        "technique": {"runtime", "technique"},
        "widgets": {
            "runtime",
            "technique",
            "widgets",
        },  # never bench: measuring lives with techniques
        "bench": {"runtime", "technique", "bench"},
        "course": {"runtime", "technique", "course"},
        "exercises": {"course"},
        "grade": {"course"},
        "hint": {"course"},
    }
    bad = []
    for name, path in MODULES.items():
        if name == "minitrain":
            continue
        for line, target, _ in _imports(path, module_level_only=False):
            if target != "minitrain" and _layer(target) not in allowed[_layer(name)]:
                bad.append(
                    f"{path.relative_to(PACKAGE.parent)}:{line} ({_layer(name)}) imports "
                    f"{target} ({_layer(target)})"
                )
    assert not bad, "layering broken:\n" + "\n".join(bad)


def test_launching_ranks_imports_none_of_the_course_machinery():
    code = textwrap.dedent(
        """
        import sys
        from minitrain.runtime import launch

        def rank_modules():
            return sorted(m for m in sys.modules if m.startswith(("minitrain.course", "minitrain.bench", "minitrain.widgets")))

        if __name__ == "__main__":
            ranks = launch(rank_modules, 2, timeout=60)
            parent = rank_modules()
            print(repr((parent, list(ranks))))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    parent, ranks = eval(out.stdout.strip().splitlines()[-1])
    assert parent == [] and ranks == [[], []], (
        f"course modules imported: parent {parent}, ranks {ranks}"
    )


def test_contract_names_import_from_their_documented_modules():
    import importlib

    contract = {
        "minitrain.runtime": [
            "launch",
            "LaunchError",
            "init_from_env",
            "get_device",
            "add_rank_initializer",
        ],
        "minitrain.precision": [
            "FloatFormat",
            "FP32",
            "FP16",
            "BF16",
            "FP8_E4M3",
            "FP8_E5M2",
            "DynamicLossScaler",
            "MasterWeightOptimizer",
        ],
        "minitrain.memory": [
            "estimate_training_memory",
            "saved_activation_bytes",
            "BYTES_PER_PARAMETER",
        ],
        "minitrain.checkpointing": ["checkpoint", "checkpoint_sequential"],
        "minitrain.collectives": ["ring_all_reduce", "ring_reduce_scatter", "ring_all_gather"],
        "minitrain.ddp": ["DataParallel", "assign_buckets", "broadcast_from_first_rank"],
        "minitrain.zero": ["ShardedOptimizer", "ZeroDataParallel", "partition_parameters"],
    }
    for module, names in contract.items():
        mod = importlib.import_module(module)
        missing = [n for n in names if n not in vars(mod)]
        assert not missing, f"{module} lacks {missing}"


# ------------------------------------------------- techniques joined by functions (issue 27)
# A technique changes a model by replacing its submodules and setting the attributes the model
# offers for it (GPT.loss_fn, block_loop, shard_rng) — never by changing an object's class,
# overwriting a method on an instance, or calling another class's method on ``self``.
TREES = {path: ast.parse(path.read_text()) for path in MODULES.values()}


def _walk_with_class(node, cls=None):
    """(node, the class it is written in, or None) for every node under ``node``, in order."""
    yield node, cls
    inner = node if isinstance(node, ast.ClassDef) else cls
    for child in ast.iter_child_nodes(node):
        yield from _walk_with_class(child, inner)


def _assigned_attributes(node):
    """The ``x.name`` targets an assignment writes (through tuples too), and setattr's."""
    if isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for t in targets:
            for e in t.elts if isinstance(t, ast.Tuple | ast.List) else [t]:
                if isinstance(e, ast.Attribute):
                    yield e.value, e.attr
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
          and node.func.id == "setattr" and len(node.args) == 3
          and isinstance(node.args[1], ast.Constant)):
        yield node.args[0], node.args[1].value


def _own_methods(cls) -> set[str]:
    return {f.name for f in cls.body if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)}


def _method_and_data_names():
    """Names some minitrain class defines as a method, and names used as data: written on
    ``self`` (or an autograd ``ctx``) in a class that has no such method, or class-level."""
    methods, data = set(), set()
    for tree in TREES.values():
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            own = _own_methods(cls)
            methods |= own
            for node in ast.walk(cls):
                for holder, name in _assigned_attributes(node):
                    if isinstance(holder, ast.Name) and holder.id in ("self", "ctx") \
                            and name not in own:
                        data.add(name)
            data |= {t.id for n in cls.body if isinstance(n, ast.Assign | ast.AnnAssign)
                     for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                     if isinstance(t, ast.Name)}
    return methods, data


def _where(path, node) -> str:
    return f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"


def test_no_object_changes_class():
    bad = [f"{_where(path, node)}: {ast.unparse(holder)}.__class__ = ..."
           for path, tree in TREES.items() for node, _ in _walk_with_class(tree)
           for holder, name in _assigned_attributes(node) if name == "__class__"]
    assert not bad, "objects whose class is changed (replace the module instead):\n" + \
        "\n".join(bad)


def test_no_method_overwritten_on_an_instance():
    methods, data = _method_and_data_names()
    only_methods, bad = methods - data, []
    for path, tree in TREES.items():
        for node, cls in _walk_with_class(tree):
            for holder, name in _assigned_attributes(node):
                on_self = isinstance(holder, ast.Name) and holder.id == "self"
                if (name in only_methods and not on_self) or (
                        on_self and cls is not None and name in _own_methods(cls)):
                    bad.append(f"{_where(path, node)}: {ast.unparse(holder)}.{name} = ... "
                               f"({name} is a method)")
    assert not bad, "methods overwritten on an instance (give the class an attribute for " \
        "what varies, or replace a submodule):\n" + "\n".join(bad)


def test_no_method_borrowed_from_an_unrelated_class():
    """``Other.method(self, ...)`` in a class not derived from ``Other`` (super() is fine, and
    a builtin: ``tuple.__getitem__(self, i)`` in a NamedTuple calls its real base)."""
    bad = []
    for path, tree in TREES.items():
        for node, cls in _walk_with_class(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.args and ast.unparse(node.args[0]) == "self"):
                continue
            owner = ast.unparse(node.func.value)  # a class: Name or module.Name
            bases = {ast.unparse(b).split(".")[-1] for b in (cls.bases if cls else [])}
            name = owner.split(".")[-1]
            if owner.split(".")[0] != "self" and name not in bases | set(dir(builtins)):
                bad.append(f"{_where(path, node)}: {owner}.{node.func.attr}(self, ...) in "
                           f"{cls.name if cls else 'a function'}")
    assert not bad, "methods borrowed from classes the caller does not derive from:\n" + \
        "\n".join(bad)


def test_the_runtime_exports_the_launch_function_beside_its_module():
    """``minitrain/runtime/launch.py`` is the file; ``minitrain.runtime.launch`` the function it
    exports (the package binds the name after importing the module, so it stays the function)."""
    import importlib

    import minitrain.runtime as runtime

    assert callable(runtime.launch) and runtime.launch.__name__ == "launch"
    module = importlib.import_module("minitrain.runtime.launch")
    assert module.__file__.endswith("runtime/launch.py") and module.launch is runtime.launch
    assert runtime.launch is importlib.import_module("minitrain.runtime").launch
