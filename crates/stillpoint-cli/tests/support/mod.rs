//! What the binary's multi-process tests share: free loopback ports, spawning
//! `stillpoint` with its output in a log file, waiting for a process with a limit,
//! listing a store's files, the failure-free output of the generated word count, and
//! a seeded generator for kill times.
#![allow(dead_code, clippy::unwrap_used, clippy::cast_possible_truncation)]

#[path = "../../../../tests/tests/support/rng.rs"]
pub(crate) mod rng;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// A loopback port nothing listens on, never the same one twice in this test process
/// (the kernel may hand a just-released port out again, and the tests of one binary
/// run concurrently).
pub(crate) fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut given = GIVEN.lock().unwrap();
    loop {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        if !given.contains(&port) {
            given.push(port);
            return port;
        }
    }
}

/// Sleeps up to `delay`, returning early if `child` exits; its status if it did.
pub(crate) fn wait_up_to(child: &mut Child, delay: Duration) -> Option<ExitStatus> {
    let until = Instant::now() + delay;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return Some(status);
        }
        if Instant::now() >= until {
            return None;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Every file under `root`, relative to it, sorted.
pub(crate) fn files(root: &Path) -> Vec<String> {
    fn walk(dir: &Path, root: &Path, out: &mut Vec<String>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, root, out);
            } else {
                out.push(
                    path.strip_prefix(root)
                        .unwrap()
                        .to_string_lossy()
                        .into_owned(),
                );
            }
        }
    }
    let mut out = Vec::new();
    walk(root, root, &mut out);
    out.sort();
    out
}

/// Starts `stillpoint ARGS[0] JOB ARGS[1..] --log info`, stdout and stderr to `log`.
pub(crate) fn spawn(args: &[&str], job: &Path, log: &Path) -> Child {
    let log = std::fs::File::create(log).unwrap();
    Command::new(env!("CARGO_BIN_EXE_stillpoint"))
        .args(args.iter().take(1))
        .arg(job)
        .args(args.iter().skip(1))
        .args(["--log", "info"])
        .stdout(Stdio::from(log.try_clone().unwrap()))
        .stderr(Stdio::from(log))
        .spawn()
        .unwrap()
}

/// The word count's committed output without failures: for every word seen `n` times
/// over both generated sources, the lines `word k` for `k` in `1..=n`, sorted.
pub(crate) fn expected(words: u64, vocabulary: u32) -> Vec<(String, String)> {
    let mut totals: BTreeMap<String, u64> = BTreeMap::new();
    for index in 0..2 {
        let source = stillpoint_connectors::GeneratedWords::new(42, index, words, vocabulary);
        for position in 0..words {
            *totals.entry(source.word(position)).or_default() += 1;
        }
    }
    let mut out: Vec<(String, String)> = totals
        .into_iter()
        .flat_map(|(w, n)| (1..=n).map(move |k| (w.clone(), k.to_string())))
        .collect();
    out.sort();
    out
}

/// A word-count job file in `dir`: two generated sources of `words` words each
/// (vocabulary 300), three counters, a checkpoint every 50 ms, output in `dir/out`;
/// The cluster secret of the tests' cluster jobs.
pub(crate) const CLUSTER_SECRET: &str = "the secret of the test cluster";

/// `cluster` adds a `[cluster]` section (coordinator, nodes).
pub(crate) fn word_count_job(
    dir: &Path,
    words: u64,
    cluster: Option<(u16, u16, u16)>,
) -> std::path::PathBuf {
    let cluster = cluster.map_or(String::new(), |(c, n1, n2)| {
        format!(
            "[cluster]\ncoordinator = \"127.0.0.1:{c}\"\nnodes = [\"127.0.0.1:{n1}\", \"127.0.0.1:{n2}\"]\nconnect_timeout = \"30s\"\nsecret = \"{CLUSTER_SECRET}\"\n"
        )
    });
    let job = dir.join("job.toml");
    write_word_count_job(&job, &dir.join("data"), &dir.join("out"), words, &cluster);
    job
}

/// Writes the word-count job of [`word_count_job`] to `path`, working under `work`,
/// output in `out`, then `extra` (more sections).
pub(crate) fn write_word_count_job(path: &Path, work: &Path, out: &Path, words: u64, extra: &str) {
    std::fs::write(
        path,
        format!(
            r#"[job]
work_dir = "{}"
checkpoint_interval = "50ms"
lease_ttl = "5s"
{extra}
[pipeline]
sources = 2
aggregators = 3
output = "{}"
input = {{ kind = "generated", words_per_source = {words}, vocabulary = 300, seed = 42 }}
"#,
            work.display(),
            out.display()
        ),
    )
    .unwrap();
}

/// Records missing from `output` and records in it more often than in `expected`
/// (both sorted).
pub(crate) fn lost_and_duplicated(
    output: &[(String, String)],
    expected: &[(String, String)],
) -> (usize, usize) {
    let mut counts: BTreeMap<&(String, String), i64> = BTreeMap::new();
    for line in expected {
        *counts.entry(line).or_default() += 1;
    }
    for line in output {
        *counts.entry(line).or_default() -= 1;
    }
    let lost = counts
        .values()
        .filter(|c| **c > 0)
        .map(|c| *c as usize)
        .sum();
    let duplicated = counts
        .values()
        .filter(|c| **c < 0)
        .map(|c| (-*c) as usize)
        .sum();
    (lost, duplicated)
}
