"""``python -m minitrain.train``: the command; the code is minitrain.parallel.command."""

import os
import signal
import sys

if __name__ == "__main__":
    # A stop signal while torch is still being imported (seconds on a busy machine) ends the
    # command with one line too; training installs its own handlers (command_errors.py).
    # os._exit, not SystemExit: nothing needs cleaning up yet, and an exception raised inside
    # an import can be swallowed by a library's bare ``except:`` (the run then went on).
    def _stopped_early(signum, frame):
        print(f"minitrain.train: stopped by {signal.Signals(signum).name} before training "
              "started", file=sys.stderr, flush=True)
        os._exit(128 + signum)

    for _s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(_s, _stopped_early)

from minitrain.parallel.command import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
