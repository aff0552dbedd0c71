//! Key groups: the unit of state redistribution. Every key belongs to the key group
//! `hash(key) % max_parallelism`, fixed for the life of a stream, and each task owns
//! a contiguous range of them, so a rescale moves whole ranges.

use stillpoint_wire::{KeyGroupRange, Record};

use crate::StateError;

/// The largest maximum parallelism (key groups are stored as a 2-byte prefix).
pub const MAX_KEY_GROUPS: u32 = 32_768;

/// The key groups of a stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KeyGroups {
    max_parallelism: u32,
}

impl KeyGroups {
    /// A stream with `max_parallelism` key groups (1 ..= 32 768).
    pub fn new(max_parallelism: u32) -> Result<Self, StateError> {
        if (1..=MAX_KEY_GROUPS).contains(&max_parallelism) {
            Ok(Self { max_parallelism })
        } else {
            Err(StateError::KeyGroups {
                range: KeyGroupRange {
                    start: 0,
                    end: max_parallelism,
                },
                max_parallelism: MAX_KEY_GROUPS,
            })
        }
    }

    /// The number of key groups.
    #[must_use]
    pub const fn max_parallelism(&self) -> u32 {
        self.max_parallelism
    }

    /// All key groups.
    #[must_use]
    pub const fn all(&self) -> KeyGroupRange {
        KeyGroupRange {
            start: 0,
            end: self.max_parallelism,
        }
    }

    /// The key group of `key`. Stable across versions and platforms: changing it
    /// would scatter restored state, so it is FNV-1a followed by a 64-bit finalizer.
    #[must_use]
    pub fn of(&self, key: &[u8]) -> u32 {
        let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
        for byte in key {
            hash ^= u64::from(*byte);
            hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
        }
        hash ^= hash >> 33;
        hash = hash.wrapping_mul(0xff51_afd7_ed55_8ccd);
        hash ^= hash >> 33;
        u32::try_from(hash % u64::from(self.max_parallelism)).unwrap_or(0)
    }

    /// The contiguous range task `index` of `parallelism` owns (as Flink splits them:
    /// sizes differ by at most one).
    pub fn range_of(&self, parallelism: u32, index: u32) -> Result<KeyGroupRange, StateError> {
        KeyGroupRange::of_task(self.max_parallelism, parallelism, index).ok_or(
            StateError::KeyGroups {
                range: KeyGroupRange {
                    start: index,
                    end: parallelism,
                },
                max_parallelism: self.max_parallelism,
            },
        )
    }

    /// Routing over `parallelism` tasks that own contiguous ranges as
    /// [`KeyGroups::range_of`] assigns them: which task a key's records go to.
    pub fn router(&self, parallelism: u32) -> Result<KeyGroupRouter, StateError> {
        let mut owner = vec![0; self.max_parallelism as usize];
        for index in 0..parallelism {
            let range = self.range_of(parallelism, index)?;
            if let Some(slots) = owner.get_mut(range.start as usize..range.end as usize) {
                slots.fill(index);
            }
        }
        Ok(KeyGroupRouter {
            groups: *self,
            owner,
        })
    }

    pub(crate) fn check(&self, range: KeyGroupRange) -> Result<(), StateError> {
        if range.start <= range.end && range.end <= self.max_parallelism {
            Ok(())
        } else {
            Err(StateError::KeyGroups {
                range,
                max_parallelism: self.max_parallelism,
            })
        }
    }
}

/// The 2-byte big-endian prefix of key group `group`; keys sort by key group.
pub(crate) fn prefix(group: u32) -> [u8; 2] {
    u16::try_from(group).unwrap_or(u16::MAX).to_be_bytes()
}

/// Which of a stage's tasks each key goes to ([`KeyGroups::router`]): one table
/// lookup per record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyGroupRouter {
    groups: KeyGroups,
    /// The owning task's index, per key group.
    owner: Vec<u32>,
}

impl KeyGroupRouter {
    /// The index (within its stage) of the task that owns `key`'s key group.
    #[must_use]
    pub fn route(&self, key: &[u8]) -> usize {
        self.owner
            .get(self.groups.of(key) as usize)
            .map_or(0, |index| *index as usize)
    }
}

/// How a task spreads its output over its downstream tasks.
#[derive(Clone, Debug)]
pub enum Partitioner {
    /// One downstream (or none).
    Forward,
    /// Every record to every downstream.
    Broadcast,
    /// By the key group of the record's key, over the downstreams in stage order.
    KeyGroups(KeyGroupRouter),
}

impl Partitioner {
    /// `records` split over `downstreams` tasks, one batch per task in their order.
    #[must_use]
    pub fn split(&self, records: Vec<Record>, downstreams: usize) -> Vec<Vec<Record>> {
        let router = match self {
            // Records share their bytes: a copy per downstream is a reference count.
            Self::Broadcast => return vec![records; downstreams],
            Self::Forward => {
                let mut per = vec![Vec::new(); downstreams];
                if let Some(only) = per.first_mut() {
                    *only = records;
                }
                return per;
            }
            Self::KeyGroups(router) => router,
        };
        // Each record's downstream first, so that every bucket is allocated once at
        // the size it fills: buckets grown from empty copied each record several
        // times on a job's per-record path.
        let targets: Vec<usize> = records.iter().map(|r| router.route(&r.key)).collect();
        let mut sizes = vec![0_usize; downstreams];
        for target in &targets {
            if let Some(size) = sizes.get_mut(*target) {
                *size += 1;
            }
        }
        let mut per: Vec<Vec<Record>> = sizes.into_iter().map(Vec::with_capacity).collect();
        for (record, target) in records.into_iter().zip(targets) {
            if let Some(bucket) = per.get_mut(target) {
                bucket.push(record);
            }
        }
        per
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_router_sends_each_key_to_the_task_owning_its_key_group() {
        let groups = KeyGroups::new(128).unwrap();
        for parallelism in [1, 3, 5, 128] {
            let router = groups.router(parallelism).unwrap();
            for word in 0..2_000_u32 {
                let key = format!("word-{word}");
                let index = router.route(key.as_bytes());
                let owned = groups
                    .range_of(parallelism, u32::try_from(index).unwrap())
                    .unwrap();
                assert!(owned.contains(groups.of(key.as_bytes())), "{key} → {index}");
            }
        }
        assert!(groups.router(0).is_ok_and(|r| r.route(b"x") == 0));
    }

    #[test]
    fn a_partitioner_splits_by_key_group_forwards_and_broadcasts() {
        let groups = KeyGroups::new(128).unwrap();
        let router = groups.router(3).unwrap();
        let records: Vec<Record> = (0..300)
            .map(|i| Record::new(format!("word-{i}"), ""))
            .collect();
        let split = Partitioner::KeyGroups(router.clone()).split(records.clone(), 3);
        assert_eq!(split.iter().map(Vec::len).sum::<usize>(), 300);
        for (index, bucket) in split.iter().enumerate() {
            assert!(!bucket.is_empty());
            // Each downstream gets its records in the order they came.
            let routed: Vec<Record> = records
                .iter()
                .filter(|r| router.route(&r.key) == index)
                .cloned()
                .collect();
            assert_eq!(bucket, &routed);
        }
        let forwarded = Partitioner::Forward.split(records.clone(), 1);
        assert_eq!(forwarded.concat(), records);
        assert!(Partitioner::Forward.split(records.clone(), 0).is_empty());
        let copies = Partitioner::Broadcast.split(records.clone(), 2);
        assert_eq!(copies, [records.clone(), records]);
    }

    #[test]
    fn ranges_tile_the_key_groups_for_every_parallelism() {
        let groups = KeyGroups::new(128).unwrap();
        for parallelism in 1..=128 {
            let mut next = 0;
            for index in 0..parallelism {
                let range = groups.range_of(parallelism, index).unwrap();
                assert_eq!(range.start, next, "parallelism {parallelism} index {index}");
                assert!(range.len() >= 128 / parallelism && range.len() <= 128 / parallelism + 1);
                next = range.end;
            }
            assert_eq!(next, 128);
        }
        assert!(groups.range_of(0, 0).is_err());
        assert!(groups.range_of(3, 3).is_err());
        assert!(KeyGroups::new(0).is_err());
        assert!(KeyGroups::new(MAX_KEY_GROUPS + 1).is_err());
    }

    #[test]
    fn key_groups_are_stable_and_spread() {
        let groups = KeyGroups::new(128).unwrap();
        // Pinned values: changing the hash breaks every stored checkpoint.
        assert_eq!(groups.of(b"hello"), groups.of(b"hello"));
        let pinned: Vec<u32> = [&b""[..], b"a", b"hello", b"key-42"]
            .iter()
            .map(|k| groups.of(k))
            .collect();
        assert_eq!(pinned, PINNED.to_vec());
        let mut counts = [0_u32; 128];
        for i in 0..128_000_u32 {
            counts[groups.of(&i.to_le_bytes()) as usize] += 1;
        }
        assert!(counts.iter().all(|c| (800..1200).contains(c)), "{counts:?}");
    }

    const PINNED: [u32; 4] = [82, 77, 76, 24];
}
