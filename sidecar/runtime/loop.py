"""The sidecar's control thread: the single owner of all mutable state.

Everything that changes pool, index, leases, sessions or clients runs here, so
none of it needs locks.  Other threads (liveness monitor, L3 workers) hand work
in through :meth:`ControlLoop.post` (a deque plus a doorbell ring) and never touch
state directly.

The loop: serve every client ring that has work (first: after a wake-up the command
that woke us is the latency that counts), rescan the slot table when a client bumped
the epoch, run posted events and due timers; when there is nothing to do, publish the
stats if due, spin briefly, then sleep on the sidecar doorbell until a client or
worker rings it or the next timer (``timers`` below) is due.  No periodic polling
when idle.  The idle sleep (``Doorbell.sleep_rings``) names the client ring that woke
it, and that client is served before the rest of the pass: after an idle gap every line
between the wake-up and the reply is the request's latency (``bench ring``'s idle rows).

What the thread spends its time on is counted where it is dispatched (:class:`BusyTime`): every
op's handler, every posted event, every due timer, by name -- wall time (being descheduled
counts: on a shared core that is time no other request is served), one clock read before and
after each, never per block.  The names are the code's (an op routed to a handler, a function's
qualified name), a bounded set: what the ``stats`` op, Prometheus and a benchmark read to say
which work holds the thread.

The loop is transport and dispatch only: the built-in ops (attach, detach, ping,
stats) and the stats publishing are ``kvsidecar.sidecar.runtime.builtins``, mounted
like any service; every completion is built by ``protocol.ok_completion`` (written out in
:meth:`ControlLoop._handle`, the request's path) or ``protocol.error_completion`` (through
:meth:`ControlLoop._error`, which counts it).
"""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
import os
import time

from kvsidecar.shm import protocol
from kvsidecar.shm.control import (
    SLOT_CLAIMED,
    SLOT_FREE,
    STATE_READY,
    STATE_STOPPING,
    ControlSegment,
    describe_slot_holders,
)
from kvsidecar.shm.errors import ErrorCode, ProtocolError
from kvsidecar.shm.protocol import decode_request, ok_completion
from kvsidecar.shm.ring import Oversize, RingCorrupted

from kvsidecar.sidecar.config import SidecarConfig
from kvsidecar.sidecar.observe.snapshot import ClientSnapshot, LoopSnapshot, SidecarSnapshot
from kvsidecar.sidecar.runtime.builtins import BuiltinOps, StatsPublisher
from kvsidecar.sidecar.runtime.clients import ClientConn
from kvsidecar.sidecar.runtime.liveness import LivenessMonitor
from kvsidecar.sidecar.service import DEFERRED, OpError, Service

log = logging.getLogger(__name__)

MAX_IDLE_SLEEP_S = 30.0  # bound on any sleep, even with no timers at all
EXHAUSTION_LOG_EVERY_S = 10.0  # at most one "slots exhausted" line per this (the counter is exact)


class BusyTime:
    """The control thread's time by what it ran: ``name -> [count, seconds, max seconds]``.
    Names are ``op:<op>``, ``event:<qualified name>`` and ``timer:<qualified name>`` (see the
    module docstring).  Control thread only."""

    __slots__ = ("by_name",)

    def __init__(self):
        self.by_name: dict[str, list] = {}

    def add(self, name: str, seconds: float) -> None:
        b = self.by_name.get(name)
        if b is None:
            self.by_name[name] = [1, seconds, seconds]
            return
        b[0] += 1
        b[1] += seconds
        if seconds > b[2]:
            b[2] = seconds

    def snapshot(self) -> dict:
        return {k: tuple(v) for k, v in self.by_name.items()}

    @staticmethod
    def name_of(kind: str, fn) -> str:
        return f"{kind}:{getattr(fn, '__qualname__', None) or type(fn).__name__}"


class ControlLoop:
    """Control loop over one control segment.  Services are mounted once (:meth:`mount`) and see
    it only as a :class:`~kvsidecar.sidecar.service.Host`; the process around it is
    :class:`~kvsidecar.sidecar.app.SidecarApp`."""

    def __init__(self, cfg: SidecarConfig, ctl: ControlSegment, layout: dict | None = None, death_word_of=None):
        self.cfg = cfg
        self.ctl = ctl
        self.layout = layout
        self.limits = protocol.Limits(
            max_frame_bytes=cfg.transport.max_frame_bytes,
            max_blocks=cfg.transport.max_blocks_per_request,
        )
        self.doorbell = ctl.sidecar_doorbell
        self.clients: dict[int, ClientConn] = {}
        self._serving: tuple[ClientConn, ...] = ()  # clients.values(), rebuilt when it changes
        self._submits: tuple = ()  # their submit rings, in the same order (the idle sleep's condition)
        self.handlers: dict[str, object] = {}
        # what a client may call in each state (op -> handler), so a request is one lookup in its
        # client's table: before attach, attached as an observer, attached with a KV layout
        self._route_tables: tuple[dict, dict, dict] = ({}, {}, {})
        self.services: list[Service] = []
        self.counters: collections.Counter = collections.Counter()  # free-form: the loop's and services'
        self.op_counts: collections.Counter = collections.Counter()  # op name -> dispatched
        self.busy = BusyTime()  # the thread's time by op, event and timer
        self.error_counts: collections.Counter = collections.Counter()  # ErrorCode -> error completions
        self.rings_corrupted = 0
        self.requests = 0  # every frame received (``counters["requests"]`` in the snapshot)
        self._events: collections.deque = collections.deque()
        self._timers: list = []  # heap of (due, seq, fn)
        self._timer_seq = itertools.count()
        self._tokens = itertools.count(1)
        self._epoch_seen = -1
        self._exhaustions_seen = ctl.slot_exhaustions  # a restart over a stale segment: count anew
        self._exhaustions_logged = 0
        self._exhaustion_logged_at = float("-inf")
        self._running = False
        self._stop_requested = False
        self._woke_client = False  # this step's completions woke a sleeping client (see run)
        self._slept_at = float("-inf")  # when the loop last went to wait
        self.liveness = LivenessMonitor(self._on_client_dead, death_word_of=death_word_of)
        self.publisher = StatsPublisher(ctl, self.snapshot, cfg.transport.stats_interval_ms * 1e-3)
        self.mount(BuiltinOps(self, ctl, instance=cfg.instance, layout=layout, checksums=cfg.integrity.checksums))

    # -- cross-thread entry points -----------------------------------------------------------
    def post(self, fn, *args) -> None:
        """Run ``fn(*args)`` on the control thread soon.  Safe from any thread."""
        self._events.append((fn, args))
        self.doorbell.ring()

    def request_stop(self) -> None:
        """Ask the loop to stop (safe from signal handlers and other threads)."""
        self._stop_requested = True
        self.doorbell.ring()

    # -- services ----------------------------------------------------------------------------
    def mount(self, service: Service) -> None:
        """Serve ``service``'s ops and call its hooks (once per service, before ``run``)."""
        if service in self.services:
            raise ValueError(f"{type(service).__name__} is mounted already")
        ops = service.ops()
        for name in ops:
            if name not in protocol.OP_SCHEMAS:
                raise ValueError(f"{type(service).__name__} serves {name!r}, which has no schema")
            if name in self.handlers:
                raise ValueError(f"op {name!r} is served twice")
        self.handlers.update(ops)
        before, observer, kv = self._route_tables  # updated in place: a client holds one of them
        for name, fn in ops.items():
            if name in ("attach", "detach"):
                before[name] = fn
            if not protocol.OP_SCHEMAS[name].kv:
                observer[name] = fn
            kv[name] = fn
        self.services.append(service)

    def check(self) -> str:
        """Every mounted service's invariants: '' when all hold."""
        return "; ".join(filter(None, (svc.check() for svc in self.services)))

    # -- timers (control thread only) --------------------------------------------------------
    def call_at(self, due: float, fn, *args) -> None:
        heapq.heappush(self._timers, (due, next(self._timer_seq), fn, args))

    # -- the loop ----------------------------------------------------------------------------
    def run(self) -> None:
        self.liveness.start()
        self.ctl.set_state(STATE_READY)
        self._running = True
        spin_s = self.cfg.transport.sidecar_spin_us * 1e-6
        log.info("sidecar %s ready (generation %d)", self.cfg.instance, self.ctl.generation)
        try:
            while not self._stop_requested:
                worked = self._step()
                if worked:
                    self.publisher.dirty = True
                    continue
                now = time.monotonic()
                timeout = self.publisher.timeout(now, MAX_IDLE_SLEEP_S)  # never on the request path
                if self._timers:
                    timeout = max(0.0, min(timeout, self._timers[0][0] - now))
                # A client this step had to wake was asleep: spinning for its next request pays only
                # in a stream of back-to-back requests, which the last sleep shows (it ended within
                # the spin).  Without this both sides would sleep on every request of such a stream.
                spin = spin_s if not self._woke_client or now - self._slept_at < 2 * spin_s else 0.0
                self._woke_client = False
                self._slept_at = now
                if spin > 0:
                    self.doorbell.wait(self._has_work, timeout, spin, recheck=False)  # _step re-checks
                    continue
                # Idle: sleep at once; a request that wakes us is served before the rest of _step
                # (after a wake-up the loop's lines are the request's latency: bench ring idle rows).
                woken_by = self.doorbell.sleep_rings(self._has_work, self._submits, timeout)
                if woken_by >= 0 and self._serve(self._serving[woken_by]):
                    self.publisher.dirty = True
        finally:
            self.ctl.set_state(STATE_STOPPING)
            self._running = False

    def shutdown(self) -> None:
        """Release every client's resources (after ``run`` returned)."""
        for conn in list(self.clients.values()):
            self._drop_client(conn, reason="shutdown", free_slot=False)
        self.liveness.stop()
        self.publisher.publish(time.monotonic())

    def _has_work(self) -> bool:
        if self._events or self._stop_requested:
            return True
        if self.ctl.slot_epoch != self._epoch_seen:
            return True
        if self._timers and self._timers[0][0] <= time.monotonic():
            return True
        for conn in self.clients.values():
            if conn.outbox:
                if conn.completion.free_bytes() >= conn.completion.capacity // 2:
                    return True
            elif conn.submit.has_data():
                return True
            if conn.detaching:
                try:
                    if conn.completions_drained():
                        return True
                except RingCorrupted:
                    return True  # _serve drops it
        return False

    def _step(self) -> bool:
        """One pass: client rings first (after a wake-up the command that woke us is the
        latency that counts; everything else is not waited on), then the slot table,
        posted events and due timers."""
        worked = False
        for conn in self._serving:
            # an idle client costs one native ring-index check here, not a full serve
            if (conn.submit.has_data() or conn.outbox or conn.detaching) and self._serve(conn):
                worked = True
        epoch = self.ctl.slot_epoch
        if epoch != self._epoch_seen:
            self._epoch_seen = epoch
            self._scan_slots()
            worked = True
        while self._events:
            fn, args = self._events.popleft()
            t0 = time.perf_counter()
            try:
                fn(*args)
            except Exception:  # a worker event must never kill the control thread
                log.exception("event %r failed", fn)
            self.busy.add(BusyTime.name_of("event", fn), time.perf_counter() - t0)
            worked = True
        if self._timers:
            now = time.monotonic()
            while self._timers and self._timers[0][0] <= now:
                _, _, fn, args = heapq.heappop(self._timers)
                t0 = time.perf_counter()
                try:
                    fn(*args)
                except Exception:
                    log.exception("timer %r failed", fn)
                self.busy.add(BusyTime.name_of("timer", fn), time.perf_counter() - t0)
                worked = True
        return worked

    # -- clients -----------------------------------------------------------------------------
    def _scan_slots(self) -> None:
        self._check_exhaustions()
        for i in range(self.ctl.num_slots):
            pid, state = self.ctl.slot_state(i)
            if state == SLOT_CLAIMED and i not in self.clients:
                conn = ClientConn(self.ctl, i, pid, self.limits.max_frame_bytes, next(self._tokens),
                                  self._route_tables)
                self.clients[i] = conn
                self._clients_changed()
                self.counters["clients_claimed"] += 1
                if not self.liveness.watch((i, conn.token), pid, self.ctl.client_start_ticks(i)):
                    self._drop_client(conn, reason="dead before attach")

    def _clients_changed(self) -> None:
        self._serving = tuple(self.clients.values())
        self._submits = tuple(conn.submit for conn in self._serving)

    def _check_exhaustions(self) -> None:
        """Clients that found every slot taken (they count it in the header and bump the slot
        epoch): ``slot_exhaustions`` counts them; one log line names the pid holding the most
        slots (at most every EXHAUSTION_LOG_EVERY_S; the next line says how many it summarises)."""
        total = self.ctl.slot_exhaustions
        new = total - self._exhaustions_seen
        if new <= 0:
            return
        self._exhaustions_seen = total
        self.counters["slot_exhaustions"] += new
        now = time.monotonic()
        if now - self._exhaustion_logged_at < EXHAUSTION_LOG_EVERY_S:
            return
        refused = self.counters["slot_exhaustions"] - self._exhaustions_logged
        self._exhaustions_logged = self.counters["slot_exhaustions"]
        self._exhaustion_logged_at = now
        held = self.ctl.slots_by_pid()
        log.warning("client slots exhausted: %d attach(es) refused since the last report (%d in all); "
                    "%d of %d slots held now: %s", refused, self._exhaustions_logged, sum(held.values()),
                    self.ctl.num_slots, describe_slot_holders(held))

    def _on_client_dead(self, key) -> None:  # liveness thread
        self.post(self._client_dead, key)

    def _client_dead(self, key) -> None:
        slot, token = key
        conn = self.clients.get(slot)
        if conn is not None and conn.token == token:
            self.counters["clients_reclaimed"] += 1
            self._drop_client(conn, reason="process died")

    def _drop_client(self, conn: ClientConn, reason: str, free_slot: bool = True) -> None:
        """Release everything ``conn`` held, reset its rings, free its slot.  Runs once per conn."""
        if self.clients.get(conn.slot) is not conn:
            return
        del self.clients[conn.slot]
        self._clients_changed()
        self.liveness.unwatch((conn.slot, conn.token))
        for svc in self.services:
            try:
                svc.client_gone(conn)
            except Exception:
                log.exception("%s.client_gone failed for slot %d", type(svc).__name__, conn.slot)
        log.info("client slot %d (pid %d) dropped: %s", conn.slot, conn.pid, reason)
        if free_slot:
            # The client is gone (or has consumed its detach ack): nobody else
            # touches these rings until the slot is claimed again.
            conn.submit.reset()
            conn.completion.reset()
            self.ctl.set_slot(conn.slot, 0, SLOT_FREE)
        self.publisher.dirty = True

    def _ring_corrupted(self, conn: ClientConn, exc: RingCorrupted) -> None:
        self.rings_corrupted += 1
        n = self.rings_corrupted
        if n <= 10 or n % 1000 == 0:  # a hostile client must not flood the log either
            log.warning("slot %d: %s; dropping the client (%d corrupt rings so far)", conn.slot, exc, n)
        self._drop_client(conn, reason="corrupt ring")

    def _serve(self, conn: ClientConn) -> bool:
        """Serve one client's rings: its backlog, or a batch of its submissions; True if
        anything happened.  Anything impossible in them (RingCorrupted) drops that client only.

        Reply first: each completion goes straight into the ring, the client's doorbell is
        rung, and only then is the batch counted.  After an idle gap every line on this path
        runs cold and the client is waiting on the ring, so a line before the ring is latency
        and a line after it runs while the client reads its reply."""
        try:
            if conn.outbox or conn.detaching:
                return self._serve_backlog(conn)
            frames = conn.submit.pop_batch(64)  # rings the client when it waits for space (rule 3)
            if not frames:
                return False
            for data in frames:
                completion = self._handle(conn, data)
                if completion is not None:
                    data = conn.pack(completion)  # protocol.Encoder.encode, written out
                    if len(data) > conn.max_frame:
                        data = conn.pack(self._error(conn, completion["id"], ErrorCode.INTERNAL,
                                                     f"completion of {len(data)} bytes over {conn.max_frame}"))
                    if conn.outbox or not conn.completion.try_push(data):
                        conn.outbox.append(data)
                if conn.detaching:
                    break  # what it sent after its detach is not served (but counted as received)
            if conn.outbox:
                conn.flush_outbox()
            if conn.doorbell.ring():
                self._woke_client = True
            conn.requests += len(frames)
            self.requests += len(frames)
            return True
        except RingCorrupted as exc:
            self._ring_corrupted(conn, exc)
            return True

    def _serve_backlog(self, conn: ClientConn) -> bool:
        """A client with completions queued (outbox) or detaching: move the outbox first (its
        submissions wait while it is not empty: back-pressure), drop it once its detach ack is
        consumed."""
        worked = False
        if conn.outbox:
            if not conn.flush_outbox():
                return False  # back-pressure: the client must drain completions first
            if conn.doorbell.ring():
                self._woke_client = True
            worked = True  # its submissions are served on the next pass, the outbox now empty
        if conn.detaching and conn.completions_drained():
            self._drop_client(conn, reason="detached")
            worked = True
        return worked

    def _handle(self, conn: ClientConn, data: bytes) -> dict:
        """Decode, check and dispatch one frame; returns its completion (None: deferred).

        This runs cold after every idle gap, so it is one lookup per request in the client's own
        table of what it may call now (``ClientConn.routes``; a miss is sorted out in
        :meth:`_refuse`) and no call that is not the decode or the handler (``bench ring``'s
        idle rows)."""
        if type(data) is Oversize:
            return self._error(conn, None, ErrorCode.TOO_LARGE,
                               f"frame of {int(data)} bytes over {self.limits.max_frame_bytes}")
        try:
            msg = decode_request(data, self.limits)
        except ProtocolError as exc:
            return self._error(conn, exc.request_id, exc.code, exc.message)
        op = msg["op"]
        handler = conn.routes.get(op)
        if handler is None:
            return self._refuse(conn, msg["id"], op)
        self.op_counts[op] += 1
        t0 = time.perf_counter()
        try:
            result = handler(conn, msg)
        except OpError as exc:
            return self._error(conn, msg["id"], exc.code, exc.message)
        except ProtocolError as exc:
            return self._error(conn, msg["id"], exc.code, exc.message)
        except Exception as exc:  # a bug in a handler answers INTERNAL; the loop survives
            log.exception("op %s failed", op)
            return self._error(conn, msg["id"], ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}")
        finally:
            self.busy.add("op:" + op, time.perf_counter() - t0)
        if result is DEFERRED:
            return None
        result["id"] = msg["id"]  # protocol.ok_completion, written out: this is the request's path
        result["ok"] = True
        return result

    def _refuse(self, conn: ClientConn, rid: int, op: str) -> dict:
        """The completion of an op its client may not call now (not in ``conn.routes``)."""
        if op not in self.handlers:
            return self._error(conn, rid, ErrorCode.UNKNOWN_OP, f"op {op!r} is not served by this sidecar")
        if conn.info is None:
            return self._error(conn, rid, ErrorCode.NOT_ATTACHED, f"{op} before attach")
        return self._error(conn, rid, ErrorCode.NOT_ATTACHED,
                           f"{op} needs an attach with a KV layout (this client attached as an observer)")

    def reply(self, conn: ClientConn, rid: int, result: dict | None = None, error=None) -> bool:
        """Complete a deferred request (control thread).  False if the client is gone."""
        if self.clients.get(conn.slot) is not conn:
            return False
        if error is not None:
            completion = self._error(conn, rid, *error)
        else:
            completion = protocol.ok_completion(rid, dict(result or {}))
        try:
            conn.send(completion)
            conn.flush_outbox()
        except RingCorrupted as exc:
            self._ring_corrupted(conn, exc)
            return False
        if conn.doorbell.ring():
            self._woke_client = True
        return True

    def run_pending_events(self) -> int:
        """Run queued cross-thread events now (used while shutting down)."""
        n = 0
        while self._events:
            fn, args = self._events.popleft()
            try:
                fn(*args)
            except Exception:
                log.exception("event %r failed", fn)
            n += 1
        return n

    def _error(self, conn: ClientConn, rid, code: ErrorCode, message: str) -> dict:
        conn.errors += 1
        self.counters["errors"] += 1
        self.error_counts[code] += 1
        return protocol.error_completion(rid, code, message)

    # -- observability -----------------------------------------------------------------------
    def snapshot(self) -> SidecarSnapshot:
        """The loop's own snapshot and every mounted service's (control thread: consistent)."""
        now = time.monotonic()
        clients = []
        for conn in self.clients.values():
            info = conn.info
            clients.append(ClientSnapshot(
                slot=conn.slot, pid=conn.pid, attached=conn.attached, group=info.group if info else "",
                rank=info.rank if info else -1, requests=conn.requests, errors=conn.errors,
                outbox=len(conn.outbox), detaching=conn.detaching, submit_depth=conn.submit.depth(),
                completion_depth=conn.completion.depth(), connected_s=now - conn.created))
        loop = LoopSnapshot(instance=self.cfg.instance, generation=self.ctl.generation, pid=os.getpid(),
                            clients=tuple(clients), ops=dict(self.op_counts), busy=self.busy.snapshot(),
                            counters={**self.counters, "requests": self.requests},
                            errors=dict(self.error_counts), rings_corrupted=self.rings_corrupted)
        return SidecarSnapshot.of(loop, (svc.snapshot() for svc in self.services))
