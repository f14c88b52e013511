"""The request lifecycle half of the SGLang HiCache backend: what kvsidecar's SGLang plugin
(:mod:`kvsidecar.connector.sglang_plugin`) drives from SGLang's scheduler thread, beside the
storage interface SGLang's own threads call (:mod:`kvsidecar.connector.hicache_backend`).

* ``start_at_entry``: ``cost_aware`` at queue entry starts the request's session and says whether
  any storage operation for it can restore anything (the plugin agrees on it across the TP group);
* ``demand`` / ``stop_for_prefill``: the request became a scheduling candidate / can start its
  prefill in this iteration (the settler, :mod:`kvsidecar.connector.sglang_settle`);
* ``end``: SGLang is done with the request's prefetch; its abort is handed to a background
  sender (never on the scheduler thread, in order, never dropped; ``flush_aborts`` waits for it).

Invariants: every rank sends the same idempotent call for the same request, so no rank waits
on another's message; the session table's lock is never held across a sidecar call; an
unreachable sidecar answers "run SGLang's own operation" (``start_at_entry``) or "nothing to
wait for" (the others), never an exception into SGLang.

A mixin: the backend provides ``config``, ``layout``, ``use_l3``, ``sessions``
(:class:`~kvsidecar.connector.session_registry.SessionRegistry`), ``_aborts``
(:class:`~kvsidecar.connector.background_calls.BackgroundCalls`), ``_call`` (a call on a pooled
connection, or the default), ``_count`` and ``_chain``.
"""

from __future__ import annotations

import contextlib

from kvsidecar.shm.errors import ErrorCode, KvSidecarError, RemoteError

from .session_registry import SessionRef

STOPS_ON_DEMAND = ("cost_aware", "best_effort")  # the policies a demand stops (the others read on)


class RequestLifecycle:
    def session(self, rid: str, attempt: int = 0) -> SessionRef | None:
        return self.sessions.get(str(rid), int(attempt or 0))

    def resident(self, rid: str, attempt: int = 0) -> bool:
        """The hit this rank's query reported for the request was resident in the sidecar's pool
        when it answered (SGLang's copy of it is then a memcpy; :mod:`kvsidecar.connector.sglang_settle`)."""
        ref = self.session(rid, attempt)
        return ref is not None and ref.resident

    def demand(self, rid: str, attempt: int = 0) -> None:
        """SGLang's first readiness check of the request: it is a scheduling candidate now.

        Not for ``cost_aware`` driven by the plugin's ETA stream (``eta_source``): SGLang checks
        every waiting request's prefetch at every iteration, so its first check comes one
        iteration after queue entry wherever the request stands; taken as a demand (its ETA set
        to *now*) it ended every plan to read behind the queue.  The ETA stream says when the
        prefill can start (zero for every request within the next prefill batch's budget: the
        same stop, at the right time; :mod:`kvsidecar.connector.sglang_eta`)."""
        if not self.config.sessions.enabled:
            return
        if self.config.sessions.policy == "cost_aware" and self.eta_source is not None:
            self._count("demands_left_to_eta")
            return
        key = (str(rid), int(attempt or 0))
        if not self.sessions.demand(*key):  # demanded already, or the query sends it when it runs
            return
        self._count("demands")

        def run(c):
            try:
                c.demand(key[0], attempt=key[1])
            except RemoteError as exc:
                if exc.code != ErrorCode.UNKNOWN_ID:
                    raise
                # the query thread's prefetch has not reached the sidecar yet: it sends the demand

        self._call(run, None)

    def stop_for_prefill(self, rid: str, attempt: int = 0) -> bool:
        """The request can start its prefill in this scheduler iteration (the settler's
        admissibility, :mod:`kvsidecar.connector.sglang_settle`): a demand, whatever the policy
        -- the one scheduling candidate SGLang's own checks cannot name.  Every rank sends it
        (idempotent).  True when the session has ended, or stopped on the demand and only
        drains its reads in flight (a policy that stops on it: ``cost_aware``, ``best_effort``),
        which it waits for no longer than half ``settle_wait_s`` (``drain_s``): SGLang's copy of
        its prefix follows shortly, worth holding the iteration for.  False for
        a session that goes on (``timeout``, ``wait_complete``: draining there is the rest of the
        hit being read), none, or an unreachable sidecar."""
        if not self.config.sessions.enabled:
            return False
        key = (str(rid), int(attempt or 0))
        if self.session(*key) is None:
            return False
        self.sessions.demand(*key)  # (the first readiness check then sends no second demand)
        self._count("settle_demands")
        # SGLang admits the request in this iteration or a forward pass later: a read that has
        # not landed within half the settler's wait is left behind (the rest covers the copy)
        drain_s = self.config.sessions.settle_wait_s / 2

        def run(c):
            try:
                return c.demand(key[0], attempt=key[1], drain_s=drain_s)
            except RemoteError as exc:
                if exc.code != ErrorCode.UNKNOWN_ID:
                    raise
                return None  # gone: nothing to wait for

        view = self._call(run, None) or {}
        ending = view.get("state") == "terminal" or (
            view.get("state") == "draining" and view.get("policy") in STOPS_ON_DEMAND)
        if ending:
            self._count("settle_demands_ending")
        return ending

    def end(self, rid: str, attempt: int = 0, abort: bool = True) -> None:
        """The request's prefetch is over for SGLang (consumed, terminated, revoked or aborted):
        stop the session if it still runs and drop whatever it still holds."""
        if not self.config.sessions.enabled:
            return
        key = (str(rid), int(attempt or 0))
        if self.sessions.end(*key) is None:  # no session (yet): a query still to come starts none
            return
        if abort:
            self._count("aborts")

            def send():
                self._call(lambda c: c.abort(key[0], attempt=key[1]), None)

            if not self._aborts.submit(send):  # hand-off full or closed: on this thread
                self._count("aborts_inline")
                send()

    def _start_session(self, c, ref: SessionRef, policy: str, n_keys: int, eta_s, prefill_s_per_block,
                       wait: bool = True):
        """Start (or join) ``ref``'s session: the one ``prefetch`` both the queue entry and the
        prefetch thread's query send, with the same parameters (a join ignores them).  Its view;
        with ``wait=False`` the request id, whose view the caller reads (and counts)."""
        s = self.config.sessions
        view = c.prefetch(ref.chain, ref.rid, attempt=ref.attempt, policy=policy, budget_s=s.budget_s,
                          chunk_max_blocks=s.chunk_max_blocks or None, tokens=n_keys * self.layout.tokens_per_block,
                          eta_s=eta_s, prefill_s_per_block=prefill_s_per_block, fixed_hit=True, wait=wait)
        if wait:
            self._count_start(view)
        return view

    def _count_start(self, view: dict) -> None:
        self._count("sessions_joined" if view.get("existed") else "sessions_started")

    def start_at_entry(self, rid: str, attempt: int, keys, eta_s: float | None = None,
                       prefill_s_per_block: float | None = None) -> bool:
        """One request's :meth:`start_at_entry_many`."""
        return self.start_at_entry_many([(rid, attempt, keys, eta_s, prefill_s_per_block)])[0]

    def start_at_entry_many(self, entries) -> list[bool]:
        """``cost_aware`` at queue entry (SGLang's scheduler thread): start each request's session
        now, over its ``keys`` -- the chain SGLang's prefetch thread will query, whose
        ``batch_exists`` then joins this session -- and say, per request, whether a storage
        operation for it can restore anything.  ``entries``: ``(rid, attempt, keys, eta_s,
        prefill_s_per_block)`` tuples.

        One sidecar round for them all: every start is sent, then every answer read, on one
        connection (the ring keeps their order), so n requests cost one round trip and n
        sidecar steps, not n round trips.  The plugin's gate runs the same halves apart
        (:class:`EntryRound`: each start sent as its request enters the queue, the answers read
        at the next drain).

        An answer is False only when the sidecar ended that session as it started with nothing to
        restore: no resident prefix, and not even the best case of an L3 read lowers TTFT
        (:func:`kvsidecar.sidecar.prefetch.cost.worth_querying`; the session ended as it started,
        the plugin unregisters it).  True otherwise, and whenever the sidecar cannot answer (SGLang then runs its storage
        operation as it would without this).  The answers are this rank's: the plugin agrees on
        them across the TP group before acting on them (SGLang's storage drains are collective)."""
        opened = [(i, ref, eta_s, per_block) for i, (rid, attempt, keys, eta_s, per_block) in enumerate(entries)
                  for ref in [self.open_at_entry(rid, attempt, keys)] if ref is not None]
        answers = [True] * len(entries)
        if not opened:
            return answers

        def round_trip(c):
            return self.read_at_entry(c, [self.send_at_entry(c, ref, eta_s, per_block)
                                          for _i, ref, eta_s, per_block in opened])

        views = self._call(round_trip, None) or [None] * len(opened)
        for (i, ref, _eta, _pb), view in zip(opened, views):
            answers[i] = self.settle_at_entry(ref, view)
        return answers

    # -- the halves of an entry start (sent, then read, on one connection) ------------------------
    def entry_round(self) -> EntryRound:
        """A round of entry starts sent apart from their reading (:class:`EntryRound`)."""
        return EntryRound(self)

    def open_at_entry(self, rid: str, attempt: int, keys) -> SessionRef | None:
        """The session ref a queue entry starts, registered; None when there is nothing to start
        (sessions off, no L3, no keys, or the request's session ended already: SGLang's own
        checks decide it)."""
        if not keys or not self.config.sessions.enabled or not self.use_l3:
            return None
        ref = SessionRef(str(rid), int(attempt or 0), self._chain(keys), {k: j for j, k in enumerate(keys)})
        return ref if self.sessions.open(ref) else None

    def send_at_entry(self, c, ref: SessionRef, eta_s, prefill_s_per_block) -> int:
        """Send ``ref``'s start on connection ``c`` (not waited for); its request id on ``c``."""
        return self._start_session(c, ref, self.config.sessions.policy, len(ref.positions), eta_s,
                                   prefill_s_per_block, wait=False)

    def read_at_entry(self, c, sent: list) -> list:
        """The views of the starts ``sent`` on ``c`` (request ids, in order; None for one that was
        not sent), each None when its start was refused.  A failed wait raises; the starts not
        read are discarded first (nobody will read them)."""
        views = []
        try:
            for rid in sent:
                reply = c.client.wait(rid) if rid is not None else None
                if reply is not None and not reply.get("ok"):  # that session only: SGLang runs its operation
                    self._count("entry_errors")
                    reply = None
                views.append(reply)
        finally:
            for rid in sent[len(views):]:
                if rid is not None:
                    c.client.discard(rid)
        return views

    def settle_at_entry(self, ref: SessionRef, view: dict | None) -> bool:
        """The answer for ``ref`` given its start's ``view`` (None: no answer, the ref is dropped):
        False only for a session that ended as it started with nothing to restore."""
        if view is None:
            self.sessions.discard(ref)
            return True
        self._count_start(view)
        self._count("entry_sessions")
        if view.get("state") == "terminal":
            if not view.get("prefix"):
                self._count("entry_nothing_to_restore")
                return False
            ref.terminal_prefix = int(view["prefix"])  # final: the query answers it as it is
        return True

    def flush_aborts(self, timeout_s: float) -> bool:
        """Wait (bounded) until every abort :meth:`end` handed off has reached the sidecar."""
        return self._aborts.flush(timeout_s)


class EntryRound:
    """Entry starts sent as each request enters the queue and read at the next drain (the SGLang
    plugin's gate, :mod:`kvsidecar.connector.sglang_entry`, on the scheduler thread).

    Why: one blocking round at the drain's start held the scheduler thread, and every request
    queued behind it, ~0.8 ms per drain with entries (median; TP=2 CPU server, 8 Mbit/s).  Sent
    at queue entry, the sidecar decides while SGLang finishes its iteration, and the drain reads
    answers that are there, or waits only for the rest of the round.

    Invariants:

    * One connection of the rank's pool is held from the round's first send until
      :meth:`answers` (both on the scheduler thread: queue entry and the drain's start).  The
      thread's other calls in between re-enter that connection (the pool's checkout is
      re-entrant for its holder), and its client keeps each reply under its own request id, so
      no call reads another's answer.
    * :meth:`answers` reads or discards every start sent and always checks the connection back
      in.  A send or read the sidecar cannot serve answers "run" (True) for its entries and marks
      the connection failed (re-attached by a later checkout), as a call through the pool would.
    * A withdrawn entry (its request was deferred again, or left) is read but not settled: its
      answer is nobody's, and a newer start of the same request joined the same session.
    """

    def __init__(self, backend):
        self.backend = backend
        self._hold: contextlib.ExitStack | None = None  # the checkout, held until answers()
        self._conn = None
        self._sent: list = []  # [ref | None, request id on the connection | None, withdrawn]

    def send(self, rid: str, attempt: int, keys, eta_s, prefill_s_per_block) -> int:
        """Start one request's session now (not waited for); its slot in :meth:`answers`."""
        ref = self.backend.open_at_entry(rid, attempt, keys)
        self._sent.append([ref, None, False])  # (first: whatever the send raises, answers() releases the hold)
        slot = len(self._sent) - 1
        if ref is not None:
            c = self._connection()
            if c is not None:
                try:
                    self._sent[slot][1] = self.backend.send_at_entry(c, ref, eta_s, prefill_s_per_block)
                except KvSidecarError as exc:
                    self._failed(exc)
        return slot

    def withdraw(self, slot: int) -> None:
        self._sent[slot][2] = True

    @property
    def pending(self) -> int:
        return len(self._sent)

    def answers(self) -> list[bool]:
        """One answer per slot, in send order (True for a withdrawn one); the round starts over."""
        sent, self._sent = self._sent, []
        views = [None] * len(sent)
        try:
            if self._conn is not None and any(rid is not None for _ref, rid, _w in sent):
                try:
                    views = self.backend.read_at_entry(self._conn, [rid for _ref, rid, _w in sent])
                except KvSidecarError as exc:
                    self._failed(exc)
        finally:
            hold, self._hold, self._conn = self._hold, None, None
            if hold is not None:
                hold.close()
        return [True if ref is None or withdrawn else self.backend.settle_at_entry(ref, view)
                for (ref, _rid, withdrawn), view in zip(sent, views)]

    def _connection(self):
        if self._hold is None:
            self._hold = contextlib.ExitStack()
            conns = self.backend.conns
            if conns is not None and self.backend.mem_pool_host is not None:
                self._conn = self._hold.enter_context(conns.checkout())
            if self._conn is None:
                self.backend._count("degraded_calls")
        return self._conn

    def _failed(self, exc: KvSidecarError) -> None:
        self.backend._count("entry_errors")
        conns = self.backend.conns
        if conns is not None and self._conn is not None:
            conns.policy.failed(self._conn, exc)
