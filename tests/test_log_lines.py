"""Log lines stay whole: services share the launcher's stdout, and a worker logs from two threads."""

from __future__ import annotations

import json
import subprocess
import sys

CHILD = """
import sys, threading
from shared import log
log.configure("probe-" + sys.argv[1])
logger = log.get_logger("probe")
def burst(t):
    for i in range(300):
        logger.info("line", thread=t, i=i, pad="x" * (i * 7 % 1500))
threads = [threading.Thread(target=burst, args=(t,)) for t in range(4)]
[t.start() for t in threads]
[t.join() for t in threads]
"""


def test_many_processes_and_threads_on_one_pipe_write_whole_lines():
    procs = []
    read, write = __import__("os").pipe()
    for n in range(4):
        procs.append(subprocess.Popen([sys.executable, "-c", CHILD, str(n)], stderr=write, stdout=write))
    __import__("os").close(write)
    with open(read, "rb") as out:
        data = out.read()
    for proc in procs:
        assert proc.wait(60) == 0
    lines = data.decode().splitlines()
    records = [json.loads(line) for line in lines]  # each line one JSON record, none merged or cut
    assert len(records) == 4 * 4 * 300
    assert {r["service"] for r in records} == {f"probe-{n}" for n in range(4)}
