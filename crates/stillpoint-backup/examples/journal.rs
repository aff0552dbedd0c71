//! A long job made resumable with the progress journal (the BR seed's checkpoint
//! runner): a copy of 24 items in 3 groups records each finished item and keeps a
//! running per-group summary; the first run is cut short after 10 items, and the rerun
//! skips what the journal recorded and reports the time of both runs together.
//!
//! ```sh
//! cargo run -p stillpoint-backup --example journal [STORE_URI]
//! ```
//!
//! With no argument the journal lives in a `file://` store in a temporary directory;
//! any store URI works (`memory://x`, `s3://…`).
#![allow(clippy::print_stdout)]

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use stillpoint_backup::journal::{self, Journal, JournalConfig, Resumed};
use stillpoint_backup::{LeaseConfig, Store, StoreError, StoreOptions, SystemClock};

/// What a group's summary holds: items done and a checksum over them.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
struct Summary {
    items: u32,
    checksum: u64,
}

const ITEMS: u32 = 24;
const GROUPS: u32 = 3;
const NAME: &str = "example-copy";

/// One run of the job: resumes the journal, does what it has not recorded (stopping
/// after `budget` items when given), and says what it did.
async fn run(store: &Store, budget: Option<usize>) -> Result<(usize, Duration), StoreError> {
    let resumed: Resumed<u32, u32, Summary> = journal::resume(store, NAME).await?;
    let done: BTreeSet<u32> = resumed.records.values().flatten().copied().collect();
    let mut summaries = resumed.summaries.clone();
    let config = JournalConfig {
        flush_interval: Duration::from_millis(200),
        summary_interval: Duration::from_millis(100),
        lease: LeaseConfig {
            settle: Duration::from_millis(10),
            ..LeaseConfig::default()
        },
        ..JournalConfig::default()
    };
    let started = tokio::time::Instant::now();
    let journal: Journal<u32, u32, Summary> =
        Journal::start(store, NAME, config, Arc::new(SystemClock), resumed.elapsed).await?;
    let mut copied = 0;
    for item in (0..ITEMS).filter(|item| !done.contains(item)) {
        if budget.is_some_and(|budget| copied == budget) {
            // Cut short: what is pending is flushed, as a failing job does.
            journal.finish(true).await?;
            return Ok((copied, resumed.elapsed + started.elapsed()));
        }
        tokio::time::sleep(Duration::from_millis(20)).await; // the work
        let group = item % GROUPS;
        journal.append(group, vec![item]).await?;
        let summary = summaries.entry(group).or_default();
        summary.items += 1;
        summary.checksum = summary.checksum.wrapping_add(u64::from(item) * 0x9E37_79B9);
        journal.summarize(group, *summary).await?;
        copied += 1;
    }
    journal.finish(true).await?;
    Ok((copied, resumed.elapsed + started.elapsed()))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let scratch = tempfile::tempdir()?;
    let uri = std::env::args()
        .nth(1)
        .unwrap_or_else(|| format!("file://{}", scratch.path().display()));
    let store = Store::open(&uri, StoreOptions::default())?;

    let (first, after_first) = run(&store, Some(10)).await?;
    println!("first run: {first} items copied, then interrupted ({after_first:.2?} so far)");
    let (second, total) = run(&store, None).await?;
    println!("rerun: {second} items copied, the {first} recorded ones skipped; {total:.2?} in all");
    assert_eq!(first + second, ITEMS as usize, "every item exactly once");
    assert!(total >= after_first, "elapsed time accumulates across runs");

    let resumed: Resumed<u32, u32, Summary> = journal::resume(&store, NAME).await?;
    for (group, summary) in &resumed.summaries {
        println!(
            "group {group}: {} items, checksum {:#x}",
            summary.items, summary.checksum
        );
    }
    assert_eq!(
        resumed.summaries.values().map(|s| s.items).sum::<u32>(),
        ITEMS
    );
    Ok(())
}
