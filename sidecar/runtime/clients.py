"""Per-slot client connections, owned by the control thread.

A :class:`ClientConn` is the sidecar's end of one slot: it consumes the submit
ring, produces into the completion ring, and keeps an **outbox** of completions
that did not fit.  While the outbox is non-empty the control thread stops
reading that client's submissions (back-pressure, never a drop) and asks the
client, through the ring's ``waiting`` flag, to ring the sidecar when it frees
space.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time

from kvsidecar.shm import protocol
from kvsidecar.shm.control import ControlSegment

log = logging.getLogger(__name__)


@dataclasses.dataclass
class ClientInfo:
    group: str
    rank: int
    group_size: int
    pid: int
    kv: bool = True  # attached with a matching KV layout (else: observer, ping/stats only)


class ClientConn:
    def __init__(self, ctl: ControlSegment, slot: int, pid: int, max_frame: int, token: int,
                 route_tables: tuple[dict, dict, dict] = ({}, {}, {})):
        self.slot = slot
        self.pid = pid
        self.token = token  # distinguishes incarnations of the same slot
        self.doorbell = ctl.client_doorbell(slot)
        self.submit = ctl.submit_consumer(slot, max_frame, waker=self.doorbell)  # rule 3 inside pop_batch
        self.completion = ctl.completion_producer(slot)
        self.outbox: collections.deque = collections.deque()
        self.encoder = protocol.Encoder(protocol.Limits(max_frame_bytes=max_frame))
        self.pack = self.encoder.pack  # msgpack without the size check (the loop checks max_frame)
        self.max_frame = max_frame
        self.info: ClientInfo | None = None
        self._route_tables = route_tables  # op -> handler: before attach, observer, KV attach
        self.routes: dict = route_tables[0]  # what this client may call now (set by attached_as)
        self.detaching = False
        self.requests = 0
        self.errors = 0
        self.created = time.monotonic()  # when the sidecar saw the slot claimed

    @property
    def attached(self) -> bool:
        return self.info is not None

    def attached_as(self, info: ClientInfo) -> None:
        """The attach succeeded: record who the client is and open the ops it may now call."""
        self.info = info
        self.routes = self._route_tables[2 if info.kv else 1]

    def send(self, completion: dict) -> None:
        """Queue a completion; it goes straight into the ring unless an outbox backlog exists."""
        data = self.encoder.encode(completion)
        if self.outbox or not self.completion.try_push(data):
            self.outbox.append(data)

    def flush_outbox(self) -> bool:
        """Move queued completions into the ring; True when the outbox is empty afterwards."""
        while self.outbox:
            if not self.completion.try_push(self.outbox[0]):
                if self.completion.mark_waiting() and self.completion.try_push(self.outbox[0]):
                    self.outbox.popleft()
                    continue
                return False
            self.outbox.popleft()
        return True

    def completions_drained(self) -> bool:
        """Raises RingCorrupted when the client moved its completion head impossibly."""
        return not self.outbox and self.completion.drained()
