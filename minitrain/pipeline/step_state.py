"""What one pipeline training step remembers between its actions (``StepState``).

Chapter 7, notebooks/07_pipeline_parallel.ipynb: ``PipelineStage.train_step`` builds one per
step and every ``run_action`` reads and fills it (``minitrain.parallel``'s evaluation too).
"""

from __future__ import annotations


class StepState:
    """What one training step remembers between actions."""

    def __init__(self, inputs, targets, num_microbatches, split_backward, positions=None):
        self.inputs, self.targets = inputs, targets  # per micro-batch
        self.positions = positions  # where the tokens sit (None: 0..s-1), for the embedding
        self.dropout_keys = None  # per micro-batch: its DropoutKey (layout-free masks), or None
        self.num_microbatches = num_microbatches
        self.split_backward = split_backward  # the schedule has W actions
        self.saved = {}  # (mb, chunk) -> (input, output) kept for backward
        self.linear_calls = {}  # (mb, chunk) -> the GEMMs F recorded, for B to split off
        self.pending_w = {}  # (mb, chunk) -> WeightWork: what W still has to compute
        self.losses, self.sends = [], []  # the micro-batches' losses; (work, tensor): isends
        self.outbox, self.arrivals = {}, {}  # Message -> tensor to send; -> (work, buffer)
        self.device = None  # where received tensors go: the stage's parameters' device
