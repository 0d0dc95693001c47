"""The inference side of a live weight sync: :class:`Subscriber`.

Who does what, on every inference rank, in the caller's thread:

- :meth:`Subscriber.receive` (blocking): at the first call, or the first after a failed version, join a
  new generation (rank 0 registers it; one all-reduce of 8 bytes on the inference job's private gloo
  group; the pair group; two all-gathers to exchange layouts; the plan, computed alike on every rank
  of both jobs), then wait on the store for the next version's announcement and receive one message
  from each training rank that holds bytes this rank needs, into that sender's *staging buffer* (the
  second buffer: the model is not touched). A delta is applied to the staging buffer; each message's
  checksum is compared with the sender's (a mismatch asks for a full resend, a second one fails the
  version). The inference ranks then agree (one all-reduce of one int64 on the job's private gloo group):
  the version is *staged* on all of them, or on none, and all join again.
- :meth:`Subscriber.apply`: copy the staged version from the staging buffers into the model (or hand it
  to a ``load_weights`` callable), holding :attr:`Subscriber.lock`. Run inference under the same lock
  (or only between applies, in one thread) and it never sees a mix of two versions.

A version that fails (a training rank died, a message failed twice) leaves the model on the last applied
version and raises :class:`~unickpt.errors.SyncError`; the staging buffers are then invalid, so the next
receive joins a new generation, whose first version is full.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from ..dist.comm import Comm
from ..errors import StateMismatchError, SyncError
from ..plan.mapping import Mapping
from ..plan.transfer import PairPlan, needs_from_json, needs_to_json, plan_transfers, resolve_needs, sources_from_json
from . import wire
from .group import Generations, PairGroup, max_ints, open_store
from .publisher import TAG_ACK, TAG_HEADER, TAG_PAYLOAD
from .tensors import Held, local_view, targets

__all__ = ["Subscriber", "ReceiveReport"]


@dataclass
class ReceiveReport:
    """One :meth:`Subscriber.receive` on one inference rank: the ``version`` staged, the payload
    ``bytes_received`` (resends included) and what a full version would be (``full_bytes``), messages
    by kind, ``seconds`` in all and ``plan_seconds`` of them (joining a generation and planning; 0.0 when
    the plan was reused), and the checksums verified (one per message)."""

    version: int
    generation: int = 0
    bytes_received: int = 0
    full_bytes: int = 0
    full_pairs: int = 0
    delta_pairs: int = 0
    resent_pairs: int = 0
    verified: int = 0
    seconds: float = 0.0
    plan_seconds: float = 0.0


class _Stage:
    """One sender's staging buffer on this receiver, and the copies out of it."""

    def __init__(self, plan: PairPlan, sender: int, device: torch.device):
        self.plan, self.sender = plan, sender
        self.buf = torch.zeros(plan.nbytes, dtype=torch.uint8, device=device)
        self.version = -1  # the verified version the buffer holds (-1: none): the only base a delta may have
        self.delta: tuple[int, torch.Tensor, torch.Tensor] | None = None  # (base seq, word indices, values)
        # of the last version, when it came as a delta: apply() writes just those words into a model that
        # holds the base (the version received before it in this generation)


class Subscriber:
    """Receives a training job's weights into an inference model, a complete version or none.

    Args:
        target: an ``nn.Module`` updated in place (plain or tensor-parallel with DTensor parameters; its
            parameters and persistent buffers as ``get_model_state_dict`` names them), or, with
            ``load_weights``, a template ``{name: (shape, dtype)}`` of the full tensors that callable takes.
        address: the rendezvous (``"host:port"`` of the training job's rank 0, or a ``torch.distributed.Store``).
        mapping: :class:`~unickpt.Mapping` rules naming the targets by the published tensors (Megatron
            -> Hugging Face: ``unickpt.megatron.hf.llama_rules(..., to="hf")``); None: the same names.
        load_weights: ``load_weights(iterable of (name, tensor))``, called by :meth:`apply` with every
            full tensor of the template: the weight-update interface of vLLM and SGLang
            (``model.load_weights``). The tensors are this subscriber's buffers, reused: copy what you keep.
        process_group: the inference ranks (default: the world; ``unickpt.ext.THIS_PROCESS``: this process alone).
        timeout_s: deadline of each message and of joining (seconds).
    """

    def __init__(self, target: Any, address: Any, *, mapping: Mapping | None = None,
                 load_weights: Callable[[Iterable[tuple[str, torch.Tensor]]], Any] | None = None,
                 process_group: Any = None, timeout_s: float = 300.0):
        if load_weights is not None and not (isinstance(target, dict) and all(
                isinstance(v, tuple) and len(v) == 2 for v in target.values())):
            raise TypeError("with load_weights=, target must be a template {name: (shape, dtype)}")
        self.target, self.mapping, self.load_weights, self.timeout_s = target, mapping, load_weights, timeout_s
        self.comm = Comm(process_group, timeout_s=timeout_s)
        self.rank, self.world = self.comm.rank, self.comm.world_size
        self.store = open_store(address, host=False, timeout_s=timeout_s)
        self.gens = Generations(self.store)
        self.lock = threading.Lock()
        """Held by :meth:`apply` while it writes the model; hold it while running inference."""
        self.version: int | None = None
        """The version the model holds (None before the first :meth:`apply`)."""
        self.staged: int | None = None
        self.generation = 0
        self.group: PairGroup | None = None
        self.publishers = 0
        self._stages: list[_Stage] = []
        self._held: list[Held] = []
        self._seq = 0  # versions received whole in this generation
        self._pending: int | None = None  # a generation registered whose trainer has not joined yet
        self._staged_at: tuple[int, int] | None = None  # (generation, seq) of the staged version
        self._applied_at: tuple[int, int] | None = None  # (generation, seq) of the version the model holds

    # -- joining ---------------------------------------------------------------------------------------------
    def _join(self, timeout_s: float) -> None:
        entries, held, own_aliases = targets(self.target)
        on_cuda = bool(held) and held[0].tensor.device.type == "cuda"
        if self._pending is None:  # registered once; a join that times out waits for the same one next time
            g = self.gens.register(self.world, "cuda" if on_cuda else "cpu") if self.rank == 0 else 0
            self._pending = max_ints(self.comm, [g])[0]  # rank 0's (the others give 0)
        g = self._pending
        pubs = self.gens.publishers(g, timeout_s)
        device = held[0].tensor.device if on_cuda and self.gens.data_device(g) == "cuda" else torch.device("cpu")
        group = PairGroup(self.store, g, pubs + self.rank, pubs + self.world, device, self.timeout_s)
        self._pending = None
        self.group, self.generation, self.publishers, self._seq = group, g, pubs, 0
        docs = [sources_from_json(d) for d in group.allgather_bytes(b"")[:pubs]]
        sources = [entries_ for entries_, _ in docs]
        shapes = {e.name: (e.shape, e.dtype) for s in sources for e in s}
        aliases = docs[0][1] if docs else {}
        try:
            mine = needs_to_json(resolve_needs(entries, shapes.get, self.mapping, aliases, own_aliases))
        except StateMismatchError as e:
            mine = needs_to_json(None, str(e))
        answers = [needs_from_json(d) for d in group.allgather_bytes(mine)[pubs:]]
        for r, (_, error) in enumerate(answers):
            if error is not None:
                raise StateMismatchError(f"inference rank {r}: {error}")
        plan = plan_transfers(sources, [n for n, _ in answers])
        self._held = held
        self._stages = [_Stage(plan.pairs[(s, self.rank)], s, device) for s in plan.senders_of(self.rank)]

    def _drop(self) -> None:
        if self.group is not None:
            self.group.close()
        self.group, self._stages, self.staged, self._staged_at = None, [], None, None

    # -- receiving -------------------------------------------------------------------------------------------
    def receive(self, timeout_s: float | None = None) -> ReceiveReport:
        """Wait for the next version and stage it (the model is unchanged until :meth:`apply`).

        Raises TimeoutError when no trainer joins or no version comes within ``timeout_s`` (default: the
        constructor's; nothing is lost, call again), SyncError when a version fails part way (a trainer
        rank died; the model keeps :attr:`version`; the next call joins again), StateMismatchError when
        the model does not match what is published (named)."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        t0 = time.perf_counter()
        plan_s = 0.0
        if self.group is None:
            try:
                self._join(timeout_s)
            except dist.DistNetworkError as e:  # the store's host (the trainer's rank 0) is gone
                self._drop()
                raise SyncError(f"the weight-sync rendezvous store is unreachable ({e}): is the training job up?") from e
            except BaseException:
                self._drop()
                raise
            plan_s = time.perf_counter() - t0
        version = self.gens.announced(self.generation, self._seq + 1, timeout_s)
        if version is None:
            g = self.generation
            self._drop()
            raise SyncError(f"the trainer left weight-sync generation {g} (it closed, restarted or lost a version); "
                            "the next receive joins again and gets a full version")
        report = ReceiveReport(version, self.generation, plan_seconds=plan_s)
        error: BaseException | None = None
        try:
            self._receive(version, report)
        except Exception as e:  # noqa: BLE001 - agreed below, then raised
            error = e
        # every inference rank learns whether any failed (one all-reduce of one int64 on the job's private
        # gloo group): all stage this version, or none does and all join again
        if max_ints(self.comm, [int(error is not None)])[0]:
            g = self.generation
            self._drop()
            kept = "no version yet" if self.version is None else f"version {self.version}"
            why = ("another inference rank did not get it whole" if error is None else
                   str(error) if isinstance(error, SyncError) else f"{type(error).__name__}: {error}")
            raise SyncError(f"version {version} of generation {g} was not received whole ({why}); the model "
                            f"keeps {kept}, and the next receive joins again") from error
        self._seq += 1
        self.staged, self._staged_at = version, (self.generation, self._seq)
        report.seconds = time.perf_counter() - t0
        return report

    def _take(self, stage: _Stage, hdr: torch.Tensor, version: int) -> torch.Tensor | None:
        """Post the payload receive a header announces; returns the delta payload buffer (None: full,
        received straight into the staging buffer)."""
        assert self.group is not None
        v, kind, nbytes = (int(x) for x in hdr[:3])
        if v != version:
            raise SyncError(f"trainer rank {stage.sender} sent version {v} while version {version} was announced")
        if kind == wire.FULL:
            if nbytes != stage.plan.nbytes:
                raise SyncError(f"trainer rank {stage.sender}: a full message of {nbytes} bytes, the plan says "
                                f"{stage.plan.nbytes}")
            stage.version, stage.delta = -1, None
            return None
        return torch.empty(nbytes, dtype=torch.uint8, device=stage.buf.device)

    def _verify(self, stage: _Stage, hdr: torch.Tensor, payload: torch.Tensor | None) -> bool:
        """Check a message and, for a delta onto this stage's version, apply it to the staging buffer."""
        if payload is None:
            return wire.digest(stage.buf) == int(hdr[3])
        base, changed = int(hdr[5]), int(hdr[4])
        if base != stage.version or wire.digest(payload) != int(hdr[3]):
            return False  # a delta onto another version, or corrupted: ask for the whole buffer
        idx, values = wire.decode_delta(payload, changed, stage.plan.word, stage.plan.nbytes // stage.plan.word)
        stage.buf.view(wire.WORD_DTYPES[stage.plan.word])[idx] = values
        stage.delta = (self._seq, idx, values)  # onto the version received before this one
        return True

    def _receive(self, version: int, report: ReceiveReport) -> None:
        group = self.group
        assert group is not None
        heads = [torch.empty(wire.HEADER_WORDS, dtype=torch.int64) for _ in self._stages]
        works = [group.recv_control(h, st.sender, TAG_HEADER) for h, st in zip(heads, self._stages)]
        payloads: list[torch.Tensor | None] = []
        data_works = []
        for st, h, w in zip(self._stages, heads, works):
            w.wait(group.timeout)
            p = self._take(st, h, version)
            payloads.append(p)
            buf = st.buf if p is None else p
            if buf.numel():
                data_works.append(group.recv_data(buf, st.sender, TAG_PAYLOAD))
        for w in data_works:
            w.wait(group.timeout)
        acks = []
        for st, h, p in zip(self._stages, heads, payloads):
            report.full_bytes += st.plan.nbytes
            if p is None:
                report.full_pairs += 1
                report.bytes_received += st.plan.nbytes
            else:
                report.delta_pairs += 1
                report.bytes_received += p.numel()
            ok = self._verify(st, h, p)
            report.verified += ok
            status = torch.tensor([wire.OK if ok else wire.RESEND], dtype=torch.int64)
            acks.append((st, h, ok, status, group.send_control(status, st.sender, TAG_ACK)))
        failed: list[int] = []
        for st, h, ok, status, w in acks:
            w.wait(group.timeout)
            if ok:
                st.version = version
                continue
            report.resent_pairs += 1
            again = torch.empty(wire.HEADER_WORDS, dtype=torch.int64)
            group.recv_control(again, st.sender, TAG_HEADER).wait(group.timeout)
            self._take(st, again, version)
            group.recv_data(st.buf, st.sender, TAG_PAYLOAD).wait(group.timeout)
            report.bytes_received += st.plan.nbytes
            ok = wire.digest(st.buf) == int(again[3])
            group.send_control(torch.tensor([wire.OK if ok else wire.FAILED], dtype=torch.int64), st.sender,
                               TAG_ACK).wait(group.timeout)
            if not ok:  # every sender's resend is taken first, so that none is left blocked on this rank
                failed.append(st.sender)
                continue
            report.verified += 1
            st.version = version
        if failed:
            raise SyncError(f"version {version}: the messages from trainer rank(s) {failed} failed their checksum "
                            "twice (full resend included)")

    # -- applying --------------------------------------------------------------------------------------------
    def _apply_stage(self, st: _Stage) -> None:
        """Copy one staging buffer's items into their targets: only the changed words when the buffer's
        last version came as a delta onto the version the model holds and the target is contiguous,
        else the whole item."""
        fast = st.delta is not None and self._applied_at == (self.generation, st.delta[0])
        word = st.plan.word
        for it in st.plan.items:
            h = self._held[it.target]
            dst = local_view(h, it.region)
            if fast and dst.is_contiguous():
                assert st.delta is not None
                _, idx, values = st.delta
                lo, hi = it.offset // word, (it.offset + it.nbytes) // word
                a, b = (int(x) for x in torch.searchsorted(idx, torch.tensor([lo, hi], device=idx.device)))
                if a < b:
                    dst.reshape(-1).view(wire.WORD_DTYPES[word])[idx[a:b] - lo] = values[a:b]
                continue
            dst.copy_(st.buf[it.offset:it.offset + it.nbytes].view(h.dtype).view(it.region.lengths))

    def apply(self) -> int:
        """Write the staged version into the model (or hand it to ``load_weights``) under :attr:`lock`;
        returns its version. Raises SyncError when nothing is staged."""
        if self.staged is None:
            raise SyncError("no version is staged: receive() one first (a failed receive stages nothing)")
        with self.lock:
            with torch.no_grad():
                for st in self._stages:
                    self._apply_stage(st)
                if self.load_weights is not None:
                    self.load_weights((h.name, h.tensor) for h in self._held)
            self.version, self._applied_at = self.staged, self._staged_at
        return self.version

    def update(self, timeout_s: float | None = None) -> ReceiveReport:
        """:meth:`receive` then :meth:`apply`."""
        report = self.receive(timeout_s)
        self.apply()
        return report

    def close(self) -> None:
        """Leave: the trainer drops this generation at its next publish (or, if a version is on its way,
        when its transfer breaks off: it sees the generation closed, not failed). Collective over the
        inference ranks: rank 0 marks the generation closed before any rank drops its connections."""
        if self.generation and self.rank == 0:
            self.gens.close(self.generation)
        if self.comm.world_size > 1:
            dist.barrier(group=self.comm.plan_group)
        self._drop()
        self.comm.close()

    def __enter__(self) -> "Subscriber":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
