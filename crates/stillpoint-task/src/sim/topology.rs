//! The dataflow shapes the simulator runs, and the failure-free output of each.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use stillpoint_wire::TaskId;

use crate::TaskLevel;
use crate::sim::rng::mix;

/// A dataflow shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Topology {
    /// source → aggregate → sink.
    Chain,
    /// source → two aggregates → one sink (two paths that must align again).
    Diamond,
    /// eight sources → aggregate → sink.
    FanIn8,
    /// source → aggregate → eight sinks.
    FanOut8,
    /// two sources → two aggregates (all-to-all) → aggregate → two sinks.
    Mixed3,
    /// 64 tasks: 8 sources → 16 aggregates → 16 aggregates (all-to-all) → 24 sinks.
    Wide64,
}

impl Topology {
    /// The shapes CI runs.
    pub const CI: [Self; 5] = [
        Self::Chain,
        Self::Diamond,
        Self::FanIn8,
        Self::FanOut8,
        Self::Mixed3,
    ];

    /// Its name, as `cargo xtask sim --topology` takes it.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::Chain => "chain",
            Self::Diamond => "diamond",
            Self::FanIn8 => "fan-in-8",
            Self::FanOut8 => "fan-out-8",
            Self::Mixed3 => "mixed-3",
            Self::Wide64 => "wide-64",
        }
    }

    /// The tasks, ids `1..=n`, with their edges.
    #[must_use]
    pub fn graph(self) -> Graph {
        let mut g = Graph::default();
        match self {
            Self::Chain => {
                g.add(1, TaskLevel::Source);
                g.add(2, TaskLevel::Aggregate);
                g.add(3, TaskLevel::Sink);
                g.edge(1, 2);
                g.edge(2, 3);
            }
            Self::Diamond => {
                g.add(1, TaskLevel::Source);
                g.add(2, TaskLevel::Aggregate);
                g.add(3, TaskLevel::Aggregate);
                g.add(4, TaskLevel::Sink);
                for (u, d) in [(1, 2), (1, 3), (2, 4), (3, 4)] {
                    g.edge(u, d);
                }
            }
            Self::FanIn8 => {
                g.add(9, TaskLevel::Aggregate);
                g.add(10, TaskLevel::Sink);
                for s in 1..=8 {
                    g.add(s, TaskLevel::Source);
                    g.edge(s, 9);
                }
                g.edge(9, 10);
            }
            Self::FanOut8 => {
                g.add(1, TaskLevel::Source);
                g.add(2, TaskLevel::Aggregate);
                g.edge(1, 2);
                for k in 3..=10 {
                    g.add(k, TaskLevel::Sink);
                    g.edge(2, k);
                }
            }
            Self::Mixed3 => {
                for (t, level) in [
                    (1, TaskLevel::Source),
                    (2, TaskLevel::Source),
                    (3, TaskLevel::Aggregate),
                    (4, TaskLevel::Aggregate),
                    (5, TaskLevel::Aggregate),
                    (6, TaskLevel::Sink),
                    (7, TaskLevel::Sink),
                ] {
                    g.add(t, level);
                }
                for (u, d) in [
                    (1, 3),
                    (1, 4),
                    (2, 3),
                    (2, 4),
                    (3, 5),
                    (4, 5),
                    (5, 6),
                    (5, 7),
                ] {
                    g.edge(u, d);
                }
            }
            Self::Wide64 => {
                for s in 1..=8 {
                    g.add(s, TaskLevel::Source);
                }
                for a in 9..=40 {
                    g.add(a, TaskLevel::Aggregate);
                }
                for k in 41..=64 {
                    g.add(k, TaskLevel::Sink);
                }
                for s in 1..=8 {
                    g.edge(s, 9 + 2 * (s - 1));
                    g.edge(s, 10 + 2 * (s - 1));
                }
                for a in 9..=24 {
                    for b in 25..=40 {
                        g.edge(a, b);
                    }
                }
                for k in 41..=64_u32 {
                    g.edge(25 + (k - 41) % 16, k);
                }
            }
        }
        g
    }
}

impl fmt::Display for Topology {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Topology {
    type Err = String;

    fn from_str(name: &str) -> Result<Self, Self::Err> {
        [
            Self::Chain,
            Self::Diamond,
            Self::FanIn8,
            Self::FanOut8,
            Self::Mixed3,
            Self::Wide64,
        ]
        .into_iter()
        .find(|t| t.name() == name)
        .ok_or_else(|| format!("unknown topology `{name}`"))
    }
}

/// One task of a graph.
#[derive(Clone, Debug, Default)]
pub struct Node {
    /// Its level (`None` only while building).
    pub level: Option<TaskLevel>,
    /// Its upstreams.
    pub upstreams: Vec<TaskId>,
    /// Its downstreams.
    pub downstreams: Vec<TaskId>,
}

/// A dataflow graph.
#[derive(Clone, Debug, Default)]
pub struct Graph {
    /// Tasks by id.
    pub nodes: BTreeMap<TaskId, Node>,
}

impl Graph {
    fn add(&mut self, task: u32, level: TaskLevel) {
        self.nodes.entry(TaskId(task)).or_default().level = Some(level);
    }

    fn edge(&mut self, up: u32, down: u32) {
        self.nodes
            .entry(TaskId(up))
            .or_default()
            .downstreams
            .push(TaskId(down));
        self.nodes
            .entry(TaskId(down))
            .or_default()
            .upstreams
            .push(TaskId(up));
    }

    /// The source tasks.
    #[must_use]
    pub fn sources(&self) -> Vec<TaskId> {
        self.with_level(TaskLevel::Source)
    }

    /// Tasks of `level`.
    #[must_use]
    pub fn with_level(&self, level: TaskLevel) -> Vec<TaskId> {
        self.nodes
            .iter()
            .filter(|(_, n)| n.level == Some(level))
            .map(|(t, _)| *t)
            .collect()
    }

    /// The downstream a record goes to from `at`: a stable hash partition.
    #[must_use]
    pub fn route(&self, at: TaskId, record: Record) -> Option<TaskId> {
        let downstreams = &self.nodes.get(&at)?.downstreams;
        let n = downstreams.len() as u64;
        let hash = mix(u64::from(record.source.0) << 40 ^ record.seq ^ u64::from(at.0) << 20);
        downstreams
            .get(usize::try_from(hash % n.max(1)).ok()?)
            .copied()
    }

    /// The failure-free result: per sink the records it commits, per aggregate how
    /// many records of each source it applies.
    #[must_use]
    pub fn expected(&self, records_per_source: u64) -> Expected {
        let mut expected = Expected::default();
        for source in self.sources() {
            for seq in 0..records_per_source {
                let record = Record { source, seq };
                let mut at = source;
                while let Some(next) = self.route(at, record) {
                    at = next;
                    match self.nodes.get(&at).and_then(|n| n.level) {
                        Some(TaskLevel::Aggregate) => {
                            *expected
                                .applied
                                .entry(at)
                                .or_default()
                                .entry(source)
                                .or_default() += 1;
                        }
                        Some(TaskLevel::Sink) => {
                            expected.committed.entry(at).or_default().push(record);
                        }
                        _ => {}
                    }
                }
            }
        }
        for records in expected.committed.values_mut() {
            records.sort_unstable();
        }
        expected
    }
}

/// One record: the `seq`-th record of `source`'s input.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Record {
    /// The source that read it.
    pub source: TaskId,
    /// Its position in that source's input.
    pub seq: u64,
}

/// What a failure-free run produces.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Expected {
    /// Per sink, the committed records, sorted.
    pub committed: BTreeMap<TaskId, Vec<Record>>,
    /// Per aggregate, records applied per source.
    pub applied: BTreeMap<TaskId, BTreeMap<TaskId, u64>>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn graphs_are_well_formed_and_wide_has_64_tasks() {
        for topology in [
            Topology::Chain,
            Topology::Diamond,
            Topology::FanIn8,
            Topology::FanOut8,
            Topology::Mixed3,
            Topology::Wide64,
        ] {
            let g = topology.graph();
            for (task, node) in &g.nodes {
                let level = node.level.unwrap();
                assert_eq!(
                    node.upstreams.is_empty(),
                    level == TaskLevel::Source,
                    "{topology} {task}"
                );
                assert_eq!(
                    node.downstreams.is_empty(),
                    level == TaskLevel::Sink,
                    "{topology} {task}"
                );
            }
            let total: usize = g.expected(10).committed.values().map(Vec::len).sum();
            assert_eq!(
                total,
                10 * g.sources().len(),
                "{topology}: every record reaches one sink"
            );
            assert_eq!(topology.name().parse::<Topology>(), Ok(topology));
        }
        assert_eq!(Topology::Wide64.graph().nodes.len(), 64);
    }
}
