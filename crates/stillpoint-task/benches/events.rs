//! Handled events per second for a 64-task dataflow (8 sources → 16 → 16 aggregates
//! → 24 sinks), every task running its machine under the simulator with a fault-free
//! world. The figure includes the simulator's own work (routing records, queues), so
//! the machines alone are faster.
#![allow(
    missing_docs,
    clippy::unwrap_used,
    clippy::print_stdout,
    clippy::indexing_slicing
)]

use std::hint::black_box;
use std::time::Instant;

use criterion::{Criterion, Throughput, criterion_group};
use stillpoint_task::sim::{self, Faults, SimConfig, Topology};

fn config() -> SimConfig {
    SimConfig {
        faults: Faults::none(),
        records_per_source: 200,
        ..SimConfig::new(1, Topology::Wide64)
    }
}

fn events(c: &mut Criterion) {
    let events = sim::run(&config()).unwrap().events;
    let mut group = c.benchmark_group("task");
    group.throughput(Throughput::Elements(events));
    group.sample_size(20);
    group.bench_function("wide64_run", |b| {
        b.iter(|| sim::run(black_box(&config())).unwrap())
    });
    group.finish();
}

/// Without `--bench` (how `cargo test` runs bench targets) the figures are produced
/// at tiny sizes, so CI checks each is still printed without timing anything.
fn smoke() -> bool {
    !std::env::args().any(|arg| arg == "--bench")
}

fn figure() {
    let mut rates = Vec::new();
    for _ in 0..if smoke() { 1 } else { 7 } {
        let start = Instant::now();
        let outcome = sim::run(&config()).unwrap();
        rates.push(outcome.events as f64 / start.elapsed().as_secs_f64());
    }
    rates.sort_by(f64::total_cmp);
    println!(
        "FIGURE task.events_per_second_64_tasks = {:.0} events/s goal >= 100000 (machine inputs handled per second, simulator overhead included)",
        rates[rates.len() / 2]
    );
}

criterion_group!(benches, events);

fn main() {
    benches();
    criterion::Criterion::default()
        .configure_from_args()
        .final_summary();
    figure();
}
