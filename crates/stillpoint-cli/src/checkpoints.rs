//! `stillpoint checkpoints …`: list, show, verify, restore, garbage-collect and chart
//! the checkpoints of a store.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::SystemTime;

use anyhow::{Context, Result, bail};
use clap::Subcommand;
use stillpoint::CheckpointStats;
use stillpoint_backup::{
    JournalConfig, Lease, LeaseConfig, ListingStatus, Retention, Store, StoreOptions, SystemClock,
    VerifyDepth, gc,
};
use stillpoint_cli::Job;
use stillpoint_wire::{CheckpointId, CheckpointManifest};

use crate::progress::{Reporter, bytes};

/// Where the store is and what to do with it.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// The store URI (`file://DIR`, `s3://BUCKET/PREFIX?endpoint=…`, …). Default: the
    /// job file's store, else file://./stillpoint-data/store.
    #[arg(long, global = true)]
    store: Option<String>,
    /// Take the store (and its options and retention) from this job file.
    #[arg(long, global = true)]
    job: Option<PathBuf>,
    #[command(subcommand)]
    command: Action,
}

#[derive(Debug, Subcommand)]
enum Action {
    /// Every checkpoint with its kind, status and size.
    List,
    /// One checkpoint's manifest, with every task's files.
    Show {
        /// The checkpoint id.
        id: u64,
    },
    /// Reads every file of a checkpoint (all committed ones when no id is given) and
    /// checks its SHA-256; exits non-zero naming each bad file.
    Verify {
        /// The checkpoint id.
        id: Option<u64>,
    },
    /// Downloads a checkpoint, verified, into DIR (resumable: rerun to finish). Needs
    /// only read access to the store: the progress journal lives beside DIR.
    Restore {
        /// The checkpoint id.
        id: u64,
        /// The target directory: empty, or an interrupted restore of this checkpoint.
        dir: PathBuf,
        /// Restore into a directory that holds other files (they may be overwritten).
        #[arg(long)]
        force: bool,
    },
    /// Applies retention: deletes expired checkpoints and unreferenced files.
    Gc {
        /// Only list what would be deleted.
        #[arg(long)]
        dry_run: bool,
        /// Periodic checkpoints to keep (default: the job's retention, else 3).
        #[arg(long)]
        keep_last: Option<usize>,
    },
    /// The statistics of the kept checkpoints as a table.
    Stats {
        /// Also draw duration and size over the checkpoints into this SVG file.
        #[arg(long)]
        plot: Option<PathBuf>,
        /// A running job's metrics endpoint to show the checkpoints in flight from
        /// (repeatable; default: the job file's `metrics.listen` and `metrics.nodes`).
        #[arg(long = "endpoint", value_name = "ADDR")]
        endpoints: Vec<std::net::SocketAddr>,
    },
}

struct Target {
    store: Store,
    uri: String,
    retention: Retention,
    /// The job's metrics endpoints (its own, or its cluster nodes').
    endpoints: Vec<std::net::SocketAddr>,
}

fn open(args: &Args) -> Result<Target> {
    let job = match &args.job {
        Some(path) => Some(Job::load(path)?),
        None => None,
    };
    let endpoints = job.as_ref().map_or_else(Vec::new, |job| {
        let nodes = job.cluster.iter().flat_map(|c| c.node_metrics.iter());
        job.config
            .metrics_listen
            .iter()
            .chain(nodes)
            .copied()
            .collect()
    });
    let (uri, options, retention) = match (&args.store, job) {
        (Some(uri), Some(job)) => (uri.clone(), job.config.store_options, job.config.retention),
        (Some(uri), None) => (uri.clone(), StoreOptions::from_env()?, Retention::default()),
        (None, Some(job)) => (
            job.config.store_uri(),
            job.config.store_options,
            job.config.retention,
        ),
        (None, None) => (
            Job::embedded_default().config.store_uri(),
            StoreOptions::from_env()?,
            Retention::default(),
        ),
    };
    let store = Store::open(&uri, options)?;
    Ok(Target {
        store,
        uri,
        retention,
        endpoints,
    })
}

pub(crate) fn run(args: Args) -> Result<ExitCode> {
    let target = open(&args)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(async {
        match args.command {
            Action::List => list(&target).await,
            Action::Show { id } => show(&target, CheckpointId(id)).await,
            Action::Verify { id } => verify(&target, id.map(CheckpointId)).await,
            Action::Restore { id, dir, force } => {
                restore(&target, CheckpointId(id), dir, force).await
            }
            Action::Gc { dry_run, keep_last } => collect(&target, dry_run, keep_last).await,
            Action::Stats { plot, endpoints } => stats(&target, plot, endpoints).await,
        }
    })
}

fn created(manifest: &CheckpointManifest) -> String {
    i64::try_from(manifest.created_at_millis)
        .ok()
        .and_then(|ms| jiff::Timestamp::from_millisecond(ms).ok())
        .map_or_else(
            || format!("{} ms", manifest.created_at_millis),
            |t| t.strftime("%Y-%m-%d %H:%M:%S UTC").to_string(),
        )
}

async fn list(target: &Target) -> Result<ExitCode> {
    let listing = target.store.checkpoints().await?;
    if listing.is_empty() {
        println!("no checkpoints in {}", target.uri);
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "{:>6}  {:<10}  {:<10}  {:>5}  {:>10}  created",
        "id", "kind", "status", "tasks", "state"
    );
    for entry in listing {
        match entry.status {
            ListingStatus::Committed(manifest) => println!(
                "{:>6}  {:<10}  {:<10}  {:>5}  {:>10}  {}",
                entry.id.get(),
                manifest.kind.to_string(),
                "complete",
                manifest.tasks.len(),
                bytes(manifest.tasks.iter().map(|t| t.state_bytes).sum()),
                created(&manifest)
            ),
            ListingStatus::Corrupt(error) => println!(
                "{:>6}  {:<10}  {:<10}  {:>5}  {:>10}  {error}",
                entry.id.get(),
                "?",
                "CORRUPT",
                "?",
                "?"
            ),
            ListingStatus::Incomplete { task_manifests } => println!(
                "{:>6}  {:<10}  {:<10}  {:>5}  {:>10}  (in flight or abandoned)",
                entry.id.get(),
                "?",
                "incomplete",
                task_manifests,
                "?"
            ),
        }
    }
    Ok(ExitCode::SUCCESS)
}

async fn show(target: &Target, id: CheckpointId) -> Result<ExitCode> {
    let manifest = target.store.checkpoint(id).await?;
    println!(
        "checkpoint {} ({})",
        manifest.checkpoint.get(),
        manifest.kind
    );
    println!("  stream           {}", manifest.stream);
    println!("  transaction      {}", manifest.trans);
    println!("  created          {}", created(&manifest));
    println!("  key groups       {}", manifest.max_parallelism);
    println!(
        "  state            {} in {} task snapshots",
        bytes(manifest.tasks.iter().map(|t| t.state_bytes).sum()),
        manifest.tasks.len()
    );
    for source in &manifest.sources {
        let offset = source.offset.as_u64().map_or_else(
            || format!("{} bytes", source.offset.as_bytes().len()),
            |o| o.to_string(),
        );
        println!("  source {:<9} offset {offset}", source.task);
    }
    for reference in &manifest.tasks {
        let snapshot = target.store.task_manifest(reference).await?;
        println!(
            "  {} on {}: {} in {} files, key groups {}..{}, manifest {}",
            reference.task,
            reference.node,
            bytes(reference.state_bytes),
            snapshot.files.len(),
            snapshot.key_groups.start,
            snapshot.key_groups.end,
            reference.manifest
        );
        for file in &snapshot.files {
            println!(
                "      {:<28} {:>10}  sha256 {}…{}",
                file.path.as_str(),
                bytes(file.size),
                &file.sha256.to_string()[..12],
                if file.shared { "  (shared)" } else { "" }
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

async fn verify(target: &Target, id: Option<CheckpointId>) -> Result<ExitCode> {
    let mut bad = 0usize;
    let entries = match id {
        // The listing says whether it is committed: one with task manifests but no
        // commit marker is reported as not committed, not as a missing checkpoint.
        Some(id) => {
            let status = target
                .store
                .checkpoints()
                .await?
                .into_iter()
                .find(|entry| entry.id == id)
                .map(|entry| entry.status);
            if let Some(ListingStatus::Incomplete { .. }) = &status {
                bad += 1;
            }
            vec![(id, status)]
        }
        None => {
            let entries: Vec<_> = target
                .store
                .checkpoints()
                .await?
                .into_iter()
                .map(|entry| (entry.id, Some(entry.status)))
                .collect();
            if entries.is_empty() {
                println!("no checkpoints in {}", target.uri);
            }
            entries
        }
    };
    let reporter = Reporter::new();
    for (id, status) in entries {
        match status {
            None | Some(ListingStatus::Committed(_)) => {}
            Some(ListingStatus::Corrupt(error)) => {
                bad += 1;
                println!("checkpoint {}: BAD", id.get());
                println!("  {error}");
                continue;
            }
            Some(ListingStatus::Incomplete { task_manifests }) => {
                // Not an error (an upload may be in flight), but never restorable.
                println!(
                    "checkpoint {}: not committed, never restored ({task_manifests} task manifest(s), no {})",
                    id.get(),
                    stillpoint_backup::layout::commit_object(id)
                );
                continue;
            }
        }
        let report = match target
            .store
            .verify(id, VerifyDepth::Content, &reporter)
            .await
        {
            Ok(report) => report,
            Err(error) if error.is_unavailable() => return Err(error.into()),
            Err(error) => {
                bad += 1;
                println!("checkpoint {}: BAD", id.get());
                println!("  {error}");
                continue;
            }
        };
        if report.problems.is_empty() {
            println!(
                "checkpoint {}: ok ({} files, {})",
                id.get(),
                report.files_checked,
                bytes(report.bytes_checked)
            );
        } else {
            bad += 1;
            println!(
                "checkpoint {}: BAD ({} problem(s))",
                id.get(),
                report.problems.len()
            );
            for problem in &report.problems {
                println!("  {problem}");
            }
        }
    }
    if bad > 0 {
        eprintln!("stillpoint: {bad} checkpoint(s) failed verification");
        return Ok(ExitCode::FAILURE);
    }
    Ok(ExitCode::SUCCESS)
}

async fn restore(target: &Target, id: CheckpointId, dir: PathBuf, force: bool) -> Result<ExitCode> {
    let reporter = Reporter::new();
    let report = stillpoint_backup::restore_checkpoint(
        &target.store,
        id,
        &dir,
        &reporter,
        JournalConfig {
            lease: LeaseConfig {
                settle: std::time::Duration::from_millis(100),
                ..LeaseConfig::default()
            },
            ..JournalConfig::default()
        },
        Arc::new(SystemClock),
        force,
    )
    .await?;
    let download = &report.download;
    println!(
        "restored checkpoint {} into {}: {} files downloaded ({}), {} reused, {} kept from the interrupted run; {:.1} s{}",
        id.get(),
        dir.display(),
        download.files_downloaded,
        bytes(download.bytes_downloaded),
        download.files_reused,
        download.files_trusted,
        report.elapsed.as_secs_f64(),
        if report.resumed {
            " in all, across interrupted runs"
        } else {
            ""
        }
    );
    Ok(ExitCode::SUCCESS)
}

async fn collect(target: &Target, dry_run: bool, keep_last: Option<usize>) -> Result<ExitCode> {
    let mut retention = target.retention.clone();
    if let Some(keep) = keep_last {
        if keep == 0 {
            bail!("--keep-last must be at least 1");
        }
        retention.keep_last = keep;
    }
    let plan = gc::plan(&target.store, &retention, SystemTime::now()).await?;
    let ids = |list: &[CheckpointId]| {
        if list.is_empty() {
            "none".to_owned()
        } else {
            list.iter()
                .map(|c| c.get().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        }
    };
    let verb = if dry_run { "would delete" } else { "deleting" };
    println!("keeping checkpoints: {}", ids(&plan.retained));
    println!("{verb} expired checkpoints: {}", ids(&plan.expired));
    println!("{verb} abandoned checkpoints: {}", ids(&plan.abandoned));
    println!(
        "{verb} statistics past the history window: {}",
        ids(&plan.stats_expired)
    );
    println!(
        "{verb} {} unreferenced files ({})",
        plan.orphans.len(),
        bytes(plan.orphan_bytes)
    );
    if dry_run {
        for orphan in &plan.orphans {
            println!("  {orphan}");
        }
        return Ok(ExitCode::SUCCESS);
    }
    if plan.is_empty() {
        println!("nothing to delete");
        return Ok(ExitCode::SUCCESS);
    }
    // Deleting needs the job's lease: a running job holds it and collects by itself.
    let lease = Lease::acquire_job(
        &target.store,
        LeaseConfig {
            settle: std::time::Duration::from_millis(100),
            ..LeaseConfig::default()
        },
        Arc::new(SystemClock),
    )
    .await?;
    let report = gc::collect(&target.store, &retention, &lease, SystemTime::now()).await;
    lease.release().await?;
    let report = report?;
    println!(
        "deleted {} checkpoint(s) and {} file(s)",
        report.plan.expired.len() + report.plan.abandoned.len(),
        report.orphans_deleted
    );
    Ok(ExitCode::SUCCESS)
}

async fn stats(
    target: &Target,
    plot: Option<PathBuf>,
    endpoints: Vec<std::net::SocketAddr>,
) -> Result<ExitCode> {
    let history: Vec<CheckpointStats> = target
        .store
        .stats::<CheckpointStats>()
        .await?
        .into_iter()
        .map(|(_, s)| s)
        .collect();
    if history.is_empty() {
        println!("no checkpoint statistics in {}", target.uri);
    } else {
        println!(
            "{:>6}  {:<10}  {:>9}  {:>11}  {:>9}  {:>10}  {:>10}",
            "id", "kind", "duration", "alignment", "stall", "uploaded", "state"
        );
        for s in &history {
            println!(
                "{:>6}  {:<10}  {:>6} ms  {:>8.2} ms  {:>6.2} ms  {:>10}  {:>10}",
                s.checkpoint,
                s.kind,
                s.duration_millis,
                s.max_alignment_micros as f64 / 1e3,
                s.max_sync_micros as f64 / 1e3,
                bytes(s.uploaded_bytes),
                bytes(s.state_bytes)
            );
        }
        if let Some(newest) = history.last().filter(|s| !s.tasks.is_empty()) {
            println!("checkpoint {} per task:", newest.checkpoint);
            println!(
                "{:>6}  {:>11}  {:>9}  {:>11}  {:>10}  {:>10}",
                "task", "alignment", "sync", "async", "uploaded", "state"
            );
            for t in &newest.tasks {
                println!(
                    "{:>6}  {:>8.2} ms  {:>6.2} ms  {:>8.2} ms  {:>10}  {:>10}",
                    t.task,
                    t.alignment_micros as f64 / 1e3,
                    t.sync_micros as f64 / 1e3,
                    t.async_micros as f64 / 1e3,
                    bytes(t.uploaded_bytes),
                    bytes(t.state_bytes)
                );
            }
        }
    }
    let endpoints = if endpoints.is_empty() {
        &target.endpoints
    } else {
        &endpoints
    };
    for address in endpoints {
        in_flight(*address);
    }
    if let Some(path) = plot {
        let svg = crate::plot::svg(
            &history,
            &format!("stillpoint checkpoints — {}", target.uri),
        );
        std::fs::write(&path, svg).with_context(|| format!("cannot write {}", path.display()))?;
        println!("chart written to {}", path.display());
    }
    Ok(ExitCode::SUCCESS)
}

/// The checkpoint work in flight on the running job's endpoint `address`: each
/// task's state (aligning on which upstreams, snapshots in flight, ready). A job that
/// is not running is said so, not an error.
fn in_flight(address: std::net::SocketAddr) {
    let text = match stillpoint_metrics::scrape(address, std::time::Duration::from_secs(2)) {
        Ok(text) => text,
        Err(error) => {
            println!("in flight: nothing shown ({error}; is the job running?)");
            return;
        }
    };
    let tasks = stillpoint_metrics::in_flight(&text);
    if tasks.is_empty() {
        return;
    }
    println!("in flight at {address}:");
    println!("{:>6}  {:>4}  state", "task", "node");
    for task in tasks {
        let node = task.node.map_or_else(|| "-".to_owned(), |n| n.to_string());
        println!("{:>6}  {:>4}  {}", task.task, node, task.state());
    }
}
