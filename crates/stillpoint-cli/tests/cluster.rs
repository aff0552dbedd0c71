//! The word count across three OS processes over TCP on loopback — a coordinator and
//! two nodes — with a node SIGKILLed mid-run and restarted: the committed output is
//! exactly the failure-free one.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod support;

use std::time::{Duration, Instant};

use std::io::{Read, Write};
use std::path::Path;
use std::process::Child;

use support::{CLUSTER_SECRET, expected, free_port, spawn, wait_up_to, write_word_count_job};

/// Waits (up to 180 s) for the coordinator to end the job and every node to exit,
/// all successfully; returns the coordinator's log. On a timeout kills them all. A
/// failed node's log (`node_logs`, in the order of `nodes`) is in the panic message.
fn finish(coordinator: &mut Child, nodes: &mut [Child], log: &Path, node_logs: &[&Path]) -> String {
    let Some(status) = wait_up_to(coordinator, Duration::from_secs(180)) else {
        let _ = coordinator.kill();
        for node in nodes.iter_mut() {
            let _ = node.kill();
        }
        panic!(
            "the cluster did not finish in 180 s; coordinator log:\n{}",
            std::fs::read_to_string(log).unwrap()
        );
    };
    let text = std::fs::read_to_string(log).unwrap();
    assert!(status.success(), "coordinator failed:\n{text}");
    for (node, node_log) in nodes.iter_mut().zip(node_logs) {
        assert!(
            node.wait().unwrap().success(),
            "node {} failed:\n{}",
            node_log.display(),
            std::fs::read_to_string(node_log).unwrap_or_default()
        );
    }
    text
}

/// A `[cluster]` table of a coordinator and two nodes on free loopback ports.
fn cluster_table() -> String {
    let (c, n1, n2) = (free_port(), free_port(), free_port());
    format!(
        "[cluster]\ncoordinator = \"127.0.0.1:{c}\"\nnodes = [\"127.0.0.1:{n1}\", \"127.0.0.1:{n2}\"]\nconnect_timeout = \"30s\"\nsecret = \"{CLUSTER_SECRET}\"\n"
    )
}

/// A coordinator and two nodes of `job`, logging to `logs/{coordinator,node1,node2}{tag}.log`.
fn start_cluster(job: &Path, logs: &Path, tag: &str) -> Vec<Child> {
    vec![
        spawn(
            &["coordinator"],
            job,
            &logs.join(format!("coordinator{tag}.log")),
        ),
        spawn(
            &["node", "--node", "1"],
            job,
            &logs.join(format!("node1{tag}.log")),
        ),
        spawn(
            &["node", "--node", "2"],
            job,
            &logs.join(format!("node2{tag}.log")),
        ),
    ]
}

/// SIGKILLs every process of a cluster.
fn kill_all(processes: &mut [Child]) {
    for process in processes {
        process.kill().unwrap(); // SIGKILL
        process.wait().unwrap();
    }
}

/// Runs a cluster of `job` to its end ([`finish`]); the coordinator's log.
fn run_cluster(job: &Path, logs: &Path, tag: &str) -> String {
    let mut processes = start_cluster(job, logs, tag);
    let mut nodes = processes.split_off(1);
    let log = |name: &str| logs.join(format!("{name}{tag}.log"));
    finish(
        &mut processes[0],
        &mut nodes,
        &log("coordinator"),
        &[&log("node1"), &log("node2")],
    )
}

/// The body of `GET /metrics` on a local port.
fn scrape(port: u16) -> String {
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(stream, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    response
}

/// Records source task `task` of node `node` took in, from that node's endpoint
/// text `text`.
fn source_records(text: &str, node: u32, task: u32) -> u64 {
    let line = format!("stillpoint_task_records_total{{task=\"{task}\",node=\"{node}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(line.as_str()))
        .unwrap_or_else(|| panic!("node {node} does not report source task {task}: {text}"))
        .parse()
        .unwrap()
}

/// The word count of `words` per source as a cluster job in `dir/job.toml` (work in
/// `dir/data`, output in `dir/out`), with a `[metrics]` section of `metrics`.
fn cluster_job(dir: &Path, words: u64, metrics: &str) -> std::path::PathBuf {
    let job = dir.join("job.toml");
    let extra = format!("{}[metrics]\n{metrics}", cluster_table());
    write_word_count_job(&job, &dir.join("data"), &dir.join("out"), words, &extra);
    job
}

#[test]
fn a_killed_node_is_restarted_and_nothing_is_lost_or_duplicated() {
    let dir = tempfile::tempdir().unwrap();
    let (mc, m1, m2) = (free_port(), free_port(), free_port());
    let words = 150_000;
    let job = cluster_job(
        dir.path(),
        words,
        &format!("listen = \"127.0.0.1:{mc}\"\nnodes = [\"127.0.0.1:{m1}\", \"127.0.0.1:{m2}\"]\n"),
    );
    let logs = dir.path();
    let mut coordinator = spawn(&["coordinator"], &job, &logs.join("coordinator.log"));
    let node1 = spawn(&["node", "--node", "1"], &job, &logs.join("node1.log"));
    let mut node2 = spawn(&["node", "--node", "2"], &job, &logs.join("node2.log"));
    // Kill node 2 once a checkpoint has been committed, then start it again.
    let deadline = Instant::now() + Duration::from_secs(60);
    let committed = dir.path().join("data/store/checkpoints");
    while std::fs::read_dir(&committed).map_or(0, |d| d.count()) < 2 {
        assert!(Instant::now() < deadline, "no checkpoint within 60 s");
        std::thread::sleep(Duration::from_millis(20));
    }
    // Each process serves its own metrics: the nodes their tasks' records (tasks are
    // spread round robin: node 1 runs the odd ones), the coordinator the checkpoints.
    let checkpoints = scrape(mc);
    assert!(
        checkpoints.contains("stillpoint_checkpoints_completed_total ")
            && !checkpoints.contains("stillpoint_checkpoints_completed_total 0\n"),
        "{checkpoints}"
    );
    for (node, port, task) in [(1, m1, 1), (2, m2, 2)] {
        let text = scrape(port);
        assert!(source_records(&text, node, task) > 0, "node {node}: {text}");
        assert!(
            !text.contains("stillpoint_checkpoints_completed_total"),
            "{text}"
        );
        let other = if node == 1 { 2 } else { 1 };
        assert!(
            !text.contains(&format!("task=\"{other}\"")),
            "node {node} reports a task it does not run: {text}"
        );
    }
    std::thread::sleep(Duration::from_millis(150));
    node2.kill().unwrap(); // SIGKILL
    node2.wait().unwrap();
    let node2 = spawn(
        &["node", "--node", "2"],
        &job,
        &logs.join("node2-restarted.log"),
    );
    let log = finish(
        &mut coordinator,
        &mut [node1, node2],
        &logs.join("coordinator.log"),
        &[&logs.join("node1.log"), &logs.join("node2-restarted.log")],
    );
    assert!(
        log.contains("failing over"),
        "the kill was not seen:\n{log}"
    );
    let mut output = stillpoint_connectors::read_committed(&dir.path().join("out")).unwrap();
    output.sort();
    let expected = expected(words, 300);
    assert_eq!(output.len(), expected.len(), "lost or duplicated records");
    assert_eq!(output, expected);

    // A coordinator restarted after its nodes were told to exit (killed between the
    // two, say) finds the job finished instead of waiting for nodes that are gone.
    let mut again = spawn(&["coordinator"], &job, &logs.join("coordinator-again.log"));
    let Some(status) = wait_up_to(&mut again, Duration::from_secs(30)) else {
        let _ = again.kill();
        panic!("a coordinator of a finished job waited for its nodes");
    };
    let log = std::fs::read_to_string(logs.join("coordinator-again.log")).unwrap();
    assert!(status.success(), "{log}");
    assert!(
        log.contains("the job already finished") && log.contains("done: 0 checkpoint(s)"),
        "{log}"
    );
    // So does a node restarted after the end (by a supervisor, or killed as it
    // exited): no coordinator will come, and the store says the job is done.
    let mut late = spawn(&["node", "--node", "2"], &job, &logs.join("node2-late.log"));
    let Some(status) = wait_up_to(&mut late, Duration::from_secs(30)) else {
        let _ = late.kill();
        panic!("a node of a finished job waited for its coordinator");
    };
    let log = std::fs::read_to_string(logs.join("node2-late.log")).unwrap();
    assert!(status.success(), "{log}");
    assert!(log.contains("the job already finished"), "{log}");
    let mut output = stillpoint_connectors::read_committed(&dir.path().join("out")).unwrap();
    output.sort();
    assert_eq!(
        output, expected,
        "the restarted coordinator and node changed nothing"
    );
}

/// The whole cluster SIGKILLed once a checkpoint is committed, then started again with
/// another counter (and sink) parallelism: each process restores its new tasks from
/// the old tasks' snapshots by key group, the old sinks' transactions are settled, and
/// the output is exactly the failure-free one.
#[test]
fn a_cluster_restarted_with_other_parallelism_rescales_across_processes() {
    let dir = tempfile::tempdir().unwrap();
    let words = 150_000;
    let job = dir.path().join("job.toml");
    let cluster = cluster_table();
    let write = |aggregators: u32| {
        write_word_count_job(
            &job,
            &dir.path().join("data"),
            &dir.path().join("out"),
            words,
            &cluster,
        );
        let text = std::fs::read_to_string(&job).unwrap();
        std::fs::write(
            &job,
            text.replace("aggregators = 3", &format!("aggregators = {aggregators}")),
        )
        .unwrap();
    };
    let logs = dir.path();
    write(3);
    let mut first = start_cluster(&job, logs, "");
    let deadline = Instant::now() + Duration::from_secs(60);
    let committed = dir.path().join("data/store/checkpoints");
    while std::fs::read_dir(&committed).map_or(0, |d| d.count()) < 2 {
        assert!(Instant::now() < deadline, "no checkpoint within 60 s");
        std::thread::sleep(Duration::from_millis(20));
    }
    kill_all(&mut first);
    write(4);
    let log = run_cluster(&job, logs, "-2");
    assert!(
        log.contains("resuming from checkpoint") && log.contains("→ 4 counters"),
        "the second run did not restore:\n{log}"
    );
    let mut output = stillpoint_connectors::read_committed(&dir.path().join("out")).unwrap();
    output.sort();
    let expected = expected(words, 300);
    assert_eq!(output.len(), expected.len(), "lost or duplicated records");
    assert_eq!(output, expected);
    // The old sinks' transactions were settled (published or rolled back) even where
    // no new sink has their task id: nothing is left pending.
    let pending: Vec<_> = std::fs::read_dir(dir.path().join("out/pending"))
        .map(|d| d.map(|e| e.unwrap().file_name()).collect())
        .unwrap_or_default();
    assert!(pending.is_empty(), "left pending: {pending:?}");
}

/// The whole cluster SIGKILLed after its sinks published output, the newest committed
/// checkpoint then damaged: the restarted cluster falls back to the one before,
/// replays exactly up to the published output (sources stopped at the offsets the
/// sinks recorded, the reproduced output dropped) and publishes exactly the
/// failure-free output.
#[test]
fn a_cluster_falling_back_past_published_output_replays_it_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let words = 150_000;
    let job = dir.path().join("job.toml");
    write_word_count_job(
        &job,
        &dir.path().join("data"),
        &dir.path().join("out"),
        words,
        &cluster_table(),
    );
    let logs = dir.path();
    let mut first = start_cluster(&job, logs, "");
    let store = dir.path().join("data/store/checkpoints");
    let commits = dir.path().join("out/commits");
    let committed = || -> Vec<u64> {
        let mut ids: Vec<u64> = std::fs::read_dir(&store)
            .map(|d| {
                d.filter_map(Result::ok)
                    .filter(|e| e.path().join("_checkpoint.json").exists())
                    .filter_map(|e| e.file_name().to_str()?.parse().ok())
                    .collect()
            })
            .unwrap_or_default();
        ids.sort_unstable();
        ids
    };
    // The checkpoints recorded next to the output (so told to the sinks to publish).
    let recorded = || -> Vec<u64> {
        let mut ids: Vec<u64> = std::fs::read_dir(&commits)
            .map(|d| {
                d.filter_map(Result::ok)
                    .filter_map(|e| e.file_name().to_str()?.strip_suffix(".json")?.parse().ok())
                    .collect()
            })
            .unwrap_or_default();
        ids.sort_unstable();
        ids
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while recorded().len() < 2 {
        assert!(
            Instant::now() < deadline,
            "no published checkpoint within 60 s"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    kill_all(&mut first);
    // Damage the newest recorded checkpoint and any committed after it: the restart
    // restores the one before and falls back past published output.
    let newest = *recorded().last().unwrap();
    let ids = committed();
    let restored = ids.iter().copied().filter(|id| *id < newest).max().unwrap();
    for id in ids.iter().filter(|id| **id >= newest) {
        let manifest = store.join(format!("{id:020}/tasks/task-1.json"));
        let mut bytes = std::fs::read(&manifest).unwrap();
        let middle = bytes.len() / 2;
        bytes[middle] ^= 0x20;
        std::fs::write(&manifest, bytes).unwrap();
    }

    let log = run_cluster(&job, logs, "-2");
    assert!(
        log.contains(&format!("checkpoint {newest} does not verify, skipped"))
            && log.contains(&format!("resuming from checkpoint {restored} "))
            && log.contains(&format!(
                "replaying exactly to the end of the published output of checkpoint {newest}"
            )),
        "the second run did not fall back and replay:\n{log}"
    );
    let mut output = stillpoint_connectors::read_committed(&dir.path().join("out")).unwrap();
    output.sort();
    let expected = expected(words, 300);
    assert_eq!(output.len(), expected.len(), "lost or duplicated records");
    assert_eq!(output, expected);
}

/// A stranger's connection: reads the challenge, sends `hello`, returns the answer
/// (or `None` when the connection closed without one).
fn stranger(
    address: &str,
    hello: impl FnOnce(String) -> stillpoint::EngineMessage,
) -> Option<stillpoint::EngineMessage> {
    let mut stream = std::net::TcpStream::connect(address).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let decoder = stillpoint_wire::FrameDecoder::default();
    let Ok(stillpoint::Envelope::Engine(stillpoint::EngineMessage::Challenge { nonce })) =
        stillpoint::read_envelope(&mut stream, decoder)
    else {
        panic!("no challenge from {address}");
    };
    let mut bytes = Vec::new();
    stillpoint::write_envelope(&mut bytes, &stillpoint::Envelope::Engine(hello(nonce))).unwrap();
    stream.write_all(&bytes).unwrap();
    match stillpoint::read_envelope(&mut stream, decoder) {
        Ok(stillpoint::Envelope::Engine(answer)) => Some(answer),
        _ => None,
    }
}

/// Strangers on the network: a hello with a forged proof (to the coordinator), an
/// edge hello with a forged proof (to a node), a node started with the wrong secret,
/// connections that never say hello (slow handshakes, more than the handshake cap):
/// each is refused with a clear log line, and the job — once the real node 2 joins —
/// publishes exactly the failure-free output.
#[test]
fn strangers_and_wrong_secrets_are_refused_and_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let words = 60_000;
    let job = dir.path().join("job.toml");
    let table = cluster_table();
    write_word_count_job(
        &job,
        &dir.path().join("data"),
        &dir.path().join("out"),
        words,
        &table,
    );
    let address = |key: &str| -> String {
        let line = table.lines().find(|l| l.starts_with(key)).unwrap();
        line.split('"').nth(1).unwrap().to_owned()
    };
    let coordinator_address = address("coordinator");
    let node1_address = address("nodes");
    let wrong = dir.path().join("wrong.toml");
    std::fs::write(
        &wrong,
        std::fs::read_to_string(&job)
            .unwrap()
            .replace(CLUSTER_SECRET, "not the secret of this cluster"),
    )
    .unwrap();
    let logs = dir.path();
    let mut coordinator = spawn(&["coordinator"], &job, &logs.join("coordinator.log"));
    let node1 = spawn(&["node", "--node", "1"], &job, &logs.join("node1.log"));
    let wait_for = |log: &Path, text: &str| {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let content = std::fs::read_to_string(log).unwrap_or_default();
            if content.contains(text) {
                return content;
            }
            assert!(
                Instant::now() < deadline,
                "no {text:?} in {}:\n{content}",
                log.display()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    wait_for(&logs.join("node1.log"), "connected");

    // A node with the wrong secret: refused by the coordinator, and it says why.
    let mut impostor = spawn(&["node", "--node", "2"], &wrong, &logs.join("impostor.log"));
    let status = wait_up_to(&mut impostor, Duration::from_secs(30)).expect("the impostor exits");
    assert!(!status.success());
    let said = std::fs::read_to_string(logs.join("impostor.log")).unwrap();
    assert!(
        said.contains("the coordinator refused node 2")
            && said.contains("does not know the cluster secret")
            && said.contains("is the cluster secret the same"),
        "{said}"
    );
    assert!(
        !said.contains(CLUSTER_SECRET) && !said.contains("not the secret of this cluster"),
        "{said}"
    );

    // A forged hello claiming to be node 2, and one claiming a node the cluster has not.
    let forged = |node: u32| {
        stranger(&coordinator_address, move |_| {
            stillpoint::EngineMessage::Hello {
                node,
                nonce: "00".repeat(32),
                proof: "11".repeat(32),
            }
        })
    };
    for node in [2, 9] {
        let answer = forged(node);
        assert!(
            matches!(&answer, Some(stillpoint::EngineMessage::Refused { .. })),
            "{answer:?}"
        );
    }
    // A forged edge hello to node 1 (as if for task 2 → task 3 of generation 1).
    let answer = stranger(&node1_address, |_| stillpoint::EngineMessage::EdgeHello {
        generation: 1,
        upstream: 2,
        downstream: 3,
        nonce: "00".repeat(32),
        proof: "22".repeat(32),
    });
    assert!(
        matches!(&answer, Some(stillpoint::EngineMessage::Refused { .. })),
        "{answer:?}"
    );
    // Connections that never say hello: more than the handshake cap at once.
    let idle: Vec<_> = (0..20)
        .map(|_| std::net::TcpStream::connect(&coordinator_address).unwrap())
        .collect();
    let log = wait_for(&logs.join("coordinator.log"), "no hello within");
    assert!(log.contains("handshakes are in progress"), "{log}");
    drop(idle);
    let log = std::fs::read_to_string(logs.join("coordinator.log")).unwrap();
    assert!(
        log.contains("refused a connection to the coordinator")
            && log.contains("it claims to be node 9")
            && log.contains("does not know the cluster secret"),
        "{log}"
    );
    let node1_log = std::fs::read_to_string(logs.join("node1.log")).unwrap();
    assert!(
        node1_log.contains("refused an edge connection"),
        "{node1_log}"
    );
    assert!(
        !log.contains("starting a generation"),
        "nothing started without node 2:\n{log}"
    );

    // The real node 2: the job runs as if nobody else had called.
    let node2 = spawn(&["node", "--node", "2"], &job, &logs.join("node2.log"));
    finish(
        &mut coordinator,
        &mut [node1, node2],
        &logs.join("coordinator.log"),
        &[&logs.join("node1.log"), &logs.join("node2.log")],
    );
    let mut output = stillpoint_connectors::read_committed(&dir.path().join("out")).unwrap();
    output.sort();
    assert_eq!(output, expected(words, 300));
}

/// `stillpoint pause` on a cluster job: the coordinator follows the marker and tells
/// the nodes, whose sources stop reading while checkpoints go on; `stillpoint resume`
/// lets them read again and the job ends with exactly the failure-free output.
#[test]
fn a_paused_cluster_reads_nothing_until_resumed() {
    let dir = tempfile::tempdir().unwrap();
    let (m1, m2) = (free_port(), free_port());
    let words = 150_000;
    let job = cluster_job(
        dir.path(),
        words,
        &format!("nodes = [\"127.0.0.1:{m1}\", \"127.0.0.1:{m2}\"]\n"),
    );
    let command = |verb: &str| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_stillpoint"))
            .arg(verb)
            .arg(&job)
            .output()
            .unwrap();
        assert!(out.status.success(), "{verb}: {out:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    assert!(command("pause").starts_with("paused:"));
    let mut processes = start_cluster(&job, dir.path(), "");
    let checkpoints = dir.path().join("data/store/checkpoints");
    let wait_for_checkpoints = |n: usize| {
        let deadline = Instant::now() + Duration::from_secs(90);
        while std::fs::read_dir(&checkpoints).map_or(0, |d| d.count()) < n {
            assert!(
                Instant::now() < deadline,
                "fewer than {n} checkpoints within 90 s"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    // The source tasks' records (task 1 on node 1, task 2 on node 2).
    let read = || -> u64 {
        [(1, m1, 1), (2, m2, 2)]
            .iter()
            .map(|(node, port, task)| source_records(&scrape(*port), *node, *task))
            .sum()
    };
    let committed =
        || stillpoint_connectors::read_committed(&dir.path().join("out")).map_or(0, |o| o.len());
    wait_for_checkpoints(3);
    let (records, published) = (read(), committed());
    wait_for_checkpoints(6);
    assert_eq!(read(), records, "sources read while paused");
    assert_eq!(committed(), published, "output grew while paused");
    assert!(records < 2 * words, "the job ran to its end: {records}");
    assert!(command("resume").starts_with("resumed:"));
    let mut nodes = processes.split_off(1);
    let log = |name: &str| dir.path().join(format!("{name}.log"));
    let coordinator_log = finish(
        &mut processes[0],
        &mut nodes,
        &log("coordinator"),
        &[&log("node1"), &log("node2")],
    );
    assert!(coordinator_log.contains("resumed"), "{coordinator_log}");
    let node_log = std::fs::read_to_string(log("node1")).unwrap();
    assert!(
        node_log.contains("sources paused or resumed by the coordinator"),
        "{node_log}"
    );
    let mut output = stillpoint_connectors::read_committed(&dir.path().join("out")).unwrap();
    output.sort();
    assert_eq!(output, expected(words, 300), "every word once");
}
