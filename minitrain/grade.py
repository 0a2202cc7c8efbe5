"""``python -m minitrain.grade [chapter ...]``: the command; the code is minitrain.course.grade."""

import sys

from minitrain.course.grade import main

if __name__ == "__main__":
    sys.exit(main())
