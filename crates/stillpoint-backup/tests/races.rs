//! Several OS processes racing on one `file://` store: for the job lease and for the
//! conditional create a commit is made of. Each race must have exactly one winner,
//! every time.
//!
//! The test runs this same test binary as its racers (the child mode is chosen by an
//! environment variable; each racer writes its answers to a file beside the store); racers start each race at the same wall-clock instant, so
//! their requests overlap as closely as separate processes can.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::print_stdout,
    clippy::cast_possible_truncation
)]

mod support;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use stillpoint_backup::{Lease, LeaseConfig, Store, StoreError, StoreOptions, SystemClock};

const CHILD: &str = "STILLPOINT_RACE_CHILD";
const RACERS: usize = 4;
/// Races per run (`STILLPOINT_RACES` overrides it).
const RACES: u64 = 200;
const SPACING: Duration = Duration::from_millis(15);

#[test]
fn processes_racing_for_the_lease_and_a_commit_have_exactly_one_winner_each_time() {
    if let Ok(spec) = std::env::var(CHILD) {
        race_as_child(&spec);
        return;
    }
    let races: u64 = std::env::var("STILLPOINT_RACES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(RACES);
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    std::fs::create_dir_all(&store).unwrap();
    // Far enough ahead that every racer is up before the first race.
    let start = now_millis() + 2_000;
    let exe = std::env::current_exe().unwrap();
    let children: Vec<_> = (0..RACERS)
        .map(|racer| {
            Command::new(&exe)
                .args([
                    "--exact",
                    "processes_racing_for_the_lease_and_a_commit_have_exactly_one_winner_each_time",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env(
                    CHILD,
                    format!("{racer};{start};{races};{}", store.display()),
                )
                .stdout(std::process::Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    let mut lease_winners: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
    let mut commit_winners: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
    let mut answers = 0;
    for (racer, child) in children.into_iter().enumerate() {
        let output = child.wait_with_output().unwrap();
        assert!(output.status.success(), "racer {racer} failed");
        let answers_file = dir.path().join(format!("answers-{racer}.txt"));
        for line in std::fs::read_to_string(&answers_file).unwrap().lines() {
            let Some(rest) = line.strip_prefix("race ") else {
                continue;
            };
            let words: Vec<&str> = rest.split(' ').collect();
            let race: u64 = words[0].parse().unwrap();
            answers += 1;
            if words[1] == "lease-won" {
                lease_winners.entry(race).or_default().push(racer);
            }
            if words[2] == "commit-won" {
                commit_winners.entry(race).or_default().push(racer);
            }
        }
    }
    assert_eq!(
        answers,
        races * RACERS as u64,
        "every racer answers every race"
    );
    for race in 0..races {
        let lease = lease_winners.get(&race).map_or(0, Vec::len);
        let commit = commit_winners.get(&race).map_or(0, Vec::len);
        assert_eq!(
            lease, 1,
            "race {race}: {lease} processes acquired the lease"
        );
        assert_eq!(
            commit, 1,
            "race {race}: {commit} processes created the commit"
        );
        let winner = commit_winners[&race][0];
        let marker = store.join(format!("race-{race}/_checkpoint.json"));
        assert_eq!(
            std::fs::read_to_string(&marker).unwrap(),
            format!("committed by racer {winner}"),
            "race {race}: the marker holds its one winner's bytes"
        );
    }
    println!(
        "{races} races of {RACERS} processes each for a lease and for a commit: one winner every time"
    );
}

fn race_as_child(spec: &str) {
    let mut parts = spec.splitn(4, ';');
    let racer: u64 = parts.next().unwrap().parse().unwrap();
    let start: u64 = parts.next().unwrap().parse().unwrap();
    let races: u64 = parts.next().unwrap().parse().unwrap();
    let root = Path::new(parts.next().unwrap());
    let store = support::file_store(root, StoreOptions::default());
    let runtime = support::runtime();
    let mut answers = String::new();
    for race in 0..races {
        let at = start + race * SPACING.as_millis() as u64;
        let wait = at.saturating_sub(now_millis());
        std::thread::sleep(Duration::from_millis(wait));
        let (lease, commit) = runtime.block_on(async {
            tokio::join!(acquire(&store, race, racer), create(&store, race, racer))
        });
        answers.push_str(&format!(
            "race {race} {} {}\n",
            if lease { "lease-won" } else { "lease-lost" },
            if commit { "commit-won" } else { "commit-lost" }
        ));
    }
    let file = root.parent().unwrap().join(format!("answers-{racer}.txt"));
    std::fs::write(file, answers).unwrap();
}

async fn acquire(store: &Store, race: u64, racer: u64) -> bool {
    let config = LeaseConfig {
        ttl: Duration::from_secs(60),
        settle: Duration::ZERO,
        holder: format!("racer {racer}"),
        reclaim_own: false,
        reclaim_dead_local: false,
    };
    match Lease::acquire(
        store,
        &format!("race-{race}/lease/"),
        config,
        Arc::new(SystemClock),
    )
    .await
    {
        Ok(_lease) => true,
        Err(StoreError::LeaseHeld { .. } | StoreError::LeaseLost { .. }) => false,
        Err(other) => panic!("racer {racer}, race {race}: {other}"),
    }
}

/// The commit's primitive: a conditional create of the checkpoint's marker.
async fn create(store: &Store, race: u64, racer: u64) -> bool {
    let path = format!("race-{race}/_checkpoint.json");
    match store
        .raw_operator()
        .write_with(&path, format!("committed by racer {racer}"))
        .if_not_exists(true)
        .await
    {
        Ok(_) => true,
        Err(e) if e.kind() == opendal::ErrorKind::ConditionNotMatch => false,
        Err(e) => panic!("racer {racer}, race {race}: {e}"),
    }
}

fn now_millis() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}
