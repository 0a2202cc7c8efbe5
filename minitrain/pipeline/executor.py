"""Run any pipeline schedule over send/recv: ``PipelineStage(model, group).train_step(...)``.

Chapter 7, notebooks/07_pipeline_parallel.ipynb. GPipe (Huang et al. 2019), 1F1B and
interleaved 1F1B (Narayanan et al. 2021, section 2.2), ZB-H1 (Qi et al. 2024).

Public API (what later chapters compose with):

    stage = PipelineStage(model, group=None, num_chunks=1, checkpointing=None, checkpoint_k=1)
    loss = stage.train_step(inputs, targets, schedule, num_microbatches, dp_group=None,
                            positions=None, dropout_keys=None)

- ``model``: the course's GPT (dense, or tensor-parallel through ``apply_tensor_parallel``,
  with or without SP). The stage keeps this rank's share *in place* (embeddings on the first
  stage, ``ln_f``, ``head`` and the loss on the last, its blocks; the others become
  ``nn.Identity``, so parameter names stay the dense model's). ``split_blocks`` spreads the
  blocks over the ``p * num_chunks`` virtual stages, the first ``L mod V`` one extra.
- ``positions``: where the tokens sit (a CP shard's); ``dropout_keys``: each micro-batch's key.
- ``group``: the pipeline's process group (None: the default group); stage = rank in it.
  With ``num_chunks = v``, chunk c of stage s holds virtual stage ``c * p + s``.
- ``checkpointing``: a chapter-3 policy ("full", "every_k", "segments", "selective") applied
  to each chunk's blocks with ``minitrain.checkpointing.set_checkpointing``.
- ``schedule``: data — per stage, the ordered actions ``("F", mb)``, ``("B", mb)``, ``("W", mb)``
  or ``(kind, mb, chunk)`` — or a name in ``schedules.SCHEDULES``, or a function
  ``(p, m)`` / ``(p, m, v)`` returning it. It is checked (``check.simulate``) on every rank
  before anything runs, so a deadlocking schedule raises on all ranks instead of hanging.
- returns the mean loss over the micro-batches (= ``model.loss`` on the whole batch), a
  0-dim tensor on *every* stage, in the model's dtype promoted with fp32 (bf16/fp16: fp32);
  gradients are accumulated in the stage's parameters (call ``zero_grad`` yourself). With
  ``dp_group``, they are averaged over it once, after the last micro-batch (one all-reduce).
- zero bubble (``weight_grad.py``): B computes the input's gradient, W the weight GEMMs from
  the (input, output gradient) pairs B kept, without walking the graph again.

Messages (``messages.py``): every stage posts its sends and receives in groups, one per
tick of the schedule's idealised clock, so the step runs on NCCL (no buffering, no tags) as on
gloo; a receive is posted early and waited for when its action starts (traced as a wait). The
loss reaches every stage point to point from the last (``step_messages.py``).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from minitrain.checkpointing import set_checkpointing
from minitrain.pipeline.messages import Message, message_plan, post_group
from minitrain.pipeline.partition import StageChunk, split_blocks
from minitrain.pipeline.schedules import resolve_schedule
from minitrain.pipeline.step_messages import (  # noqa: F401 (LOSS_TAG: re-exported)
    LOSS_TAG,
    average_gradients,
    post_loss_receive,
    share_loss,
)
from minitrain.pipeline.step_state import StepState
from minitrain.pipeline.weight_grad import LinearCalls, backward_input, w_parameters
from minitrain.runtime import trace


class PipelineStage(nn.Module):
    """This rank's stage of a pipeline over ``group``; see the module docstring."""

    def __init__(self, model, group: ProcessGroup | None = None, num_chunks=1, checkpointing=None,
                 checkpoint_k=1):
        super().__init__()
        self.group = group
        self.num_stages, self.stage = dist.get_world_size(group), dist.get_rank(group)
        p, v = self.num_stages, num_chunks
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"num_chunks must be a positive int, got {v!r}")
        if getattr(model.config, "tie_weights", False) and p > 1:
            raise ValueError("tie_weights=True shares the head with the embedding, which live "
                             f"on stages 0 and {p - 1}: build the model with tie_weights=False")
        if getattr(model, "block_loop", None) is not None:  # set_checkpointing(model): one loop
            raise ValueError("the model's blocks are already checkpointed as one loop; build the "
                             "stage from the plain model and pass checkpointing=<policy>, which "
                             "applies it to each chunk of this stage")
        self.num_chunks = v
        ranges = split_blocks(len(model.blocks), p * v)
        mine = {c: ranges[c * p + self.stage] for c in range(v)}
        self.chunks = [StageChunk(model, mine[c], c * p + self.stage == 0,
                                  c * p + self.stage == p * v - 1) for c in range(v)]
        owned = {i for r in mine.values() for i in r}
        for i in range(len(model.blocks)):  # free what other stages compute
            if i not in owned:
                model.blocks[i] = nn.Identity()
        if self.stage != 0:
            model.tok_emb = model.pos_emb = None
        if self.stage != p - 1:
            model.ln_f = model.head = None
        self.model = model
        self.checkpointing = checkpointing
        if checkpointing is not None:
            for chunk in self.chunks:
                set_checkpointing(chunk, checkpointing, checkpoint_k)
        # per chunk, the parameters zero bubble's W computes (weight_grad.py): the GEMMs'
        self.w_params = [w_parameters(self.chunk_modules(c)) for c in range(v)]
        self.ref_device = next(self.parameters()).device
        # (virtual stage, batch shape) -> (shape, dtype) received; sent: (virtual, batch shape)
        self.known_shapes, self.sent_shapes = {}, set()

    # ------------------------------------------------------------------ topology
    def virtual_stage(self, chunk: int) -> int:
        return chunk * self.num_stages + self.stage

    def is_first(self, chunk: int) -> bool:
        return self.virtual_stage(chunk) == 0

    def is_last(self, chunk: int) -> bool:
        return self.virtual_stage(chunk) == self.num_stages * self.num_chunks - 1

    def rank_of(self, virtual: int) -> int:
        """The global rank of the stage holding virtual stage ``virtual``."""
        local = virtual % self.num_stages
        return local if self.group is None else dist.get_global_rank(self.group, local)

    # ------------------------------------------------------------------ messages
    def send(self, kind: str, mb: int, tensor: torch.Tensor, to_virtual: int, state) -> None:
        """Send ``tensor`` (an activation for kind "F", a gradient for "B") to the stage
        holding virtual stage ``to_virtual``: it leaves with the next group of the plan (or
        stays on this rank, for another of its chunks)."""
        message, tensor = Message(kind, mb, to_virtual), tensor.detach().contiguous()
        if to_virtual % self.num_stages == self.stage:
            state.arrivals[message] = (None, tensor)
        else:
            state.outbox[message] = tensor

    def recv(self, kind: str, mb: int, from_virtual: int, state, like=None) -> torch.Tensor:
        """Micro-batch ``mb``'s activation ("F") or gradient ("B") from the stage holding
        ``from_virtual``: its receive was posted with its tick's group; wait for it here
        (traced as a wait). ``like``: unused, the plan knows each message's shape."""
        me = from_virtual + (1 if kind == "F" else -1)  # the virtual stage receiving it
        message = Message(kind, mb, me)
        if message not in state.arrivals:
            raise RuntimeError(f"stage {self.stage}: {message} was never posted: run_action "
                               "must receive what its action needs, and only that")
        work, buffer = state.arrivals.pop(message)
        if work is not None:
            with trace.span(f"recv {kind}{mb}", "communication", buffer.device):
                work.wait()
        return buffer

    def run(self, schedule, state, complete=True) -> None:
        """Run this stage's actions (``run_action``) and post its message groups between them,
        in ``messages.message_plan``'s order."""
        for what, item in message_plan(schedule, self.num_chunks, complete)[self.stage]:
            if what == "action":
                run_action(self, item, state)
            else:
                post_group(self, item, state)

    # ------------------------------------------------------------------ compute
    def forward(self, chunk: int, mb: int, x: torch.Tensor, state):
        """Chunk ``chunk`` on ``x`` (micro-batch ``mb``'s tokens on the first virtual stage).
        Returns (the activation its blocks started from — ``x``, or the embedding on the
        first virtual stage — and the output: on the last virtual stage, the loss / m)."""
        module = self.chunks[chunk]
        rng = getattr(self.model, "shard_rng", None)  # as the GPT's forward: SP dropout's stream
        if state.dropout_keys is not None:  # micro-batch mb's key, whatever ran before it
            self.model.dropout_keys.current = state.dropout_keys[mb]
        # a split backward: record the chunk's GEMMs, so B can leave their weights to W
        calls = LinearCalls(self.w_params[chunk]) if state.split_backward else nullcontext()
        with trace.span(f"F{mb}" + (f".{chunk}" if self.num_chunks > 1 else ""), "compute",
                        x.device), calls:
            with nullcontext() if rng is None else rng.fork(x.device):
                if module.first:
                    x = module.embed(x, state.positions)
                out = module(x)
            if module.last:
                loss = module.loss(out, state.targets[mb])
                state.losses.append(loss.detach())
                out = loss / state.num_microbatches  # the step's loss is the mean over m
        if state.split_backward:
            state.linear_calls[(mb, chunk)] = calls.calls
        return x, out

    def backward(self, name: str, out, grad) -> None:
        """``torch.autograd.backward`` of ``out`` with upstream ``grad`` (None for the loss)
        into everything (input and parameters), traced as compute."""
        with trace.span(name, "compute", out.device):
            torch.autograd.backward(out, grad)

    def backward_input(self, name: str, chunk: int, mb: int, out, grad, x, state):
        """Zero bubble's B (``weight_grad.backward_input``): the gradient of ``x`` (None on the
        first virtual stage) and of the parameters W does not compute; frees the graph and
        parks W's work in ``state.pending_w[(mb, chunk)]``."""
        rest = [q for q in self.chunk_parameters(chunk) if q not in self.w_params[chunk]]
        with trace.span(name, "compute", out.device):
            # no record (F ran unsplit): no GEMM is left to W, the weights get no gradient
            x_grad, work = backward_input(out, grad, x, state.linear_calls.pop((mb, chunk), []),
                                          rest, not self.is_first(chunk))
        state.pending_w[(mb, chunk)] = work
        return x_grad

    def backward_weights(self, name: str, chunk: int, work) -> None:
        """Zero bubble's W for chunk ``chunk``: the weight GEMMs of ``work`` (what its B
        parked) into ``.grad``; no autograd."""
        with trace.span(name, "compute", self.ref_device):
            work.apply()

    def chunk_parameters(self, chunk: int) -> list:
        """The parameters chunk ``chunk`` trains (a tied weight once)."""
        params = (q for m in self.chunk_modules(chunk) for q in m.parameters() if q.requires_grad)
        return list(dict.fromkeys(params))

    def chunk_modules(self, chunk: int) -> list:
        """What chunk ``chunk`` runs: its blocks, plus the embeddings if first, the head if last."""
        c, gpt = self.chunks[chunk], self.chunks[chunk].gpt
        return [c] + [gpt.tok_emb, gpt.pos_emb] * c.first + [gpt.ln_f, gpt.head] * c.last

    # ------------------------------------------------------------------ the step
    def train_step(self, inputs, targets, schedule, num_microbatches: int,
                   dp_group: ProcessGroup | None = None, positions=None, dropout_keys=None):
        m, batch = num_microbatches, inputs.shape[0]
        if not isinstance(m, int) or m < 1 or batch % m:
            raise ValueError(f"{m} micro-batches do not divide the batch of {batch} sequences")
        schedule = resolve_schedule(schedule, self.num_stages, m, self.num_chunks)
        split = any(a[0] == "W" for a in schedule[self.stage])
        # chapter 3's checkpoint recomputes a block and backpropagates into its weights in
        # one go, so with it B already does W's work (and W has nothing left to do)
        # each micro-batch its own storage: memory accounting sees m separate inputs
        state = StepState([t.clone() for t in inputs.chunk(m)],
                          [t.clone() for t in targets.chunk(m)], m,
                          split and self.checkpointing is None, positions)
        state.key, state.dropout_keys = (tuple(inputs.shape[1:]), batch // m), dropout_keys
        ref = next(self.parameters())  # every stage holds at least one block
        state.device = ref.device
        # the last stage sends the loss to every other one (step_messages.py: on gloo the
        # receive is posted now, so the send leaves the moment the loss exists)
        received = post_loss_receive(self, ref.device)
        self.run(schedule, state)
        # the step's sends waited for; the mean loss, in the model's dtype promoted with fp32
        loss = share_loss(self, state, received, torch.promote_types(ref.dtype, torch.float32))
        if dp_group is not None:
            average_gradients(self.parameters(), dp_group)
        return loss


def run_action(stage: PipelineStage, action: tuple, state: StepState) -> None:
    """Run one action of ``stage``'s schedule: receive what it needs, compute, send.

    - ``("F", mb[, c])``: the input is micro-batch ``mb``'s tokens on the first virtual stage,
      else the activation received from virtual stage ``v - 1`` (made a leaf that requires
      grad, so backward yields its gradient); ``stage.forward`` returns (input activation,
      output); keep both in ``state.saved``; send the output to ``v + 1`` unless last.
    - ``("B", mb[, c])``: the output gradient comes from virtual stage ``v + 1`` (none on the
      last: the output is the loss); send the input's gradient to ``v - 1`` unless this is
      the first; the saved pair is no longer needed. With ``state.split_backward`` (zero
      bubble) B computes the input's gradient and leaves the weight GEMMs to W
      (``stage.backward_input``: it parks W's work in ``state.pending_w``); otherwise
      (``stage.backward``) it computes every gradient.
    - ``("W", mb[, c])``: the weight gradients B parked for it (``stage.backward_weights``).
      When the backward was not split (``state.split_backward`` False: a schedule with W run
      with checkpointing, as notebook 07 does) B did all the work and W does nothing.

    Returns nothing; everything lives in ``state`` (``inputs``, ``saved``, ``pending_w``,
    ``split_backward``). May use: ``stage.virtual_stage(c)``, ``stage.is_first(c)``,
    ``stage.is_last(c)``, ``stage.forward(c, mb, x, state)``, ``stage.backward(name, out,
    grad)``, ``stage.backward_input(name, c, mb, out, grad, x, state)`` (returns the input's
    gradient, None on the first virtual stage), ``stage.backward_weights(name, c, work)``,
    ``stage.send(kind, mb, tensor, to_virtual, state)``, ``stage.recv(kind, mb,
    from_virtual, state, like=None)``. Why the received activation must require grad: backward
    stops at leaves that do not, and the previous stage waits for that input's gradient.
    """
    ### BEGIN SOLUTION
    kind, mb = action[0], action[1]
    c = action[2] if len(action) > 2 else 0
    v, key = stage.virtual_stage(c), (mb, c)
    name = f"{kind}{mb}" + (f".{c}" if stage.num_chunks > 1 else "")
    if kind == "F":
        if stage.is_first(c):
            x = state.inputs[mb]
        else:
            x = stage.recv("F", mb, v - 1, state).requires_grad_()
        x, out = stage.forward(c, mb, x, state)
        state.saved[key] = (x, out)
        if not stage.is_last(c):
            stage.send("F", mb, out, v + 1, state)
    elif kind == "B":
        x, out = state.saved.pop(key)
        grad = None if stage.is_last(c) else stage.recv("B", mb, v + 1, state, like=out)
        if state.split_backward:  # the input gradient only: W's GEMMs are parked
            x_grad = stage.backward_input(name, c, mb, out, grad, x, state)
        else:
            stage.backward(name, out, grad)
            x_grad = None if stage.is_first(c) else x.grad
        if not stage.is_first(c):
            stage.send("B", mb, x_grad, v - 1, state)
    elif kind == "W" and key in state.pending_w:
        stage.backward_weights(name, c, state.pending_w.pop(key))
    ### END SOLUTION


