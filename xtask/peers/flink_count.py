"""The peer keyed count on Apache Flink (PyFlink, Table/SQL: the JVM alone runs it).

    python flink_count.py ROWS WORK_DIR REST_PORT [default|tuned]

1,000 keys generated in-process by Flink's datagen source (unthrottled, 2 parallel
source tasks), counted per key by a streaming GROUP BY on 3 parallel tasks (the
shape of stillpoint's 2 sources → 3 counters), checkpointed every second to a local
directory, into a blackhole sink. `default`: state in RocksDB, Flink's defaults
otherwise. `tuned`: Flink's best setting for this job, the heap (hashmap) state
backend with mini-batch aggregation (and so two-phase aggregation: a local
pre-aggregate before the shuffle). Either way no checkpoint is waited for once the
input has ended (Flink would wait for the next periodic one), and stillpoint's
figure leaves its end-of-input checkpoint out likewise. The
throughput is ROWS over the time from the job's start as Flink's REST API reports it
(the JVM's and the mini cluster's start-up left out, task deployment in) to its end.
While the job runs it polls that API for the checkpoint statistics Flink reports. Prints one
line `PEER {json}`.
"""

import json
import sys
import threading
import time
import urllib.request

from pyflink.common import Configuration
from pyflink.table import EnvironmentSettings, TableEnvironment

KEYS = 1000


def environment(work_dir, rest_port, tuned):
    config = Configuration()
    if tuned:
        config.set_string("state.backend.type", "hashmap")
        config.set_string("table.exec.mini-batch.enabled", "true")
        config.set_string("table.exec.mini-batch.allow-latency", "200 ms")
        config.set_string("table.exec.mini-batch.size", "5000")
    else:
        config.set_string("state.backend.type", "rocksdb")
    # Tasks that finished their input end without waiting for a last checkpoint.
    config.set_string("execution.checkpointing.checkpoints-after-tasks-finish", "false")
    config.set_string("execution.checkpointing.interval", "1s")
    config.set_string("execution.checkpointing.dir", f"file://{work_dir}/checkpoints")
    config.set_string("restart-strategy.type", "none")
    config.set_string("parallelism.default", "3")
    config.set_string("rest.port", str(rest_port))
    config.set_string("rest.address", "127.0.0.1")
    config.set_string("rest.bind-address", "127.0.0.1")
    config.set_string("web.checkpoints.history", "1000")
    settings = (
        EnvironmentSettings.new_instance()
        .in_streaming_mode()
        .with_configuration(config)
        .build()
    )
    return TableEnvironment.create(settings)


def run(env, rows):
    env.execute_sql(
        f"""CREATE TEMPORARY TABLE words (word INT) WITH (
            'connector' = 'datagen',
            'number-of-rows' = '{rows}',
            'scan.parallelism' = '2',
            'rows-per-second' = '1000000000',
            'fields.word.kind' = 'random',
            'fields.word.min' = '0',
            'fields.word.max' = '{KEYS - 1}')"""
    )
    env.execute_sql(
        f"""CREATE TEMPORARY TABLE counts (word INT, n BIGINT)
            WITH ('connector' = 'blackhole')"""
    )
    started = time.monotonic()
    result = env.execute_sql(
        f"INSERT INTO counts SELECT word, COUNT(*) FROM words GROUP BY word"
    )
    return started, result


def poll_checkpoints(rest_port, done, seen):
    """Keeps the newest checkpoint statistics Flink reports for the running job."""
    base = f"http://127.0.0.1:{rest_port}"
    while not done.is_set():
        try:
            with urllib.request.urlopen(f"{base}/jobs", timeout=2) as response:
                jobs = json.load(response)["jobs"]
            for job in jobs:
                url = f"{base}/jobs/{job['id']}"
                with urllib.request.urlopen(url, timeout=2) as response:
                    started = json.load(response).get("start-time")
                with urllib.request.urlopen(f"{url}/checkpoints", timeout=2) as response:
                    seen[job["id"]] = (started, json.load(response))
        except Exception:  # the REST endpoint is not up yet, or the job just ended
            pass
        done.wait(0.25)


def main():
    rows, work_dir, rest_port = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    setting = sys.argv[4] if len(sys.argv) > 4 else "default"
    if setting not in ("default", "tuned"):
        sys.exit(f"unknown setting {setting!r}: default or tuned")
    env = environment(work_dir, rest_port, setting == "tuned")


    seen, done = {}, threading.Event()
    poller = threading.Thread(target=poll_checkpoints, args=(rest_port, done, seen))
    poller.start()
    started, result = run(env, rows)
    job_id = str(result.get_job_client().get_job_id())
    result.wait()
    elapsed = time.monotonic() - started
    ended = time.time()
    done.set()
    poller.join()

    job_started, stats = seen.get(job_id, (None, {}))
    # From the job's own start (Flink's clock, epoch ms) to its end: the JVM's and the
    # mini cluster's start-up are left out, task deployment is in.
    running = ended - job_started / 1000 if job_started else elapsed
    summary = stats.get("summary", {}).get("end_to_end_duration", {})
    durations = [
        c["end_to_end_duration"]
        for c in stats.get("history", [])
        if c.get("status") == "COMPLETED"
    ]
    print(
        "PEER "
        + json.dumps(
            {
                "peer": "flink",
                "setting": setting,
                "rows": rows,
                "seconds": elapsed,
                "running_seconds": running,
                "records_per_second": rows / max(running, 1e-9),
                "checkpoints_completed": stats.get("counts", {}).get("completed", 0),
                "checkpoint_p50_ms": summary.get("p50"),
                "checkpoint_p99_ms": summary.get("p99"),
                "checkpoint_max_ms": summary.get("max"),
                "checkpoint_durations_ms": durations,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
