"""The executor's tensor-parallel group: N ranks of one executor joined by torch.distributed.

Rank 0 is the executor the scheduler sees: it receives each step and hands it to the
other ranks with `send`/`recv` (the msgspec-encoded `RankZeroToRanks` bytes broadcast
as a uint8 tensor: no pickle, so not torch's broadcast_object_list). Every rank runs
the step's forward pass on its shard of the model; the row-parallel layers' partial
sums meet in `all_reduce` and the vocab shards' logits in `gather` on rank 0, the only
rank that samples.

The model's collectives run on the device group (NCCL on CUDA, gloo on the CPU); the
step broadcast and the pool sizing always on a gloo group of host tensors. A collective
that fails (a peer died: gloo's "Connection closed by peer") raises `GroupBroken`: the
group cannot be mended, so the rank exits and its supervisor (the launcher, or compose)
starts the whole group again. An idle rank 0 sends a `RankKeepalive` every
KEEPALIVE_S, so a dead peer is noticed between steps too, and the waiting ranks never
reach the group's timeout. A size-1 group (`TPGroup.single()`) has no process group and
every collective is the identity.

Rendezvous: torch.distributed's store and gloo's pairs are unauthenticated plaintext TCP,
so `join` meets only on a loopback address (`shared.curve.is_exposed` decides, after
resolving the host): rank 0 listens on that address alone (torch's own TCPStore would
listen on every interface) and gloo/NCCL are pinned to the loopback interface. Any other
address is refused unless `allow_insecure` (--allow-insecure-tp-rendezvous, or
$PAGEDSERVE_ALLOW_INSECURE_TP_RENDEZVOUS=1), and then a warning is logged: such a group
must sit on a network nobody else can reach.

Exit: gloo's worker thread drops its reference to a finished collective's tensors after
the caller's wait returns; when that is the last reference to a tensor made in Python it
takes the GIL to free it, and during interpreter shutdown that aborts the process
("terminate called without an active exception", exit 134: 21 of 70 bare rank pairs
that only broadcast and stopped). So a rank that stops cleanly (RankStop sent or
received) calls `close`, which destroys the process group, joining gloo's threads, before
the interpreter shuts down (0 of 40). The step broadcast's tensors stay referenced here
until the next message, so that join never waits for a worker that waits for the GIL.
That join happens only when the group object's last reference goes, and torch can keep
references of its own (with LoRA adapters loaded, 10 more after `destroy_process_group`
than without: the threads outlived `close` every time and 4 of 12 test runs aborted). So a
rank process ends with `leave`, which skips interpreter shutdown altogether.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, NoReturn

import msgspec
import torch
import torch.distributed as dist
from torch import Tensor

from services.executor.options import INSECURE_ENV
from shared.curve import is_exposed
from shared.messages import RankZeroToRanks

log = logging.getLogger(__name__)

TIMEOUT_S = 300.0  # a collective (model loading included before the first) waits this long for its peers
KEEPALIVE_S = 1.0
INSECURE_FLAG = "--allow-insecure-tp-rendezvous"  # ParallelOptions.allow_insecure_tp_rendezvous

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(RankZeroToRanks)


class RendezvousRefused(SystemExit):
    """An address the ranks would meet on in the clear where others can reach it."""


class GroupBroken(RuntimeError):
    """A rank cannot go on in step with its group; `peer_lost`: a collective failed (a peer
    died), rather than this rank's own computation."""

    def __init__(self, message: str, peer_lost: bool):
        super().__init__(message)
        self.peer_lost = peer_lost


@dataclass
class TPGroup:
    rank: int
    size: int
    device_group: Any = None  # the model's collectives
    cpu_group: Any = None  # the step broadcast and pool sizing (gloo)
    # the latest step broadcast's tensors, held past gloo's use of them (see the module's docstring)
    _length: Tensor = field(default_factory=lambda: torch.zeros(1, dtype=torch.int64), init=False, repr=False)
    _payload: Tensor | None = field(default=None, init=False, repr=False)

    @classmethod
    def single(cls) -> TPGroup:
        return cls(0, 1)

    @classmethod
    def join(cls, rank: int, size: int, init_address: str, device: torch.device,
             timeout_s: float = TIMEOUT_S, allow_insecure: bool = False) -> TPGroup:
        """Rendezvous of `size` ranks at `init_address` (tcp://host:port, served by rank 0);
        a non-loopback address only with allow_insecure (see the module's docstring)."""
        if not 0 <= rank < size:
            raise ValueError(f"tensor-parallel rank {rank} outside a group of {size}")
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda" and device.index is not None:
            torch.cuda.set_device(device)  # before NCCL's first communicator: else every rank starts on GPU 0
        timeout = timedelta(seconds=timeout_s)
        log.info("rank %d of %d joining at %s (%s)", rank, size, init_address, backend)
        if is_exposed(init_address):
            if not allow_insecure:
                raise RendezvousRefused(
                    f"refusing the tensor-parallel rendezvous at {init_address}: torch.distributed's store and "
                    f"gloo are unauthenticated plaintext TCP, so ranks meet only on loopback addresses. Give "
                    f"{INSECURE_FLAG} (or {INSECURE_ENV}=1) only where no one else can reach that network.")
            log.warning("tensor-parallel rendezvous at %s is unauthenticated and unencrypted (%s): anyone who "
                        "can reach it can join the group or read its tensors", init_address, INSECURE_FLAG)
            dist.init_process_group(backend, init_method=init_address, rank=rank, world_size=size, timeout=timeout)
        else:
            store = _loopback_store(init_address, rank, size, timeout)
            dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
        world = dist.group.WORLD
        cpu_group = world if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
        log.info("rank %d of %d joined", rank, size)
        return cls(rank, size, world, cpu_group)

    def _run(self, what: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except RuntimeError as exc:
            raise GroupBroken(f"tensor-parallel {what} failed on rank {self.rank}: {exc}", peer_lost=True) from exc

    def all_reduce(self, x: Tensor) -> Tensor:
        """The sum of x over the ranks, in place (row-parallel layers' partial outputs)."""
        if self.size > 1:
            self._run("all-reduce", dist.all_reduce, x, group=self.device_group)
        return x

    def gather(self, x: Tensor) -> Tensor | None:
        """Every rank's x concatenated along the last dimension, on rank 0 (None on the others)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        self._run("gather", dist.gather, x, gather_list=parts, dst=0, group=self.device_group)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def min_int(self, value: int) -> int:
        """The least of every rank's value (every rank must call it at the same point)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        self._run("min", dist.all_reduce, t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def any_flags(self, flags: list[bool]) -> list[bool]:
        """Each flag set on any rank (every rank must call it at the same point, with as many flags)."""
        if self.size == 1 or not flags:
            return flags
        t = torch.tensor(flags, dtype=torch.int64)
        self._run("max", dist.all_reduce, t, op=dist.ReduceOp.MAX, group=self.cpu_group)
        return [bool(v) for v in t.tolist()]

    def send(self, msg: RankZeroToRanks) -> None:
        """Rank 0: hand a message to every other rank (which wait in `recv`)."""
        if self.size == 1:
            return
        payload = _encoder.encode(msg)
        self._length.fill_(len(payload))
        self._payload = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        self._run("broadcast", dist.broadcast, self._length, 0, group=self.cpu_group)
        self._run("broadcast", dist.broadcast, self._payload, 0, group=self.cpu_group)

    def recv(self) -> RankZeroToRanks:
        """Ranks > 0: the next message from rank 0 (blocks; rank 0 keeps it alive when idle)."""
        self._run("broadcast", dist.broadcast, self._length, 0, group=self.cpu_group)
        self._payload = torch.empty(int(self._length.item()), dtype=torch.uint8)
        self._run("broadcast", dist.broadcast, self._payload, 0, group=self.cpu_group)
        try:
            return _decoder.decode(self._payload.numpy().tobytes())
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise GroupBroken(f"rank {self.rank}: undecodable message from rank 0: {exc}", peer_lost=True) from exc

    def close(self) -> None:
        """Leave the group after a clean stop (RankStop sent or received): its threads are
        joined while this object still holds the latest broadcast's tensors."""
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()
        self.device_group = self.cpu_group = None  # the last references: the process group goes now


def leave(code: int) -> NoReturn:
    """End this rank's process with `code` once its group is closed: logs and stdio flushed,
    without interpreter shutdown, where gloo threads still alive would abort it (see above)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def insecure_allowed(flag: bool) -> bool:
    return flag or os.environ.get(INSECURE_ENV, "") not in ("", "0")


def _loopback_store(init_address: str, rank: int, size: int, timeout: timedelta) -> dist.TCPStore:
    """The group's store on a loopback address alone, gloo's and NCCL's sockets on the
    loopback interface (unless the operator named one)."""
    host, _, port = init_address[len("tcp://"):].rpartition(":")
    host, port = host.strip("[]"), int(port)
    loopback = next((name for _, name in socket.if_nameindex() if name.startswith("lo")), None)
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        if loopback is not None and not os.environ.get(name):
            os.environ[name] = loopback
    if rank > 0:
        return dist.TCPStore(host, port, size, False, timeout)
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(max(64, size))
    except OSError:
        listener.close()
        raise
    fd = listener.detach()  # the store owns it from here
    try:
        return dist.TCPStore(host, port, size, True, timeout, master_listen_fd=fd)
    except Exception:
        os.close(fd)
        raise
