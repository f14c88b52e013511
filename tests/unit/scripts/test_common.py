"""The benchmarks' CPU meters: a process's own CPU, and a whole session's (a server's ranks)."""

import subprocess
import sys

from scripts.common import cpu_seconds, session_cpu_seconds

BURN = r"""
import os, sys, time
def burn(s):
    end = time.process_time() + s
    while time.process_time() < end:
        pass
if os.fork() == 0:  # a second process of the same session, like a server's rank
    burn(0.3)
    os.write(1, b"child\n")  # one write: the two processes share the pipe
    sys.stdin.read()
    os._exit(0)
burn(0.3)
os.write(1, b"parent\n")
sys.stdin.read()
"""


def test_session_cpu_counts_every_live_process_of_the_session_and_no_other():
    p = subprocess.Popen([sys.executable, "-c", BURN], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        assert sorted(p.stdout.readline().strip() for _ in range(2)) == ["child", "parent"]  # both burnt
        own = cpu_seconds(p.pid)
        whole = session_cpu_seconds(p.pid)
        assert 0.25 <= own < 0.6
        assert 0.5 <= whole < 1.2, whole  # both processes' burns, not only the leader's
        assert session_cpu_seconds(-12345) == 0.0  # no such session
    finally:
        p.stdin.close()
        p.wait(10)
