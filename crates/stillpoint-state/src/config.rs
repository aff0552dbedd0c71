//! `StateConfig`: RocksDB and cache tuning for streaming state, with documented
//! defaults.

use rocksdb::{BlockBasedIndexType, BlockBasedOptions, Cache, DBCompressionType, Options};

/// Block compression.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compression {
    /// None: fastest, largest.
    None,
    /// LZ4: fast, moderate ratio (the default for all but the last level).
    Lz4,
    /// Zstandard: slower, best ratio (the default for the bottommost level).
    Zstd,
}

impl Compression {
    pub(crate) fn rocks(self) -> DBCompressionType {
        match self {
            Self::None => DBCompressionType::None,
            Self::Lz4 => DBCompressionType::Lz4,
            Self::Zstd => DBCompressionType::Zstd,
        }
    }

    pub(crate) const fn name(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Lz4 => "lz4",
            Self::Zstd => "zstd",
        }
    }
}

/// The memtable bloom filter's size as a fraction of `write_buffer_bytes`: 5 % is
/// ≈ 12 bits per entry for entries of ≈ 30 bytes (a count keyed by a word), fewer
/// false positives for larger ones.
const MEMTABLE_BLOOM_RATIO: f64 = 0.05;

/// How a task's state is stored.
///
/// The write-ahead log is always off: state is durable only through checkpoints
/// (DESIGN §4), and after a crash a task restores from its last complete checkpoint,
/// never from its live database, so a WAL would double every write for nothing. Writes
/// between checkpoints live in the write-back cache (and memtables, when it spills),
/// and each snapshot ingests its changes as SSTs and flushes what a spill left before
/// it creates the RocksDB checkpoint — or, with [`StateConfig::changelog`], writes them
/// as a changelog segment and into the memtable, materializing in the background.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StateConfig {
    /// Compression of levels 0..n-1. Default LZ4.
    pub compression: Compression,
    /// Compression of the bottommost level, where most data settles. Default Zstd.
    pub bottommost_compression: Compression,
    /// Shared block cache per database, bytes. Default 256 MiB.
    pub block_cache_bytes: usize,
    /// Memtable size per column family, bytes. Default 64 MiB.
    pub write_buffer_bytes: usize,
    /// Bloom filter bits per key (0 disables). Default 10 (~1% false positives), which
    /// makes a get of an absent key (a new key in a keyed aggregation) skip most SSTs.
    pub bloom_bits_per_key: u32,
    /// RocksDB background flush and compaction threads. Default 2.
    pub background_jobs: i32,
    /// Memory the write-back cache may hold (dirty, frozen and clean entries), bytes.
    /// Over it, clean entries are evicted, then dirty ones spill to RocksDB. Default
    /// 256 MiB.
    pub cache_budget_bytes: usize,
    /// Changelog checkpoints (the default): a snapshot is the last materialization
    /// plus the changes since, written as segments, instead of a RocksDB checkpoint
    /// with an SST of its changes. `None`: every snapshot is a RocksDB checkpoint.
    pub changelog: Option<crate::ChangelogConfig>,
}

impl Default for StateConfig {
    fn default() -> Self {
        Self {
            compression: Compression::Lz4,
            bottommost_compression: Compression::Zstd,
            block_cache_bytes: 256 << 20,
            write_buffer_bytes: 64 << 20,
            bloom_bits_per_key: 10,
            background_jobs: 2,
            cache_budget_bytes: 256 << 20,
            changelog: Some(crate::ChangelogConfig::default()),
        }
    }
}

impl StateConfig {
    /// RocksDB options for a database and its column families, all sharing one block
    /// cache of `block_cache_bytes`. Build once per database.
    pub(crate) fn rocks_options(&self) -> Options {
        let mut options = Options::default();
        options.create_if_missing(true);
        options.create_missing_column_families(true);
        options.set_compression_type(self.compression.rocks());
        options.set_bottommost_compression_type(self.bottommost_compression.rocks());
        options.set_write_buffer_size(self.write_buffer_bytes);
        options.set_max_background_jobs(self.background_jobs);
        // Flush every column family at the same sequence number: a checkpoint is one
        // consistent cut across all operator states.
        options.set_atomic_flush(true);
        // A whole-key bloom filter on every memtable. Most reads that reach RocksDB are
        // of keys the write-back cache does not hold, and most of those are not in the
        // memtable either (a new key, a key last changed long ago); without the filter
        // each such read searched the memtable's skip list first, a cache miss per
        // level: 65 % of a counter's CPU on a restored state (engine bench, P2).
        options.set_memtable_prefix_bloom_ratio(MEMTABLE_BLOOM_RATIO);
        options.set_memtable_whole_key_filtering(true);
        let mut table = BlockBasedOptions::default();
        table.set_block_cache(&Cache::new_lru_cache(self.block_cache_bytes));
        if self.bloom_bits_per_key > 0 {
            table.set_bloom_filter(f64::from(self.bloom_bits_per_key), false);
        }
        // Index and filters live in the block cache, so their memory is bounded, and
        // are partitioned into 4 KiB blocks under a pinned top level. A whole-file
        // filter of a large SST (megabytes) is bigger than one cache shard holds: it
        // was evicted as soon as it was used, so every point read of a key absent from
        // memory read the whole filter block from the file and checksummed it (92 % of
        // the engine's CPU once the state reached hundreds of MiB).
        table.set_cache_index_and_filter_blocks(true);
        table.set_cache_index_and_filter_blocks_with_high_priority(true);
        table.set_index_type(BlockBasedIndexType::TwoLevelIndexSearch);
        table.set_partition_filters(true);
        table.set_metadata_block_size(4096);
        table.set_pin_top_level_index_and_filter(true);
        table.set_pin_l0_filter_and_index_blocks_in_cache(true);
        options.set_block_based_table_factory(&table);
        options
    }

    /// Recorded in snapshot manifests.
    pub(crate) fn describe(&self) -> Vec<(String, String)> {
        vec![
            ("compression".into(), self.compression.name().into()),
            (
                "bottommost_compression".into(),
                self.bottommost_compression.name().into(),
            ),
            ("wal".into(), "disabled".into()),
            (
                "snapshots".into(),
                if self.changelog.is_some() {
                    "changelog"
                } else {
                    "rocksdb-checkpoint"
                }
                .into(),
            ),
        ]
    }
}
