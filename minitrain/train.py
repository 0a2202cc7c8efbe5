"""``python -m minitrain.train``: the command; the code is minitrain.parallel.command."""

import sys

from minitrain.parallel.command import main

if __name__ == "__main__":
    sys.exit(main())
