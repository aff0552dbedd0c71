"""The peer keyed count on Bytewax, with recovery on.

    python bytewax_count.py ROWS WORK_DIR

1,000 keys generated in-process by a resumable source (its snapshot is its offset),
counted per key by `stateful_map` (Bytewax keeps the state and snapshots it to its
recovery store, SQLite files in a local directory, every second), into a sink that
drops what it gets. The dataflow runs in a child `python -m bytewax.run` with
`-s 1 -b 0` on two workers; the throughput is ROWS over the time from the first
record generated to the end of the run, which the source stamps into a file (so the
interpreter's start-up is left out). Prints one line `PEER {json}`.
"""

import json
import os
import subprocess
import sys
import time

from bytewax import operators as op
from bytewax.dataflow import Dataflow
from bytewax.inputs import FixedPartitionedSource, StatefulSourcePartition
from bytewax.outputs import DynamicSink, StatelessSinkPartition

KEYS = [f"w{i:04}" for i in range(1000)]
BATCH = 1000


class Words(StatefulSourcePartition):
    def __init__(self, index, total, resume, stamp):
        self.at = resume or 0
        self.total = total
        self.index = index
        self.stamp = stamp

    def next_batch(self):
        if self.at == 0 and self.stamp:
            with open(self.stamp, "w") as out:
                out.write(str(time.time()))
        if self.at >= self.total:
            raise StopIteration()
        end = min(self.at + BATCH, self.total)
        mix = 2654435761 + self.index
        batch = [KEYS[(i * mix >> 7) % 1000] for i in range(self.at, end)]
        self.at = end
        return batch

    def snapshot(self):
        return self.at


class Generated(FixedPartitionedSource):
    def __init__(self, per_partition, stamp):
        self.per_partition = per_partition
        self.stamp = stamp

    def list_parts(self):
        return ["0", "1"]

    def build_part(self, step_id, for_part, resume_state):
        stamp = self.stamp if for_part == "0" else None
        return Words(int(for_part), self.per_partition, resume_state, stamp)


class Dropped(StatelessSinkPartition):
    def write_batch(self, items):
        pass


class Discard(DynamicSink):
    def build(self, step_id, worker_index, worker_count):
        return Dropped()


def count(state, _word):
    state = (state or 0) + 1
    return state, state


rows = int(os.environ.get("PEER_ROWS", "0"))
flow = Dataflow("keyed_count")
words = op.input("words", flow, Generated(rows // 2, os.environ.get("PEER_STAMP")))
keyed = op.key_on("key", words, lambda word: word)
counts = op.stateful_map("count", keyed, count)
op.output("out", counts, Discard())


def main():
    rows, work_dir = int(sys.argv[1]), sys.argv[2]
    recovery = os.path.join(work_dir, "recovery")
    os.makedirs(recovery, exist_ok=True)
    subprocess.run([sys.executable, "-m", "bytewax.recovery", recovery, "1"], check=True)
    stamp = os.path.join(work_dir, "started")
    env = dict(os.environ, PEER_ROWS=str(rows), PEER_STAMP=stamp)
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = here + os.pathsep + env.get("PYTHONPATH", "")
    started = time.monotonic()
    subprocess.run(
        [sys.executable, "-m", "bytewax.run", "bytewax_count:flow",
         "-w", "2", "-r", recovery, "-s", "1", "-b", "0"],
        check=True, env=env, cwd=work_dir,
    )
    ended = time.time()
    elapsed = time.monotonic() - started
    with open(stamp) as f:
        running = ended - float(f.read())
    snapshots = sum(1 for name in os.listdir(recovery))
    print("PEER " + json.dumps({
        "peer": "bytewax",
        "rows": rows,
        "seconds": elapsed,
        "running_seconds": running,
        "records_per_second": rows / max(running, 1e-9),
        "recovery_files": snapshots,
    }), flush=True)


if __name__ == "__main__":
    main()
