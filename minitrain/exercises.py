"""``python -m minitrain.exercises build|check|start``: the command; the code is minitrain.course.exercises."""

import sys

from minitrain.course.exercises import main

if __name__ == "__main__":
    sys.exit(main())
