//! Reliability through the real binary: a store failing a share of its operations,
//! every stored file damaged in turn, a paused owner fenced after its lease is taken
//! over, encryption at rest scanned byte by byte, a manifest that tries to write
//! outside the restore directory.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::print_stderr
)]

#[allow(unreachable_pub, dead_code)]
#[path = "../../stillpoint-backup/tests/support/s3.rs"]
mod s3;
mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use support::{expected, files, lost_and_duplicated, wait_up_to, write_word_count_job};

const VOCABULARY: u32 = 300;

fn stillpoint() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_stillpoint"));
    // Errors as a person sees them: one line, no backtrace.
    command.env_remove("RUST_BACKTRACE");
    command
}

/// The word-count job of the shared support in `dir/NAME`, working under
/// `dir/WORK`, output in `dir/OUT`, then `extra` (more sections).
fn job(dir: &Path, name: &str, work: &str, out: &str, words: u64, extra: &str) -> PathBuf {
    let path = dir.join(name);
    write_word_count_job(&path, &dir.join(work), &dir.join(out), words, extra);
    path
}

/// Runs `stillpoint ARGS`; stdout and stderr, and whether it succeeded.
fn run(args: &[&str], job: Option<&Path>) -> (bool, String, String) {
    let mut command = stillpoint();
    command.args(args.iter().take(1));
    if let Some(job) = job {
        command.arg(job);
    }
    let Output {
        status,
        stdout,
        stderr,
    } = command.args(args.iter().skip(1)).output().unwrap();
    let stderr = String::from_utf8(stderr).unwrap();
    assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    (status.success(), String::from_utf8(stdout).unwrap(), stderr)
}

fn verify(store: &str) -> (bool, String) {
    let (ok, stdout, _) = run(&["checkpoints", "verify", "--store", store], None);
    (ok, stdout)
}

fn store_uri(dir: &Path, work: &str) -> String {
    format!("file://{}", dir.join(work).join("store").display())
}

fn copy_dir(from: &Path, to: &Path) {
    if to.exists() {
        std::fs::remove_dir_all(to).unwrap();
    }
    for file in files(from) {
        let target = to.join(&file);
        std::fs::create_dir_all(target.parent().unwrap()).unwrap();
        std::fs::copy(from.join(&file), target).unwrap();
    }
}

fn checkpoint_lines(stdout: &str) -> Vec<u64> {
    stdout
        .lines()
        .filter_map(|l| {
            let mut words = l.split_whitespace();
            (words.next() == Some("checkpoint"))
                .then(|| words.next()?.parse().ok())
                .flatten()
        })
        .collect()
}

/// `verify`'s checkpoints that verified, oldest first.
fn verified(verify_stdout: &str) -> Vec<u64> {
    verify_stdout
        .lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("checkpoint ")?;
            let (id, status) = rest.split_once(": ")?;
            status.starts_with("ok").then(|| id.parse().unwrap())
        })
        .collect()
}

/// A store failing 15 % of its operations (stats, reads, writes, lists, deletes;
/// below the retries): checkpoints keep completing, every one listed as complete
/// verifies, and the output is exactly the failure-free one.
#[test]
fn a_store_failing_fifteen_percent_of_operations_stays_exactly_once() {
    // Long enough for several checkpoints even when the first one waits out retries
    // for seconds (600,000 words per source ended after two on the faster engine).
    const WORDS: u64 = 1_500_000;
    let dir = tempfile::tempdir().unwrap();
    let job = job(
        dir.path(),
        "chaos.toml",
        "data",
        "out",
        WORDS,
        "[store]\nfault_ratio = 0.15\nfault_seed = 7\n[retention]\nkeep_last = 1000\n",
    );
    let (ok, stdout, stderr) = run(&["run"], Some(&job));
    assert!(ok, "{stdout}\n{stderr}");
    let injected: u64 = stdout
        .lines()
        .find_map(|l| l.strip_prefix("chaos: "))
        .and_then(|l| l.split_whitespace().next())
        .expect("the run reports its injected faults")
        .parse()
        .unwrap();
    assert!(injected >= 20, "only {injected} faults injected");
    assert!(stderr.contains("retrying in"), "{stderr}");
    let completed = checkpoint_lines(&stdout);
    assert!(completed.len() >= 3, "{stdout}");

    let output = stillpoint_connectors::read_committed(&dir.path().join("out")).unwrap();
    assert_eq!(
        lost_and_duplicated(&output, &expected(WORDS, VOCABULARY)),
        (0, 0)
    );
    // Nothing listed as complete has a file missing or damaged (none was GCed).
    let (ok, report) = verify(&store_uri(dir.path(), "data"));
    assert!(ok, "{report}");
    assert_eq!(verified(&report), completed, "{report}");
    eprintln!(
        "chaos: {injected} store faults injected, {} checkpoints completed, all verify, 0 lost, 0 duplicated",
        completed.len()
    );
}

/// A replacement machine: no local state, everything restored comes from the store.
fn remove_local_state(dir: &Path) {
    let data = dir.join("data");
    if data.exists() {
        std::fs::remove_dir_all(data).unwrap();
    }
}

#[derive(Clone, Copy, Debug)]
enum Damage {
    Flip,
    Truncate,
    Delete,
}

fn damage(path: &Path, how: Damage) {
    match how {
        Damage::Flip => {
            let mut bytes = std::fs::read(path).unwrap();
            if bytes.is_empty() {
                // An empty file has no byte to flip: give it one.
                bytes.push(0);
            } else {
                let middle = bytes.len() / 2;
                bytes[middle] ^= 0x20;
            }
            std::fs::write(path, bytes).unwrap();
        }
        Damage::Truncate => {
            let len = std::fs::metadata(path).unwrap().len();
            let file = std::fs::OpenOptions::new().write(true).open(path).unwrap();
            // An empty file cannot be shortened: lengthen it instead.
            file.set_len(if len == 0 { 1 } else { len / 2 }).unwrap();
        }
        Damage::Delete => std::fs::remove_file(path).unwrap(),
    }
}

/// A store with several retained checkpoints; each file of each of them flipped,
/// truncated and deleted in turn: `checkpoints verify` names the file every time;
/// damage to each file of the newest checkpoint (after its output was published)
/// makes recovery fall back to the newest one that verifies, say so, replay exactly
/// up to the published output and publish exactly the failure-free output.
/// Lines the sinks committed for checkpoints in `(from, through]`.
fn published_after(out: &Path, from: u64, through: u64) -> usize {
    let Ok(entries) = std::fs::read_dir(out.join("committed")) else {
        return 0;
    };
    entries
        .map(|e| e.unwrap().path())
        .filter(|path| {
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            let id = name
                .split_once("-task-")
                .and_then(|(id, _)| id.parse::<u64>().ok());
            id.is_some_and(|id| from < id && id <= through)
        })
        .map(|path| std::fs::read_to_string(path).unwrap().lines().count())
        .sum()
}

#[test]
fn every_stored_file_damaged_in_turn_is_named_and_recovery_falls_back() {
    const WORDS: u64 = 250_000;
    let dir = tempfile::tempdir().unwrap();
    // The store apart from the work directory, so a recovery can start on an empty
    // one (a replacement machine) and must download — and verify — what it restores.
    let store_dir = dir.path().join("store");
    let store = format!("file://{}", store_dir.display());
    let job = job(
        dir.path(),
        "sweep.toml",
        "data",
        "out",
        WORDS,
        &format!(
            // Materializing every half second keeps each checkpoint's file list short
            // (the sweep damages every file in turn) and the restores mixed: some
            // stand on a materialization alone, some replay segments too.
            "checkpoint_timeout = \"2s\"\n[store]\nuri = \"{store}\"\n[retention]\nkeep_last = 3\ngrace = \"2s\"\n[state]\nmaterialize_interval = \"500ms\"\n"
        ),
    );
    let (ok, stdout, stderr) = run(&["run"], Some(&job));
    assert!(ok, "{stdout}\n{stderr}");
    // Files of the checkpoints expired in the run's last 2 s are younger than the
    // grace: once it has passed, `checkpoints gc` leaves only what is referenced.
    std::thread::sleep(std::time::Duration::from_millis(2_100));
    let (ok, stdout, stderr) = run(&["checkpoints", "gc", "--job", job.to_str().unwrap()], None);
    assert!(ok, "{stdout}\n{stderr}");
    let (ok, report) = verify(&store);
    assert!(ok, "{report}");
    let retained = verified(&report);
    assert!(retained.len() >= 3, "{report}");
    let newest = *retained.last().unwrap();

    let pristine = dir.path().join("pristine");
    copy_dir(&store_dir, &pristine.join("store"));
    copy_dir(&dir.path().join("out"), &pristine.join("out"));
    let victims: Vec<String> = files(&store_dir)
        .into_iter()
        .filter(|f| f.starts_with("shared/") || f.starts_with("checkpoints/"))
        .collect();
    let newest_dir = format!("checkpoints/{newest:020}/");
    let mut recoveries = 0;
    let mut cases = 0;
    let mut shared_recovered = [false; 3];
    let mut refused = 0;
    let mut lines_checked = 0;
    let mut replayed_records = 0;
    for victim in &victims {
        for how in [Damage::Flip, Damage::Truncate, Damage::Delete] {
            damage(&store_dir.join(victim), how);
            cases += 1;
            let (ok, report) = verify(&store);
            assert!(
                report.contains(victim.as_str()),
                "{how:?} {victim}: {report}"
            );
            let deleted_commit =
                matches!(how, Damage::Delete) && victim.ends_with("_checkpoint.json");
            // Deleting a commit object uncommits its checkpoint (it reads as
            // incomplete, as after a crash before the commit): not an error — unless
            // that checkpoint is asked for by id, which says it is not committed.
            assert_eq!(ok, deleted_commit, "{how:?} {victim}: {report}");
            if deleted_commit {
                let id = victim
                    .strip_prefix("checkpoints/")
                    .and_then(|rest| rest.split('/').next())
                    .map(|digits| digits.parse::<u64>().unwrap().to_string())
                    .unwrap();
                let (ok, one, _) = run(&["checkpoints", "verify", &id, "--store", &store], None);
                assert!(!ok && one.contains("not committed"), "{victim}: {one}");
            }
            let intact = verified(&report);

            // Recovery from each damage to every file of the newest checkpoint (its
            // commit and each task manifest), and to the first shared file it needs.
            let recover = victim.starts_with(&newest_dir)
                || (victim.starts_with("shared/")
                    && !intact.contains(&newest)
                    && !shared_recovered[how as usize]);
            if !recover {
                // Undo the damage (the store is otherwise as the run left it).
                std::fs::copy(pristine.join("store").join(victim), store_dir.join(victim)).unwrap();
                continue;
            }
            if victim.starts_with("shared/") {
                shared_recovered[how as usize] = true;
            }
            recoveries += 1;
            copy_dir(&pristine.join("store"), &store_dir);
            copy_dir(&pristine.join("out"), &dir.path().join("out"));
            remove_local_state(dir.path());
            damage(&store_dir.join(victim), how);
            let (ok, stdout, stderr) = run(&["run"], Some(&job));
            let Some(from) = intact.last().copied() else {
                // No checkpoint verifies: starting over would publish the output
                // again, so the run refuses, naming the newest problem.
                assert!(!ok, "{how:?} {victim}: {stdout}");
                let error = stderr.lines().last().unwrap_or_default();
                assert!(
                    error.starts_with("stillpoint: error: none of the")
                        && error.contains("refusing to start from scratch")
                        && error.contains(victim.as_str()),
                    "{how:?} {victim}: {stderr}"
                );
                refused += 1;
                copy_dir(&pristine.join("store"), &store_dir);
                continue;
            };
            // The sinks published the newest checkpoint's output and recorded the
            // source offsets it covers: the run restores `from`, replays exactly up to
            // those offsets and drops what it reproduces there.
            assert!(ok, "{how:?} {victim}: {stdout}\n{stderr}");
            assert!(
                stdout.contains(&format!("resuming from checkpoint {from} ")),
                "{how:?} {victim}: {stdout}"
            );
            if !deleted_commit {
                let skipped = stdout
                    .lines()
                    .find(|l| {
                        l.starts_with(&format!("checkpoint {newest} does not verify, skipped"))
                    })
                    .unwrap_or_else(|| panic!("{how:?} {victim}: {stdout}"));
                assert!(skipped.contains(victim.as_str()), "{skipped}");
            }
            let replayed: usize = stdout
                .lines()
                .find_map(|l| {
                    l.strip_prefix(&format!(
                        "replaying exactly to the end of the published output of checkpoint {newest}: its "
                    ))?
                    .split_once(' ')?
                    .0
                    .parse()
                    .ok()
                })
                .unwrap_or_else(|| panic!("{how:?} {victim}: {stdout}"));
            // What it reproduced and dropped is what the checkpoints after `from`
            // published (none when the newest only covered the end of the input).
            let published = published_after(&pristine.join("out"), from, newest);
            assert_eq!(replayed, published, "{how:?} {victim}: {stdout}");
            // Exactly the failure-free output, line for line.
            let output = stillpoint_connectors::read_committed(&dir.path().join("out")).unwrap();
            let expected = expected(WORDS, VOCABULARY);
            assert_eq!(
                lost_and_duplicated(&output, &expected),
                (0, 0),
                "{how:?} {victim}"
            );
            assert_eq!(output.len(), expected.len(), "{how:?} {victim}");
            lines_checked += output.len();
            replayed_records += replayed;
            copy_dir(&pristine.join("store"), &store_dir);
        }
    }
    assert!(recoveries >= 9, "{recoveries}");
    assert!(
        recoveries - refused >= 9,
        "{recoveries} recoveries, {refused} refused"
    );

    // Every retained checkpoint damaged: the run refuses to start over (which would
    // publish the output again), naming the newest problem; the output is untouched.
    copy_dir(&pristine.join("store"), &store_dir);
    copy_dir(&pristine.join("out"), &dir.path().join("out"));
    remove_local_state(dir.path());
    for id in &retained {
        damage(
            &store_dir.join(format!("checkpoints/{id:020}/tasks/task-1.json")),
            Damage::Flip,
        );
    }
    let (ok, stdout, stderr) = run(&["run"], Some(&job));
    assert!(!ok, "{stdout}");
    let error = stderr.lines().last().unwrap_or_default();
    assert!(
        error.starts_with(&format!(
            "stillpoint: error: none of the {} committed checkpoint(s) in the store can be restored (newest: checkpoint {newest}: ",
            retained.len()
        )) && error.contains("tasks/task-1.json"),
        "{stderr}"
    );
    assert_eq!(
        files(&dir.path().join("out")),
        files(&pristine.join("out")),
        "nothing published"
    );
    eprintln!(
        "corruption sweep: {} files × 3 damages = {cases} cases named by verify; {} recoveries fell back past published output and replayed it exactly ({replayed_records} records reproduced and dropped): {lines_checked} lines checked, 0 lost, 0 duplicated; {refused} refused (no checkpoint verified)",
        victims.len(),
        recoveries - refused
    );
}

fn signal(pid: u32, name: &str) {
    let status = Command::new("kill")
        .args([&format!("-{name}"), &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "kill -{name} {pid}");
}

/// `stillpoint run` in the background, its stdout lines collected as they come.
struct Background {
    child: std::process::Child,
    lines: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    stderr: PathBuf,
}

impl Background {
    fn start(job: &Path, stderr: PathBuf) -> Self {
        let mut child = stillpoint()
            .arg("run")
            .arg(job)
            .arg("--log")
            .arg("info")
            .stdout(std::process::Stdio::piped())
            .stderr(std::fs::File::create(&stderr).unwrap())
            .spawn()
            .unwrap();
        let lines = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let stdout = child.stdout.take().unwrap();
        let sink = std::sync::Arc::clone(&lines);
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(stdout).lines() {
                sink.lock().unwrap().push(line.unwrap());
            }
        });
        Self {
            child,
            lines,
            stderr,
        }
    }

    fn lines(&self) -> Vec<String> {
        self.lines.lock().unwrap().clone()
    }

    /// Waits (at most 120 s) until `done` holds for the lines so far.
    fn wait_for(&mut self, what: &str, done: impl Fn(&[String]) -> bool) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
        while !done(&self.lines()) {
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!(
                    "exited ({status}) before {what}: {:?}\n{}",
                    self.lines(),
                    std::fs::read_to_string(&self.stderr).unwrap()
                );
            }
            assert!(
                std::time::Instant::now() < deadline,
                "no {what}: {:?}",
                self.lines()
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    fn wait(&mut self) -> std::process::ExitStatus {
        wait_up_to(&mut self.child, std::time::Duration::from_secs(120))
            .unwrap_or_else(|| panic!("did not exit: {:?}", self.lines()))
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        let _killed = self.child.kill();
        let _waited = self.child.wait();
    }
}

/// Two coordinators on one store: the owner is paused (SIGSTOP, checkpoints every
/// 50 ms, so mostly mid-checkpoint) until its lease expires, a second one takes the
/// lease over, checkpoints and stops; then the first is resumed (SIGCONT). Its
/// fence closed when its lease lapsed: it writes nothing more — not a shared file,
/// not a task manifest, not a commit — and exits naming the lease it lost; every
/// committed checkpoint still verifies.
#[test]
fn a_paused_owner_is_fenced_after_its_lease_is_taken_over() {
    let dir = tempfile::tempdir().unwrap();
    let store = format!("file://{}", dir.path().join("store").display());
    let section = format!("[store]\nuri = \"{store}\"\n");
    let job_a = job(dir.path(), "a.toml", "a", "out-a", 50_000_000, &section);
    let job_b = job(dir.path(), "b.toml", "b", "out-b", 50_000_000, &section);

    let mut a = Background::start(&job_a, dir.path().join("a.err"));
    a.wait_for("a checkpoint of the first owner", |l| {
        checkpoint_lines(&l.join("\n")).len() >= 2
    });
    let in_flight = stop_mid_checkpoint(a.child.id(), &dir.path().join("store"));
    let before_pause = a.lines().len();

    // The second coordinator is refused while the lease is live, then takes it over.
    let started = std::time::Instant::now();
    let mut b = loop {
        let mut b = Background::start(&job_b, dir.path().join("b.err"));
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        let status = loop {
            if let Some(status) = b.child.try_wait().unwrap() {
                break Some(status);
            }
            if b.lines().iter().any(|l| l.starts_with("resuming from")) {
                break None;
            }
            assert!(std::time::Instant::now() < deadline, "{:?}", b.lines());
            std::thread::sleep(std::time::Duration::from_millis(20));
        };
        let Some(status) = status else { break b };
        assert!(!status.success());
        let error = std::fs::read_to_string(&b.stderr).unwrap();
        assert!(
            error.contains("leased to") && error.contains(&format!("pid {}", a.child.id())),
            "{error}"
        );
        assert!(
            started.elapsed() < std::time::Duration::from_secs(30),
            "{error}"
        );
        std::thread::sleep(std::time::Duration::from_millis(300));
    };
    let resumed_from: u64 = b
        .lines()
        .iter()
        .find_map(|l| l.strip_prefix("resuming from checkpoint "))
        .and_then(|l| l.split_whitespace().next())
        .unwrap()
        .parse()
        .unwrap();
    b.wait_for("two checkpoints of the new owner", |l| {
        checkpoint_lines(&l.join("\n")).len() >= 2
    });

    // The new owner stops (a final checkpoint) before the old one resumes, so that
    // anything that lands afterwards can only be the old owner's.
    signal(b.child.id(), "INT");
    assert!(b.wait().success(), "{:?}", b.lines());
    let root = dir.path().join("store");
    let before = store_objects(&root);

    signal(a.child.id(), "CONT");
    let status = a.wait();
    assert!(!status.success(), "the fenced owner must not carry on");
    let error = std::fs::read_to_string(&a.stderr).unwrap();
    let last = error.lines().last().unwrap_or_default();
    assert!(last.contains("lease"), "{error}");
    // Anything the old owner reports after its pause was committed before the
    // takeover: at most the checkpoint the new owner resumed from.
    let after: Vec<u64> = checkpoint_lines(&a.lines()[before_pause..].join("\n"));
    assert!(
        after.iter().all(|id| *id <= resumed_from),
        "the old owner committed {after:?} after the new one resumed from {resumed_from}"
    );
    let landed: Vec<_> = store_objects(&root)
        .into_iter()
        .filter(|(path, stamp)| before.get(path) != Some(stamp))
        .map(|(path, _)| path)
        .collect();
    assert!(
        landed.is_empty(),
        "the old owner, paused mid-checkpoint {in_flight}, wrote after the takeover: {landed:?}"
    );
    // The checkpoint it was paused in never became complete.
    assert!(
        !root
            .join(format!("checkpoints/{in_flight:020}/_checkpoint.json"))
            .exists()
    );
    let (ok, report) = verify(&store);
    assert!(ok, "{report}");
    eprintln!("fencing: {last}");
}

/// Stops (SIGSTOP) the process writing to the `file://` store at `root` while one of
/// its checkpoints is in flight — task manifests written, no commit marker — and
/// returns that checkpoint's id; a checkpoint that completed before the signal
/// landed is let go (SIGCONT) and the next one tried.
fn stop_mid_checkpoint(pid: u32, root: &Path) -> u64 {
    let in_flight = || -> Option<u64> {
        let entries = std::fs::read_dir(root.join("checkpoints")).ok()?;
        entries.filter_map(Result::ok).find_map(|entry| {
            let tasks = std::fs::read_dir(entry.path().join("tasks")).ok()?.count();
            let committed = entry.path().join("_checkpoint.json").exists();
            (tasks > 0 && !committed)
                .then(|| entry.file_name().to_string_lossy().parse().ok())
                .flatten()
        })
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        assert!(
            std::time::Instant::now() < deadline,
            "never caught a checkpoint in flight"
        );
        let Some(seen) = in_flight() else {
            std::thread::sleep(std::time::Duration::from_micros(200));
            continue;
        };
        signal(pid, "STOP");
        let checkpoint = root.join(format!("checkpoints/{seen:020}"));
        if !checkpoint.join("_checkpoint.json").exists() && checkpoint.exists() {
            return seen;
        }
        signal(pid, "CONT");
    }
}

/// Every object of a `file://` store (staging files excepted) with its size and
/// modification time.
fn store_objects(root: &Path) -> std::collections::BTreeMap<String, (u64, std::time::SystemTime)> {
    files(root)
        .into_iter()
        .filter(|f| !f.starts_with(".tmp"))
        .map(|f| {
            let meta = std::fs::metadata(root.join(&f)).unwrap();
            (f, (meta.len(), meta.modified().unwrap()))
        })
        .collect()
}

/// Every vocabulary word the generated sources can produce.
fn vocabulary() -> Vec<String> {
    (0..VOCABULARY).map(|i| format!("w{i:05}")).collect()
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// Which of `needles` occur in any file under `root` (lease files excepted: they are
/// plaintext by design and hold no data).
fn found_in_store(root: &Path, needles: &[String]) -> Vec<String> {
    let contents: Vec<Vec<u8>> = files(root)
        .into_iter()
        .filter(|f| !f.starts_with("lease/"))
        .map(|f| std::fs::read(root.join(f)).unwrap())
        .collect();
    needles
        .iter()
        .filter(|n| contents.iter().any(|c| contains(c, n.as_bytes())))
        .cloned()
        .collect()
}

const KEY: &str = "6b1f0c3e9a2d4f5b8c7e1a0d3f6b9c2e5a8d1f4b7c0e3a6d9f2b5c8e1a4d7f0b";
/// Both runs keep their SST blocks uncompressed, so the plaintext run's keys are
/// there to find (RocksDB still prefix-encodes keys between restart points).
const UNCOMPRESSED: &str = "[state]\ncompression = \"none\"\nbottommost_compression = \"none\"\n";
const WRONG_KEY: &str = "0000000000000000000000000000000000000000000000000000000000000001";

/// With encryption on, no word of the input (they are the state's keys and the
/// sinks' records) and not the key appear anywhere in the store or in the run's
/// debug log; the same job unencrypted shows the words (so the scan can fail); the
/// store opens with the right key only, and a missing or wrong key is one line.
#[test]
fn an_encrypted_store_holds_no_plaintext_and_a_wrong_key_is_named() {
    const WORDS: u64 = 20_000;
    let dir = tempfile::tempdir().unwrap();
    let plain = job(
        dir.path(),
        "plain.toml",
        "plain",
        "plain-out",
        WORDS,
        UNCOMPRESSED,
    );
    let (ok, _, stderr) = run(&["run"], Some(&plain));
    assert!(ok, "{stderr}");
    let mut needles = vocabulary();
    needles.push("[DBOptions]".to_owned()); // RocksDB's OPTIONS file
    let seen = found_in_store(&dir.path().join("plain/store"), &needles);
    assert!(
        seen.len() >= 10 && seen.contains(&needles[needles.len() - 1]),
        "the scan finds plaintext: {seen:?}"
    );

    let sealed = job(
        dir.path(),
        "sealed.toml",
        "sealed",
        "sealed-out",
        WORDS,
        &format!("[store]\nencryption_key = \"{KEY}\"\n{UNCOMPRESSED}"),
    );
    let (ok, stdout, log) = run(&["run", "--log", "debug"], Some(&sealed));
    assert!(ok, "{log}");
    let store_dir = dir.path().join("sealed/store");
    needles.push(KEY.to_owned());
    needles.push(KEY.to_uppercase());
    assert_eq!(found_in_store(&store_dir, &needles), Vec::<String>::new());
    assert!(
        log.len() > 1000 && !log.contains(KEY),
        "the key stays out of the log"
    );
    assert!(!stdout.contains(KEY));

    let store = store_uri(dir.path(), "sealed");
    let with_key = |key: Option<&str>| {
        let mut command = stillpoint();
        command.args(["checkpoints", "verify", "--store", &store]);
        match key {
            Some(key) => command.env("STILLPOINT_ENCRYPTION_KEY", key),
            None => command.env_remove("STILLPOINT_ENCRYPTION_KEY"),
        };
        command.output().unwrap()
    };
    let right = with_key(Some(KEY));
    assert!(right.status.success(), "{right:?}");
    for key in [None, Some(WRONG_KEY)] {
        let output = with_key(key);
        assert!(!output.status.success());
        let text = String::from_utf8_lossy(&output.stdout).into_owned()
            + &String::from_utf8_lossy(&output.stderr);
        assert!(!text.contains("panicked"), "{text}");
        assert!(
            text.contains(if key.is_some() {
                "wrong encryption key"
            } else {
                "no encryption key"
            }),
            "{key:?}: {text}"
        );
        assert!(!text.contains(KEY), "{text}");
    }
}

/// A sealed manifest document: `{"format":…,"version":…,"sha256":…,"body":BODY}`
/// with `body` in place and its digest recomputed.
fn reseal(document: &str, body: &str) -> String {
    let start = document.find(r#""sha256":""#).unwrap() + r#""sha256":""#.len();
    let digest = stillpoint_wire::Sha256Digest::of(body.as_bytes());
    format!("{}{digest}\",\"body\":{body}}}", &document[..start])
}

fn body(document: &str) -> &str {
    let at = document.find(r#","body":"#).unwrap() + r#","body":"#.len();
    let end = document.trim_end().len() - 1;
    &document[at..end]
}

/// A checkpoint whose task manifest names a file `../../../escaped.log` — checksums
/// made consistent, as an attacker with write access to the store would — is refused
/// by `restore` and `verify` naming the path, before anything is written.
#[test]
fn a_manifest_path_escaping_the_restore_directory_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let job = job(dir.path(), "job.toml", "data", "out", 20_000, "");
    let (ok, _, stderr) = run(&["run"], Some(&job));
    assert!(ok, "{stderr}");
    let store_dir = dir.path().join("data/store");
    let store = store_uri(dir.path(), "data");
    let (_, report) = verify(&store);
    let newest = *verified(&report).last().unwrap();
    let checkpoint_dir = store_dir.join(format!("checkpoints/{newest:020}"));

    let task_path = checkpoint_dir.join("tasks/task-1.json");
    let task = std::fs::read_to_string(&task_path).unwrap();
    let old_digest = stillpoint_wire::Sha256Digest::of(task.as_bytes()).to_string();
    let first_file = task.find(r#""path": ""#).unwrap() + r#""path": ""#.len();
    let name_end = first_file + task[first_file..].find('"').unwrap();
    let evil_body = body(&task).replacen(&task[first_file..name_end], "../../../escaped.log", 1);
    let evil_task = reseal(&task, &evil_body);
    std::fs::write(&task_path, &evil_task).unwrap();

    let commit_path = checkpoint_dir.join("_checkpoint.json");
    let commit = std::fs::read_to_string(&commit_path).unwrap();
    assert!(
        commit.contains(&old_digest),
        "the commit lists the task manifest's digest"
    );
    let new_digest = stillpoint_wire::Sha256Digest::of(evil_task.as_bytes()).to_string();
    let evil_commit = reseal(&commit, &body(&commit).replace(&old_digest, &new_digest));
    std::fs::write(&commit_path, evil_commit).unwrap();

    let target = dir.path().join("restored");
    let (ok, stdout, stderr) = run(
        &[
            "checkpoints",
            "restore",
            &newest.to_string(),
            target.to_str().unwrap(),
            "--store",
            &store,
        ],
        None,
    );
    assert!(!ok, "{stdout}");
    assert!(stderr.contains("../../../escaped.log"), "{stderr}");
    assert!(stderr.lines().count() == 1, "{stderr}");
    let written = if target.exists() {
        files(&target)
    } else {
        Vec::new()
    };
    assert_eq!(written, Vec::<String>::new());
    assert!(
        files(dir.path())
            .iter()
            .all(|f| !f.ends_with("escaped.log"))
    );

    let (ok, report) = verify(&store);
    assert!(!ok);
    assert!(report.contains("../../../escaped.log"), "{report}");
}

/// Credentials never reach the logs: a job on a real S3-compatible server (SeaweedFS,
/// signatures checked) run at `--log trace`, its credentials in the job file, then
/// `checkpoints list` with them in the environment; neither output holds the secret
/// key or the encryption key.
#[test]
fn credentials_never_appear_in_the_logs_of_an_s3_run() {
    use s3::{ACCESS_KEY, BUCKET, ENDPOINT, S3Server, SECRET_KEY};
    let _server = S3Server::start();
    let dir = tempfile::tempdir().unwrap();
    let uri = format!("s3://{BUCKET}/creds-job?endpoint={ENDPOINT}&region=us-east-1");
    let job = job(
        dir.path(),
        "s3.toml",
        "data",
        "out",
        5_000,
        &format!(
            "[store]\nuri = \"{uri}\"\naccess_key_id = \"{ACCESS_KEY}\"\nsecret_access_key = \"{SECRET_KEY}\"\nencryption_key = \"{KEY}\"\n"
        ),
    );
    // The server may take a moment to accept requests after its port opens.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let (stdout, log) = loop {
        let (ok, stdout, log) = run(&["run", "--log", "trace"], Some(&job));
        if ok {
            break (stdout, log);
        }
        assert!(std::time::Instant::now() < deadline, "{stdout}\n{log}");
        std::thread::sleep(std::time::Duration::from_millis(500));
    };
    assert!(!checkpoint_lines(&stdout).is_empty(), "{stdout}");
    assert!(
        log.contains("s3") && log.lines().count() > 100,
        "the trace log shows the store's requests"
    );
    let output = stillpoint()
        .args(["checkpoints", "list", "--store", &uri, "--log", "trace"])
        .env("AWS_ACCESS_KEY_ID", ACCESS_KEY)
        .env("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
        .env("STILLPOINT_ENCRYPTION_KEY", KEY)
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    let listed = String::from_utf8_lossy(&output.stdout).into_owned()
        + &String::from_utf8_lossy(&output.stderr);
    assert!(listed.contains("complete"), "{listed}");
    for text in [&stdout, &log, &listed] {
        for (secret, what) in [(SECRET_KEY, "the secret key"), (KEY, "the encryption key")] {
            if let Some(at) = text.find(secret) {
                let line = text[..at].rfind('\n').map_or(0, |n| n + 1);
                let end = text[at..].find('\n').map_or(text.len(), |n| at + n);
                panic!("{what} was logged: {}", &text[line..end]);
            }
        }
    }
}
