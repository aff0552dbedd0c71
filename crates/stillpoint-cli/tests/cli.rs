//! The `stillpoint` binary, driven as a person would: a small job run twice (the
//! second resumes), the checkpoint subcommands on its store, and one-line errors.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod support;

use assert_cmd::Command;

fn stillpoint() -> Command {
    Command::cargo_bin("stillpoint").unwrap()
}

/// Writes `dir/NAME`: a job working under `dir/data` with a checkpoint every 50 ms,
/// then `rest` (more sections).
fn write_job(dir: &std::path::Path, name: &str, rest: &str) -> std::path::PathBuf {
    let path = dir.join(name);
    let header = format!(
        "[job]\nwork_dir = \"{}\"\ncheckpoint_interval = \"50ms\"\nlease_ttl = \"5s\"\n",
        dir.join("data").display()
    );
    std::fs::write(&path, header + rest).unwrap();
    path
}

fn job_file(dir: &std::path::Path) -> std::path::PathBuf {
    write_job(
        dir,
        "job.toml",
        r#"[pipeline]
sources = 2
aggregators = 2
input = { kind = "generated", words_per_source = 20000, vocabulary = 100 }
"#,
    )
}

fn stdout(command: &mut Command) -> String {
    let output = command.output().unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).unwrap()
}

#[test]
fn run_then_inspect_the_store() {
    let dir = tempfile::tempdir().unwrap();
    let job = job_file(dir.path());
    let first = stdout(stillpoint().arg("run").arg(&job));
    assert!(first.contains("starting fresh"), "{first}");
    assert!(first.contains("checkpoint "), "{first}");
    let second = stdout(stillpoint().arg("run").arg(&job));
    assert!(second.contains("resuming from checkpoint"), "{second}");

    let list = stdout(
        stillpoint()
            .args(["checkpoints", "list", "--job"])
            .arg(&job),
    );
    assert!(list.contains("complete"), "{list}");
    // A reader that closes the pipe early (`| head`) ends the listing quietly.
    let mut closed = std::process::Command::new(assert_cmd::cargo::cargo_bin("stillpoint"))
        .args(["checkpoints", "list", "--job"])
        .arg(&job)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(closed.stdout.take());
    let output = closed.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(output.status.code(), Some(141), "{stderr}");
    let newest: u64 = list
        .lines()
        .rfind(|l| l.contains("complete"))
        .and_then(|l| l.split_whitespace().next())
        .unwrap()
        .parse()
        .unwrap();
    let show = stdout(
        stillpoint()
            .args(["checkpoints", "show", &newest.to_string(), "--job"])
            .arg(&job),
    );
    assert!(show.contains("sha256"), "{show}");
    let verify = stdout(
        stillpoint()
            .args(["checkpoints", "verify", "--job"])
            .arg(&job),
    );
    assert!(verify.contains(": ok"), "{verify}");
    let svg = dir.path().join("stats.svg");
    let stats = stdout(
        stillpoint()
            .args(["checkpoints", "stats", "--job"])
            .arg(&job)
            .arg("--plot")
            .arg(&svg),
    );
    assert!(stats.contains("duration"), "{stats}");
    // The newest checkpoint's part per task: 2 sources, 2 counters, 2 sinks.
    let per_task = stats.split(" per task:").nth(1).unwrap_or_default();
    let rows = per_task
        .lines()
        .filter(|l| l.trim_start().starts_with(|c: char| c.is_ascii_digit()))
        .count();
    assert_eq!(rows, 6, "{stats}");
    assert!(std::fs::read_to_string(&svg).unwrap().starts_with("<svg"));
    let gc = stdout(
        stillpoint()
            .args(["checkpoints", "gc", "--dry-run", "--job"])
            .arg(&job),
    );
    assert!(gc.contains("keeping checkpoints"), "{gc}");
    let target = dir.path().join("restored");
    let restored = stdout(
        stillpoint()
            .args(["checkpoints", "restore", &newest.to_string()])
            .arg(&target)
            .arg("--job")
            .arg(&job),
    );
    assert!(restored.contains("restored checkpoint"), "{restored}");
    // One directory per task of the job (2 sources, 2 counters, 2 sinks), each a
    // RocksDB checkpoint, and the global manifest beside them.
    for task in 1..=6 {
        assert!(
            target.join(format!("task-{task}/CURRENT")).is_file(),
            "task-{task}"
        );
    }
    assert!(target.join("_checkpoint.json").is_file());
    // A non-empty target is refused, one line naming --force, and left as it was;
    // with --force the restore is redone (every file reused) and marked again.
    let refusal = one_line_error(
        stillpoint()
            .args(["checkpoints", "restore", &newest.to_string()])
            .arg(&target)
            .arg("--job")
            .arg(&job),
    );
    assert!(
        refusal.contains("not empty") && refusal.contains("--force"),
        "{refusal}"
    );
    assert!(target.join("_checkpoint.json").is_file());
    let forced = stdout(
        stillpoint()
            .args(["checkpoints", "restore", &newest.to_string()])
            .arg(&target)
            .arg("--force")
            .arg("--job")
            .arg(&job),
    );
    assert!(forced.contains("restored checkpoint"), "{forced}");
    assert!(target.join("_checkpoint.json").is_file());

    // A real collection keeping only the newest: the others are gone, it verifies.
    let gc = stdout(
        stillpoint()
            .args(["checkpoints", "gc", "--keep-last", "1", "--job"])
            .arg(&job),
    );
    assert!(gc.contains("deleted"), "{gc}");
    let list = stdout(
        stillpoint()
            .args(["checkpoints", "list", "--job"])
            .arg(&job),
    );
    let complete: Vec<&str> = list.lines().filter(|l| l.contains("complete")).collect();
    assert_eq!(complete.len(), 1, "{list}");
    assert!(
        complete[0].trim_start().starts_with(&newest.to_string()),
        "{list}"
    );

    // A flipped byte in a stored file: verify names it and exits non-zero.
    let shared = dir.path().join("data/store");
    // The largest content-addressed file: an SST of the newest checkpoint's state.
    let victim = support::files(&shared.join("shared"))
        .into_iter()
        .map(|file| shared.join("shared").join(file))
        .max_by_key(|p| std::fs::metadata(p).unwrap().len())
        .expect("a shared file in the store");
    let mut bytes = std::fs::read(&victim).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 1;
    std::fs::write(&victim, bytes).unwrap();
    let output = stillpoint()
        .args(["checkpoints", "verify", "--job"])
        .arg(&job)
        .output()
        .unwrap();
    assert!(!output.status.success());
    let text = String::from_utf8_lossy(&output.stdout);
    let name = victim.file_name().unwrap().to_string_lossy();
    assert!(
        text.contains("BAD") && text.contains(name.as_ref()),
        "{text}"
    );
}

fn one_line_error(command: &mut Command) -> String {
    let output = command.env_remove("RUST_BACKTRACE").output().unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8(output.stderr).unwrap();
    let lines: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("stillpoint: error"))
        .collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    lines[0].to_owned()
}

#[test]
fn bad_input_is_one_line_naming_what_is_wrong() {
    let dir = tempfile::tempdir().unwrap();
    let job = dir.path().join("bad.toml");
    std::fs::write(&job, "[job]\nwork_dir = \"x\"\nfrobnicate = 1\n").unwrap();
    let error = one_line_error(stillpoint().arg("run").arg(&job));
    assert!(
        error.contains("line 3") && error.contains("frobnicate"),
        "{error}"
    );

    let error = one_line_error(stillpoint().args(["checkpoints", "list", "--store", "ftp://x"]));
    assert!(error.contains("ftp://x"), "{error}");

    let store = format!("file://{}", dir.path().join("empty").display());
    let error = one_line_error(stillpoint().args(["checkpoints", "show", "7", "--store", &store]));
    assert!(error.contains('7'), "{error}");

    // Node numbers start at 1.
    let refused = stillpoint()
        .args(["node", "job.toml", "--node", "0"])
        .output()
        .unwrap();
    let error = String::from_utf8(refused.stderr).unwrap();
    assert!(
        !refused.status.success()
            && error.contains("'0' for '--node")
            && error.contains("not in 1.."),
        "{error}"
    );

    // A metrics address another process holds: refused naming the field, before the
    // job touches its work directory or store.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let work = dir.path().join("data");
    let job = write_job(
        dir.path(),
        "metrics.toml",
        &format!(
            "[metrics]\nlisten = \"{}\"\n[pipeline]\ninput = {{ kind = \"generated\", words_per_source = 100 }}\n",
            taken.local_addr().unwrap()
        ),
    );
    let error = one_line_error(stillpoint().arg("run").arg(&job));
    assert!(
        error.contains("`metrics.listen`")
            && error.contains(&taken.local_addr().unwrap().to_string()),
        "{error}"
    );
    assert!(
        !work.join("store/checkpoints").exists(),
        "nothing was checkpointed"
    );

    // A store on a service this build lacks, and credentials in a URI.
    let error = one_line_error(stillpoint().args(["checkpoints", "list", "--store", "gcs://b/p"]));
    assert!(error.contains("--features gcs"), "{error}");
    let error = one_line_error(stillpoint().args([
        "checkpoints",
        "list",
        "--store",
        "sftp://backup:hunter2@127.0.0.1:1/x",
    ]));
    assert!(
        error.contains("do not belong in a URI") && !error.contains("hunter2"),
        "{error}"
    );
}

#[test]
fn missing_s3_credentials_are_named() {
    let error = one_line_error(
        stillpoint()
            .env_remove("AWS_ACCESS_KEY_ID")
            .env_remove("AWS_SECRET_ACCESS_KEY")
            .args([
                "checkpoints",
                "list",
                "--store",
                "s3://bucket/prefix?endpoint=http://127.0.0.1:1&region=us-east-1",
            ]),
    );
    assert!(
        error.contains("missing credentials") && error.contains("AWS_ACCESS_KEY_ID"),
        "{error}"
    );
}

/// A job over one append-only log directory (`a b c / b c / c`) that never ends: a
/// run of it stops on Ctrl-C.
fn log_job(dir: &std::path::Path) -> std::path::PathBuf {
    let logs = dir.join("log");
    std::fs::create_dir_all(&logs).unwrap();
    std::fs::write(logs.join("0000.log"), "a b c\nb c\nc\n").unwrap();
    write_job(
        dir,
        "log.toml",
        &format!(
            "[pipeline]\nsources = 1\naggregators = 1\ninput = {{ kind = \"log\", dirs = [\"{}\"] }}\n",
            logs.display()
        ),
    )
}

type StdoutLines = std::io::Lines<std::io::BufReader<std::process::ChildStdout>>;

/// `stillpoint ARGS… JOB` in the background, with its stdout as lines.
fn spawn_stillpoint(args: &[&str], job: &std::path::Path) -> (std::process::Child, StdoutLines) {
    use std::io::BufRead;

    let mut child = std::process::Command::new(assert_cmd::cargo::cargo_bin("stillpoint"))
        .args(args)
        .arg(job)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    (child, lines)
}

/// Ctrl-C, as a terminal sends it (SIGINT).
fn interrupt(child: &std::process::Child) {
    let status = std::process::Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
}

/// A running job holds its store's lease: a second run on the same store is refused
/// with who holds it and until when, and Ctrl-C (SIGINT) stops the first after a
/// final checkpoint.
#[test]
fn a_held_lease_is_refused_naming_its_holder_and_ctrl_c_stops_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let job = log_job(dir.path());
    let (mut first, mut lines) = spawn_stillpoint(&["run"], &job);
    let mut seen = Vec::new();
    while !seen.iter().any(|l: &String| l.starts_with("checkpoint ")) {
        seen.push(lines.next().expect("the first run ended early").unwrap());
    }

    // The same job file: its work directory is held by the first run.
    let pid = first.id().to_string();
    let error = one_line_error(stillpoint().arg("run").arg(&job));
    assert!(
        error.contains("work directory") && error.contains(&format!("(pid {pid})")),
        "{error}"
    );
    // Another work directory on the same store: the store's lease is held.
    let data = dir.path().join("data");
    let elsewhere = dir.path().join("elsewhere.toml");
    let text = std::fs::read_to_string(&job).unwrap().replace(
        &format!("work_dir = \"{}\"", data.display()),
        &format!("work_dir = \"{}\"", dir.path().join("elsewhere").display()),
    );
    std::fs::write(
        &elsewhere,
        format!(
            "{text}[store]\nuri = \"file://{}\"\n",
            data.join("store").display()
        ),
    )
    .unwrap();
    let error = one_line_error(stillpoint().arg("run").arg(&elsewhere));
    assert!(
        error.contains("leased to")
            && error.contains(&format!("pid {pid}"))
            && error.contains("until"),
        "{error}"
    );

    interrupt(&first);
    let rest: Vec<String> = lines.map(Result::unwrap).collect();
    assert!(first.wait().unwrap().success(), "{rest:?}");
    assert!(rest.iter().any(|l| l.starts_with("done:")), "{rest:?}");
    let committed: String = std::fs::read_dir(dir.path().join("data/output/committed"))
        .unwrap()
        .map(|e| std::fs::read_to_string(e.unwrap().path()).unwrap())
        .collect();
    for (word, count) in [("a", 1), ("b", 2), ("c", 3)] {
        assert!(
            committed.lines().any(|l| l == format!("{word}\t{count}")),
            "{word}: {committed}"
        );
    }
}

/// `run --savepoint-on-stop`: Ctrl-C stops the job after a savepoint, which
/// `checkpoints list` shows as one and the next run resumes from.
#[test]
fn ctrl_c_with_savepoint_on_stop_ends_on_a_savepoint() {
    let dir = tempfile::tempdir().unwrap();
    let job = log_job(dir.path());
    let (mut run, mut lines) = spawn_stillpoint(&["run", "--savepoint-on-stop"], &job);
    while !lines
        .next()
        .expect("the run ended early")
        .unwrap()
        .starts_with("checkpoint ")
    {}
    interrupt(&run);
    let rest: Vec<String> = lines.map(Result::unwrap).collect();
    assert!(run.wait().unwrap().success(), "{rest:?}");
    let checkpoints: Vec<&String> = rest
        .iter()
        .filter(|l| l.starts_with("checkpoint ") || l.starts_with("savepoint "))
        .collect();
    let last = checkpoints.last().expect("no checkpoint after Ctrl-C");
    assert!(last.starts_with("savepoint "), "{rest:?}");
    let id: String = last.split_whitespace().nth(1).unwrap().to_owned();

    let listed = stillpoint()
        .args(["checkpoints", "list", "--job"])
        .arg(&job)
        .output()
        .unwrap();
    let listed = String::from_utf8(listed.stdout).unwrap();
    assert!(
        listed
            .lines()
            .any(|l| l.split_whitespace().take(2).eq([id.as_str(), "savepoint"])),
        "{listed}"
    );
    // The log never ends: the next run is stopped too once it says where it resumed.
    let (mut again, lines) = spawn_stillpoint(&["run"], &job);
    let start = lines
        .map(Result::unwrap)
        .find(|l| l.starts_with("resuming") || l.starts_with("starting"))
        .expect("the second run said nothing");
    interrupt(&again);
    again.wait().unwrap();
    assert!(
        start.starts_with(&format!("resuming from checkpoint {id} ")),
        "{start}"
    );
}

/// Every example job file loads; the default and the files example run as shipped.
#[test]
fn the_example_job_files_load_and_run() {
    let examples = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples");
    let mut names = Vec::new();
    for entry in std::fs::read_dir(&examples).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            stillpoint_cli::Job::load(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            names.push(path.file_name().unwrap().to_string_lossy().into_owned());
        }
    }
    names.sort();
    assert_eq!(
        names,
        [
            "word-count-cluster.toml",
            "word-count-files.toml",
            "word-count-log.toml",
            "word-count-s3.toml",
            "word-count.toml"
        ]
    );

    // Relative paths are relative to where stillpoint runs.
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("input")).unwrap();
    let part: String = (0..5000).map(|i| format!("w{} apple\n", i % 7)).collect();
    std::fs::write(dir.path().join("input/part-0.txt"), &part).unwrap();
    std::fs::write(dir.path().join("input/part-1.txt"), &part).unwrap();
    let out = stdout(
        stillpoint()
            .current_dir(dir.path())
            .arg("run")
            .arg(examples.join("word-count-files.toml")),
    );
    assert!(out.contains("done:"), "{out}");
    let committed: String = std::fs::read_dir(dir.path().join("stillpoint-files/output/committed"))
        .unwrap()
        .map(|e| std::fs::read_to_string(e.unwrap().path()).unwrap())
        .collect();
    assert!(
        committed.lines().any(|l| l == "apple\t10000"),
        "{committed}"
    );

    let out = stdout(
        stillpoint()
            .current_dir(dir.path())
            .arg("run")
            .arg(examples.join("word-count.toml")),
    );
    assert!(
        out.contains("starting fresh") && out.contains("done:"),
        "{out}"
    );
    assert!(dir.path().join("stillpoint-data/store").is_dir());
}

/// `stillpoint pause` before a run: the run's sources read nothing while its
/// checkpoints go on; `stillpoint resume` lets it finish, exactly once.
#[test]
fn pause_and_resume_a_running_job() {
    let dir = tempfile::tempdir().unwrap();
    let job = job_file(dir.path());
    // With a metrics endpoint, `checkpoints stats` shows the work in flight.
    let metrics = format!("127.0.0.1:{}", support::free_port());
    let text = std::fs::read_to_string(&job).unwrap();
    std::fs::write(&job, format!("{text}[metrics]\nlisten = \"{metrics}\"\n")).unwrap();
    let paused = stdout(stillpoint().arg("pause").arg(&job));
    assert!(paused.starts_with("paused:"), "{paused}");
    let (mut run, mut lines) = spawn_stillpoint(&["run"], &job);
    let committed = || -> usize {
        std::fs::read_dir(dir.path().join("data/output/committed"))
            .map(|entries| {
                entries
                    .map(|e| {
                        std::fs::read_to_string(e.unwrap().path())
                            .unwrap()
                            .lines()
                            .count()
                    })
                    .sum()
            })
            .unwrap_or(0)
    };
    // Wait for the run to say it is paused, then for 3 and for 6 more checkpoints.
    let mut checkpoints_seen = |n: usize| {
        let mut count = 0;
        for line in lines.by_ref() {
            let line = line.unwrap();
            count += usize::from(line.starts_with("checkpoint "));
            if count == n {
                return;
            }
        }
        panic!("the run ended before {n} checkpoints");
    };
    checkpoints_seen(3);
    let before = committed();
    checkpoints_seen(6);
    assert_eq!(committed(), before, "output grew while paused");
    assert!(before < 40_000);
    let stats = stdout(
        stillpoint()
            .args(["checkpoints", "stats", "--job"])
            .arg(&job),
    );
    assert!(
        stats.contains(&format!("in flight at {metrics}:")),
        "{stats}"
    );
    // Six tasks (2 sources, 2 counters, 2 sinks), each with its state.
    let states = stats
        .lines()
        .skip_while(|l| !l.starts_with("in flight"))
        .filter(|l| l.contains("ready") || l.contains("aligning") || l.contains("snapshot"))
        .count();
    assert_eq!(states, 6, "{stats}");
    let resumed = stdout(stillpoint().arg("resume").arg(&job));
    assert!(resumed.starts_with("resumed:"), "{resumed}");
    let rest: Vec<String> = lines.map(Result::unwrap).collect();
    assert!(run.wait().unwrap().success(), "{rest:?}");
    assert!(rest.iter().any(|l| l == "resumed"), "{rest:?}");
    assert_eq!(committed(), 40_000, "every word once");
    let again = stdout(stillpoint().arg("resume").arg(&job));
    assert!(again.starts_with("not paused"), "{again}");
    // Once the job has ended there is nothing in flight to show, and that is said.
    let stats = stdout(
        stillpoint()
            .args(["checkpoints", "stats", "--job"])
            .arg(&job),
    );
    assert!(stats.contains("is the job running?"), "{stats}");
}
