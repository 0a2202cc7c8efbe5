"""``python -m minitrain.hint CHAPTER [EXERCISE]``: the command; the code is minitrain.course.hints."""

import sys

from minitrain.course.hints import main

if __name__ == "__main__":
    sys.exit(main())
