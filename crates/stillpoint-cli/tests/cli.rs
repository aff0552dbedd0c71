//! The `stillpoint` binary, driven as a person would: a small job run twice (the
//! second resumes), the checkpoint subcommands on its store, and one-line errors.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use assert_cmd::Command;

fn stillpoint() -> Command {
    Command::cargo_bin("stillpoint").unwrap()
}

fn job_file(dir: &std::path::Path) -> std::path::PathBuf {
    let path = dir.join("job.toml");
    std::fs::write(
        &path,
        format!(
            r#"[job]
work_dir = "{}"
checkpoint_interval = "50ms"
lease_ttl = "5s"
[pipeline]
sources = 2
aggregators = 2
input = {{ kind = "generated", words_per_source = 20000, vocabulary = 100 }}
"#,
            dir.join("data").display()
        ),
    )
    .unwrap();
    path
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

    // A flipped byte in a stored file: verify names it and exits non-zero.
    let shared = dir.path().join("data/store");
    // The largest content-addressed file: an SST of the newest checkpoint's state.
    let victim = walk(&shared.join("shared"))
        .into_iter()
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

fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        if path.is_dir() {
            out.extend(walk(&path));
        } else {
            out.push(path);
        }
    }
    out
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
}
