"""A run checkpoint holds every generator the run draws from (issue 40 item 6, issue 41 item 5),
and under ZeRO the module's buffers too (issue 40 item 8: a router's bias and load).

On a GPU, dropout outside the trainer's keyed masks (``torch.rand_like`` on a CUDA tensor) and
any other sampling draw from the *device's* generator, not the CPU's: a checkpoint holding only
``torch.get_rng_state()`` resumes those streams from wherever the new process's generator
starts. This machine has no GPU, so the device's generator is faked: ``torch.get_device_module``
answers for "cuda" with a stand-in whose state the test can read and change, and the trainer's
device is set to cuda:0 for ``state()`` / ``load_state()`` (nothing else runs on it).
"""

import torch

from minitrain.model import GPTConfig
from minitrain.parallel import ParallelGPT
from minitrain.runtime import launch

CFG = GPTConfig(vocab_size=16, seq_len=8, n_layer=1, n_head=2, d_model=16)


class FakeDeviceGenerators:
    """``torch.cuda``'s generator calls, for a device this machine does not have."""

    def __init__(self):
        self.state = torch.tensor([1, 2, 3], dtype=torch.uint8, device="cpu")
        self.set_calls = []

    def get_rng_state(self, device=None):
        return self.state.clone()

    def set_rng_state(self, value, device=None):
        self.set_calls.append((value.clone(), torch.device(device)))
        self.state = value.clone()


def _save_and_restore():
    real = torch.get_device_module
    fake = FakeDeviceGenerators()
    torch.get_device_module = lambda d=None: fake if torch.device(d).type == "cuda" else real(d)
    try:
        job = ParallelGPT(CFG, {}, 4, 1e-3, 0)
        job.step(0)
        job.device = torch.device("cuda", 0)  # as on a GPU rank (state and load only)
        state = job.state()
        saved = state["rng"][torch.device("cuda", 0)].tolist()
        cpu = state["rng"]["cpu"].clone()
        fake.state = torch.tensor([9, 9], dtype=torch.uint8, device="cpu")  # the run moves on
        torch.rand(5, device="cpu")
        job.load_state(state)
        return saved, fake.set_calls[-1][0].tolist(), str(fake.set_calls[-1][1]), \
            bool(torch.equal(torch.get_rng_state(), cpu))
    finally:
        torch.get_device_module = real


def _zero_buffers():
    """Under ZeRO the module holds no tensor the shards do not: its buffers must be saved
    beside them (a router's DeepSeek-V3 ``expert_bias`` moved by a rule, not by the optimizer)."""
    cfg = GPTConfig(vocab_size=16, seq_len=8, n_layer=1, n_head=2, d_model=16, moe_experts=2)
    job = ParallelGPT(cfg, {"zero": 1}, 4, 1e-3, 0)
    router = job.moe_layers[0].router
    router.expert_bias.fill_(0.25)
    state = job.state()
    router.expert_bias.zero_()
    job.load_state(state)
    return router.expert_bias.tolist()


def _both():
    return _save_and_restore(), _zero_buffers()


def test_checkpoint_saves_and_restores_the_device_generator_and_zero_buffers():
    (saved, restored, device, cpu_restored), bias = launch(_both, 1, timeout=120)[0]
    assert bias == [0.25, 0.25], "under ZeRO a checkpoint lost the router's buffers"
    assert saved == [1, 2, 3], "the checkpoint does not hold the device's generator"
    assert restored == [1, 2, 3] and device == "cuda:0", "load_state did not restore it"
    assert cpu_restored, "the CPU generator was not restored"


def test_a_one_process_run_asks_for_the_machines_backend(monkeypatch):
    """Issue 41: ``python -m minitrain.train`` on one process always made a gloo group, so
    ``get_device()`` said CPU and a GPU node's one-rank run trained on its CPU."""
    import minitrain.parallel.command as command

    asked = []
    monkeypatch.setattr(command, "default_backend", lambda n=None: asked.append(n) or "gloo")
    argv = ["--steps", "1", "--n-layer", "1", "--d-model", "16", "--n-head", "2",
            "--seq-len", "8", "--batch-size", "2", "--no-progress"]
    assert command.main(argv) == 0
    assert asked == [1]
