"""One structured line per terminal prefetch session on logger ``kvsidecar.sessions``.

``key=value`` pairs separated by spaces, always in this order (values never contain spaces:
strings are quoted when they do), e.g.::

    session=7 request=r3 group=sim-a policy=timeout status=timeout reason=deadline trigger=deadline
    blocks_target=258 blocks_published=130 blocks_restored=130 blocks_withdrawn=64 chunks=5
    elapsed_ms=251.2 stop_ms=3.1 drain_ms=2.9 error=-

``error`` is the reason of a ``failed`` session and ``-`` otherwise; ``-`` also stands for a
latency that does not apply (nothing stopped the session).  INFO level: an operator who wants
them off sets the logger's level.
"""

from __future__ import annotations

import logging

from kvsidecar.sidecar.observe.outcome import SessionObserver, SessionOutcome

log = logging.getLogger("kvsidecar.sessions")


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def _val(s: str) -> str:
    if not s:
        return "-"
    return '"' + s.replace('"', "'") + '"' if (" " in s or "=" in s or '"' in s) else s


def format_line(o: SessionOutcome) -> str:
    fields = [
        ("session", str(o.session)), ("request", _val(o.request)), ("group", _val(o.group)),
        ("policy", o.policy), ("status", o.status), ("reason", _val(o.reason)), ("trigger", _val(o.trigger)),
        ("blocks_target", str(o.blocks_target)), ("blocks_published", str(o.blocks_published)),
        ("blocks_restored", str(o.blocks_restored)), ("blocks_withdrawn", str(o.blocks_withdrawn)),
        ("chunks", str(o.chunks)), ("elapsed_ms", _ms(o.elapsed_s)), ("stop_ms", _ms(o.stop_latency_s)),
        ("drain_ms", _ms(o.drain_s)), ("error", _val(o.reason) if o.status == "failed" else "-"),
    ]
    return " ".join(f"{k}={v}" for k, v in fields)


def parse_line(line: str) -> dict:
    """The fields of a line written by :func:`format_line` (for tests and log tooling)."""
    out, i, n = {}, 0, len(line)
    while i < n:
        eq = line.index("=", i)
        key = line[i:eq]
        j = eq + 1
        if j < n and line[j] == '"':
            end = line.index('"', j + 1)
            out[key] = line[j + 1:end]
            i = end + 2
        else:
            end = line.find(" ", j)
            end = n if end < 0 else end
            out[key] = line[j:end]
            i = end + 1
    return out


class SessionLog(SessionObserver):
    def session_ended(self, outcome: SessionOutcome) -> None:
        if log.isEnabledFor(logging.INFO):
            log.info("%s", format_line(outcome))
