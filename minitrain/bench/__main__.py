"""``python -m minitrain.bench <name> [options]``: run one benchmark (no name: list them)."""

import importlib
import pkgutil
import sys

import minitrain.bench as bench


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    names = sorted(  # a ``*_peer`` module is a section of the benchmark it is named after
        m.name for m in pkgutil.iter_modules(bench.__path__)
        if not m.name.startswith("_") and not m.name.endswith("_peer")
    )
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m minitrain.bench <name> [options]\nbenchmarks: " + ", ".join(names))
        return 0
    if argv[0] not in names:
        print(f"no benchmark named {argv[0]!r}; there are: {', '.join(names)}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"minitrain.bench.{argv[0]}")
    return module.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
