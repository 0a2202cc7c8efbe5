"""The device canary (tests/test_device_canary.py): torch's default device is ``meta``.

Put this directory on PYTHONPATH and set MINITRAIN_DEVICE_CANARY=1: every Python process
started so (the test's runner, launch's forkserver and so every rank, ``python -m
minitrain.train``) imports torch at start-up, sets the default device to ``meta`` and wraps
torch's factory functions. A tensor the course creates without naming its device then
either lands on ``meta`` (and the numbers are lost: no data) or, where the default device
does not reach (autograd's backward, helper threads), the wrapped factory raises naming the
call. It is the CPU stand-in for "this would put a tensor on the wrong device on a GPU"
(issue 29). Only calls from outside torch, the standard library and site-packages are
checked: torch's own internals choose their devices themselves.
"""

import os

if os.environ.get("MINITRAIN_DEVICE_CANARY") == "1":
    import functools
    import sys
    import sysconfig

    import torch

    # where library code lives: calls from there are torch's business, not the course's
    _TRUSTED = tuple(
        os.path.realpath(p)
        for p in {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    )
    FACTORIES = (
        "empty", "zeros", "ones", "full", "arange", "range", "linspace", "logspace", "eye",
        "randn", "rand", "randint", "randperm", "normal", "tensor", "as_tensor",
        "scalar_tensor", "empty_strided", "sparse_coo_tensor",
    )

    class DeviceCanaryError(RuntimeError):
        """A tensor was created without naming its device."""

    def _device_named_by_context() -> bool:
        # ``with torch.device(d): GPT(config)`` names the device for a whole module tree, as
        # torch's own modules expect; the canary's own ``meta`` default names nothing. The
        # context is per thread and autograd leaves it during backward, so code that runs
        # there (or in a helper thread) is checked whatever the caller's context was.
        from torch.overrides import _get_current_function_mode_stack
        from torch.utils._device import DeviceContext

        contexts = [m for m in _get_current_function_mode_stack() if isinstance(m, DeviceContext)]
        return bool(contexts) and torch.device(contexts[-1].device).type != "meta"

    def _checked(name, factory):
        @functools.wraps(factory)
        def factory_naming_its_device(*args, **kwargs):
            if kwargs.get("device") is None and not _device_named_by_context():
                caller = sys._getframe(1).f_code.co_filename
                real = os.path.realpath(caller)
                if not caller.startswith("<") and not real.startswith(_TRUSTED):
                    line = sys._getframe(1).f_lineno
                    raise DeviceCanaryError(
                        f"torch.{name}(...) without device= at {caller}:{line} "
                        "(name the device, or copy one: torch.empty_like, x.new_zeros)"
                    )
            return factory(*args, **kwargs)

        return factory_naming_its_device

    # first the default device: torch caches the set of factory functions it redirects the
    # first time it is used, and that set must hold torch's own functions, not the wrappers
    torch.set_default_device("meta")
    torch.empty(0)
    for _name in FACTORIES:
        setattr(torch, _name, _checked(_name, getattr(torch, _name)))
    os.environ.setdefault("MINITRAIN_DEVICE", "cpu")
