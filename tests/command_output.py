"""What the tests of ``python -m minitrain.train``'s failures read from it: one line, no
traceback (tests/test_faults.py, tests/test_train_refusals.py)."""

import pytest


def one_line(err: str) -> str:
    """``err``'s only line; fails if there are several, or a traceback."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def refused(main, argv, capsys) -> str:
    """``main(argv)`` refused by the parser: exit status 2 and one line on stderr."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    return one_line(capsys.readouterr().err)
