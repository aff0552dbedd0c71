//! Identifier newtypes: streams, tasks, nodes, checkpoints and coordinator transactions.

use std::fmt;

use serde::{Deserialize, Serialize};

macro_rules! id_newtype {
    ($(#[$doc:meta])* $name:ident($inner:ty), $prefix:literal) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $name(pub $inner);

        impl $name {
            /// The raw value, as carried on the wire.
            #[must_use]
            pub const fn get(self) -> $inner {
                self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!($prefix, "{}"), self.0)
            }
        }

        impl From<$inner> for $name {
            fn from(raw: $inner) -> Self {
                Self(raw)
            }
        }
    };
}

id_newtype!(
    /// One dataflow (a job): every checkpoint, task and manifest belongs to exactly one stream.
    StreamId(u64),
    "stream-"
);
id_newtype!(
    /// One task of a stream: a source, aggregate or sink instance at a given parallel index.
    TaskId(u32),
    "task-"
);
id_newtype!(
    /// One node (an OS process that hosts tasks).
    NodeId(u32),
    "node-"
);
id_newtype!(
    /// One checkpoint of a stream. Strictly increasing per stream; a later checkpoint
    /// always has a larger id, so ids order checkpoints in time.
    CheckpointId(u64),
    "ckpt-"
);
id_newtype!(
    /// The coordinator's transaction for one attempt at a checkpoint. A retried checkpoint
    /// keeps its id only if the coordinator says so; the transaction tells attempts apart.
    TransId(u32),
    "trans-"
);

impl CheckpointId {
    /// The id that follows this one, or `None` when the id space is exhausted.
    #[must_use]
    pub const fn next(self) -> Option<Self> {
        match self.0.checked_add(1) {
            Some(raw) => Some(Self(raw)),
            None => None,
        }
    }
}

/// Whether a checkpoint was taken on the coordinator's schedule or asked for by a user.
///
/// Savepoints are never removed by retention and may be restored with a different
/// parallelism; checkpoints are retained newest-N.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CheckpointKind {
    /// A periodic checkpoint, owned by retention.
    Checkpoint,
    /// A user-requested savepoint, kept until a user deletes it.
    Savepoint,
}

impl CheckpointKind {
    pub(crate) const fn to_wire(self) -> u8 {
        match self {
            Self::Checkpoint => 0,
            Self::Savepoint => 1,
        }
    }

    pub(crate) const fn from_wire(raw: u8) -> Option<Self> {
        match raw {
            0 => Some(Self::Checkpoint),
            1 => Some(Self::Savepoint),
            _ => None,
        }
    }
}

impl fmt::Display for CheckpointKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Checkpoint => "checkpoint",
            Self::Savepoint => "savepoint",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_display_with_their_domain_prefix() {
        assert_eq!(StreamId(7).to_string(), "stream-7");
        assert_eq!(TaskId(3).to_string(), "task-3");
        assert_eq!(NodeId(1).to_string(), "node-1");
        assert_eq!(CheckpointId(42).to_string(), "ckpt-42");
        assert_eq!(TransId(9).to_string(), "trans-9");
    }

    #[test]
    fn checkpoint_ids_order_and_advance() {
        assert!(CheckpointId(1) < CheckpointId(2));
        assert_eq!(CheckpointId(1).next(), Some(CheckpointId(2)));
        assert_eq!(CheckpointId(u64::MAX).next(), None);
    }

    #[test]
    fn checkpoint_kind_wire_codes_round_trip() {
        for kind in [CheckpointKind::Checkpoint, CheckpointKind::Savepoint] {
            assert_eq!(CheckpointKind::from_wire(kind.to_wire()), Some(kind));
        }
        assert_eq!(CheckpointKind::from_wire(2), None);
    }
}
