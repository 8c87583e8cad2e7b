"""A data-parallel learner on ``torch.distributed``: ``k`` processes, one update, one version.

Design (the simplest one that is correct whatever order the bus delivers in): **rank 0
leads**. It is the only learner process on the bus: it admits scored segments, reads their
arrays, publishes every ``policy-version`` and saves every checkpoint, exactly as a single
learner does. The other ranks (followers) never touch the bus; they receive from the
leader, through ``torch.distributed`` collectives, an :class:`UpdateOrder` per update (the
batch itself: its scored events, arrays and global advantages) and follow rollbacks and
restarts (:class:`StartOrder`, :class:`RollbackOrder`: the leader's weights, broadcast).
Consuming the bus on every rank instead would make each rank cut its own batch from its
own interleaving of partitions, and a batch that differs by one segment corrupts the
update silently.

Inside the update (``LearnerCore._optimise`` with a :class:`DataParallel`), every rank holds
the whole batch, so every quantity that spans the batch is computed whole and identically
on every rank before anything is split: values, GAE, fused advantages and their mean/std
normalisation, the critic's advantage screen, the minibatch permutation (same generator
seed on all ranks). Each minibatch is then split by row ownership (row ``i`` belongs to
rank ``i % k``); a rank back-propagates only its rows, with its losses scaled to their
share of the *whole* minibatch (token-mean policy loss and entropy: local tokens over the
minibatch's tokens; step-mean value loss: local rows over the minibatch's rows), so the
sum of gradients over ranks is the single learner's gradient. One ``all_reduce`` (SUM)
per gradient step carries the gradients and the loss statistics; gradient clipping and
the Adam step follow it on every rank, so the weights stay identical without a broadcast.
The proximal log-probs are computed by the owner of each row and summed across ranks.
The critic's periodic refit runs on the whole (small) set of complete returns on every
rank, with gradients averaged before each step (:class:`AveragedSteps`), so nondeterministic
kernels cannot make the ranks drift apart.

Not supported with ``world_size > 1``: the elite pool (its store has one writer).
Backend: ``nccl`` when the policy's parameters live on a CUDA device, else ``gloo``.
"""

from __future__ import annotations

import datetime as dt
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import structlog
import torch
import torch.distributed as dist

from gyre_async.errors import ConfigError

if TYPE_CHECKING:
    from gyre_async.core.learner import LearnerCore
from schemas.config import Config
from schemas.events import Rollback, Scored

DEFAULT_RENDEZVOUS = "tcp://127.0.0.1:29511"
#: how long a follower waits for the leader's next order (a run may idle for hours); a
#: leader that dies closes its connections, which ends its followers at once
WAIT_LIMIT = dt.timedelta(hours=24)
log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Membership:
    """This process's place in the learner group, and where the group meets."""

    rank: int
    world_size: int
    init_method: str  # "env://" (torchrun's MASTER_ADDR/MASTER_PORT), tcp://, file://

    @property
    def leads(self) -> bool:
        return self.rank == 0


def membership(cfg: Config, environ: Mapping[str, str] | None = None) -> Membership:
    """Rank and world size as torchrun sets them (``RANK``, ``WORLD_SIZE``), else rank 0 of
    ``learner.world_size``; the rendezvous is ``learner.rendezvous``, else ``env://`` when
    ``MASTER_ADDR`` is set, else :data:`DEFAULT_RENDEZVOUS` (one machine)."""
    env = os.environ if environ is None else environ
    world_size = int(env.get("WORLD_SIZE", cfg.learner.world_size))
    rank = int(env.get("RANK", 0))
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(f"learner rank {rank} of world size {world_size}: need "
                          "0 <= RANK < WORLD_SIZE (set learner.world_size, or run torchrun)")
    if world_size > 1 and cfg.elite.capacity:
        raise ConfigError("a data-parallel learner (world_size > 1) does not support the "
                          "elite pool: set elite.capacity = 0 or learner.world_size = 1")
    init = cfg.learner.rendezvous or ("env://" if "MASTER_ADDR" in env else DEFAULT_RENDEZVOUS)
    return Membership(rank, world_size, init)


class DataParallel:
    """The learner's process group: row ownership, gradient and tensor sums, messages."""

    def __init__(self, member: Membership, device: torch.device):
        self.rank, self.world_size = member.rank, member.world_size
        self.device = device
        if not dist.is_initialized():
            backend = "nccl" if device.type == "cuda" else "gloo"
            log.warning("learner group: joining (waits for every rank)", rank=member.rank,
                        world_size=member.world_size, backend=backend,
                        init_method=member.init_method)
            dist.init_process_group(backend, init_method=member.init_method, rank=member.rank,
                                    world_size=member.world_size, timeout=WAIT_LIMIT)

    def owned(self, rows: Iterable[int]) -> list[int]:
        """The rows this rank computes: row ``i`` belongs to rank ``i % world_size``."""
        return [i for i in rows if i % self.world_size == self.rank]

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The element-wise sum of ``tensor`` over ranks (on ``tensor``'s device)."""
        moved = tensor.to(self.device).contiguous()
        dist.all_reduce(moved, op=dist.ReduceOp.SUM)
        return moved.to(tensor.device)

    def sum_gradients(self, params: Sequence[torch.nn.Parameter],
                      stats: Sequence[float] = ()) -> list[float]:
        """Sum every parameter's gradient (and ``stats``) over ranks, in one all-reduce.

        A gradient is None afterwards only where it was None on every rank (a rank that
        owned no row of a minibatch contributes zeros), as for a single learner."""
        flat = torch.cat([*(torch.zeros(p.numel(), device=self.device) if p.grad is None
                            else p.grad.detach().reshape(-1).to(self.device, torch.float32)
                            for p in params),
                          torch.tensor([float(p.grad is not None) for p in params],
                                       device=self.device),
                          torch.tensor(list(stats), dtype=torch.float32, device=self.device)])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        start = sum(p.numel() for p in params)
        tail = flat[start:].tolist()  # one device sync: the flags, then the stats
        start = 0
        for p, has_grad in zip(params, tail):
            piece = flat[start:start + p.numel()].view_as(p).to(p.device, p.dtype)
            start += p.numel()
            p.grad = piece if has_grad > 0 else None
        return tail[len(params):]

    def broadcast_parameters(self, module) -> None:
        """Every rank takes rank 0's weights (start, restart, rollback)."""
        with torch.no_grad():
            for p in module.parameters():
                moved = p.data.to(self.device)
                dist.broadcast(moved, src=0)
                p.data.copy_(moved)

    def send(self, message: object) -> None:
        """Rank 0: hand ``message`` to every follower (pickled through a broadcast)."""
        dist.broadcast_object_list([message], src=0, device=self._object_device)

    def receive(self) -> object:
        box: list[object] = [None]
        dist.broadcast_object_list(box, src=0, device=self._object_device)
        return box[0]

    @property
    def _object_device(self) -> torch.device | None:
        return self.device if self.device.type == "cuda" else None

    def close(self) -> None:
        """Leave together (after a :class:`StopOrder`): a rank that tears its connections
        down while another still talks on them takes that one down with it."""
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


class AveragedSteps:
    """An optimizer whose ``step`` first averages the gradients over ranks.

    For passes that every rank runs on the same whole data (the critic's refit): the
    gradients agree already on deterministic kernels, and averaging keeps the ranks'
    weights identical where kernels are not deterministic."""

    def __init__(self, optimizer: torch.optim.Optimizer, dp: DataParallel,
                 params: Sequence[torch.nn.Parameter]):
        self.optimizer, self.dp, self.params = optimizer, dp, list(params)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def step(self) -> None:
        self.dp.sum_gradients(self.params)
        with torch.no_grad():
            for p in self.params:
                if p.grad is not None:
                    p.grad /= self.dp.world_size
        self.optimizer.step()


# -- leader -> followers ------------------------------------------------------------------
@dataclass(frozen=True)
class StartOrder:
    """The leader started (version published or restored); its weights follow."""

    version: int
    learning_rate: float
    resumed: bool  # restored from a checkpoint: keep its critic (no prior)


@dataclass(frozen=True)
class UpdateOrder:
    """One update: the batch as the leader cut it, and the global advantages it used."""

    version: int
    batch: list[tuple[Scored, dict[str, np.ndarray]]]
    global_advantages: list[float]


@dataclass(frozen=True)
class RollbackOrder:
    """A keeper order the leader followed; the restored weights follow."""

    version: int
    order: Rollback


@dataclass(frozen=True)
class StopOrder:
    """The leader stopped: followers leave."""


class LearnerGroup:
    """What the learner actor calls at its decision points; with one process, plain calls.

    The leader's side of the protocol: each method sends its order to the followers
    before doing the work itself, so every rank runs the same update on the same batch."""

    def __init__(self, member: Membership):
        """Before the policy is built: a rank on a GPU machine picks its own GPU."""
        self.member = member
        self.dp: DataParallel | None = None
        select_device(os.environ)

    def attach(self, policy) -> DataParallel | None:
        """Join the process group (world_size > 1) on the policy's device."""
        if self.member.world_size > 1 and self.dp is None:
            self.dp = DataParallel(self.member, next(iter(policy.parameters())).device)
        return self.dp

    def started(self, core: LearnerCore, resumed: bool) -> None:
        if self.dp is not None:
            self.dp.send(StartOrder(core.version, core.learning_rate, resumed))
            self.dp.broadcast_parameters(core.policy)

    def rolled_back(self, core: LearnerCore, order: Rollback) -> None:
        """Before ``core.rollback(order)``: the followers take the restored weights."""
        if self.dp is not None:
            self.dp.send(RollbackOrder(core.version, order))
            self.dp.broadcast_parameters(core.policy)

    def update(self, core: LearnerCore):
        """``core.update()`` on every rank, on the leader's batch."""
        if self.dp is None:
            return core.update()
        global_advantages = core.global_advantages(core.buffer)
        self.dp.send(UpdateOrder(core.version, [(b.scored, b.arrays) for b in core.buffer],
                                 global_advantages))
        return core.update(global_advantages)

    def stop(self) -> None:
        if self.dp is not None:
            self.dp.send(StopOrder())
            self.dp.close()
            self.dp = None


def follow(core: LearnerCore, dp: DataParallel) -> None:
    """A follower's life: mirror the leader's updates, rollbacks and restarts until it stops.

    ``core`` is a :class:`~gyre_async.core.learner.LearnerCore` built from the same config
    (and ``dp``); it keeps its own optimizer and critic state, which stay identical to the
    leader's because they see the same batches and the same summed gradients."""
    from gyre_async.core.learner import Buffered

    while True:
        message = dp.receive()
        match message:
            case StartOrder(version=version, learning_rate=lr, resumed=resumed):
                dp.broadcast_parameters(core.policy)
                core.version = version
                core.set_learning_rate(lr)
                if resumed:
                    core.critic.resume()
            case UpdateOrder(version=version, batch=batch, global_advantages=advantages):
                core.version = version
                core.buffer = [Buffered(scored, arrays, (0, index))
                               for index, (scored, arrays) in enumerate(batch)]
                core.update(advantages)
            case RollbackOrder(version=version, order=order):
                dp.broadcast_parameters(core.policy)
                core.version = version
                core.rollback(order)
            case StopOrder():
                return
            case _:
                raise TypeError(f"learner follower: unexpected order {type(message).__name__}")


def follows_leader(cfg: Config, rank: int | None = None) -> bool:
    """``gyre actor learner [--rank N]``: on a rank > 0, follow the leader until it stops
    and return True; on rank 0 return False (the caller runs the learner actor).
    ``rank`` overrides ``$RANK`` (and sets it, so the actor sees the same rank)."""
    if rank is not None:
        os.environ["RANK"] = str(rank)
    member = membership(cfg)
    if member.leads:
        return False
    run_follower(cfg, member)
    return True


def run_follower(cfg: Config, member: Membership) -> LearnerCore:
    """``gyre actor learner`` on a rank > 0: no bus, only the leader's orders. Returns the
    core it followed with (its weights and counters: what tests and benches compare)."""
    from gyre_async.compose import build_policy, build_tokenizer
    from gyre_async.core.learner import LearnerCore

    select_device(os.environ)
    torch.manual_seed(cfg.run.seed)
    policy = build_policy(cfg, build_tokenizer(cfg))
    dp = DataParallel(member, next(iter(policy.parameters())).device)
    core = LearnerCore(cfg, policy, None, dp)
    follow(core, dp)  # an error ends the process: the leader's next collective fails too
    dp.close()
    return core


def select_device(environ: Mapping[str, str]) -> None:
    """One GPU per process (torchrun's ``LOCAL_RANK``, else ``RANK``, modulo the GPUs
    this process sees), before any model is built; nothing without a GPU."""
    if torch.cuda.is_available():
        local = int(environ.get("LOCAL_RANK", environ.get("RANK", 0)))
        torch.cuda.set_device(local % torch.cuda.device_count())
