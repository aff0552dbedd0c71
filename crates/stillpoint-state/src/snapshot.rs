//! Snapshots: export a RocksDB checkpoint with its `SnapshotManifest` (hashing each
//! immutable SST once), verify a snapshot directory against a manifest, restore from
//! one, and restore a rescaled task from several.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use rocksdb::checkpoint::Checkpoint;
use rocksdb::{DB, IngestExternalFileOptions, SstFileWriter};
use stillpoint_wire::{
    BackendInfo, CheckpointId, KeyGroupRange, RelativePath, Sha256Digest, SnapshotFile,
    SnapshotManifest,
};

use crate::changelog::replay_segments;
use crate::rocks::{Compactions, StateOwner, column_family, group_bounds};
use crate::threads::{each_on_threads, threads};
use crate::{KeyGroups, RocksStateBackend, StateConfig, StateError};

/// The manifest a snapshot directory carries for local recovery (not part of its file list).
pub const LOCAL_MANIFEST: &str = "stillpoint-snapshot.json";

const BACKEND: &str = "rocksdb";

/// SHA-256 of immutable SST files, computed once per file and reused by every later
/// snapshot that shares it; and the files of the previous snapshot (for `shared`).
#[derive(Debug, Default)]
pub(crate) struct DigestCache {
    by_name: BTreeMap<String, (u64, Sha256Digest)>,
    previous: BTreeSet<String>,
}

pub(crate) type SharedDigests = Arc<Mutex<DigestCache>>;

fn hash_file(path: &Path) -> Result<Sha256Digest, StateError> {
    let file = File::open(path).map_err(StateError::io("opening", path))?;
    Sha256Digest::of_reader(file).map_err(StateError::io("reading", path))
}

fn is_sst(name: &str) -> bool {
    name.ends_with(".sst") || name.ends_with(".blob")
}

/// The files of `dir` (not recursing: RocksDB checkpoints are flat), sorted.
fn list_files(dir: &Path) -> Result<Vec<(String, u64)>, StateError> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(StateError::io("listing", dir))? {
        let entry = entry.map_err(StateError::io("listing", dir))?;
        let meta = entry
            .metadata()
            .map_err(StateError::io("stat", entry.path()))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if meta.is_file() && name != LOCAL_MANIFEST {
            files.push((name, meta.len()));
        }
    }
    files.sort();
    Ok(files)
}

/// Creates the RocksDB checkpoint of `db` in `dir` (which must not exist). The caller
/// has flushed.
pub(crate) fn create_checkpoint(db: &DB, dir: &Path) -> Result<(), StateError> {
    if let Some(parent) = dir.parent() {
        std::fs::create_dir_all(parent).map_err(StateError::io("creating", parent))?;
    }
    Checkpoint::new(db)
        .and_then(|c| c.create_checkpoint(dir))
        .map_err(StateError::rocks("creating a checkpoint"))
}

/// Who, which key groups and which options a manifest records.
#[derive(Clone, Debug)]
pub(crate) struct ManifestContext {
    pub(crate) owner: StateOwner,
    pub(crate) key_groups: KeyGroups,
    pub(crate) range: KeyGroupRange,
    pub(crate) options: Vec<(String, String)>,
}

/// The files of `dir` with their SHA-256, an SST's computed once and remembered
/// (digests of SSTs no longer in `dir` are forgotten: compacted away).
pub(crate) fn hash_files(
    dir: &Path,
    digests: &SharedDigests,
) -> Result<Vec<(String, u64, Sha256Digest)>, StateError> {
    let listed = list_files(dir)?;
    let mut files = Vec::with_capacity(listed.len());
    for (name, size) in listed {
        let cached = if is_sst(&name) {
            digests
                .lock()
                .ok()
                .and_then(|d| d.by_name.get(&name).copied())
        } else {
            None
        };
        let sha256 = match cached {
            Some((cached_size, digest)) if cached_size == size => digest,
            _ => {
                let digest = hash_file(&dir.join(&name))?;
                if is_sst(&name)
                    && let Ok(mut d) = digests.lock()
                {
                    d.by_name.insert(name.clone(), (size, digest));
                }
                digest
            }
        };
        files.push((name, size, sha256));
    }
    if let Ok(mut d) = digests.lock() {
        d.by_name.retain(|name, _| {
            files
                .binary_search_by(|(n, _, _)| n.as_str().cmp(name))
                .is_ok()
        });
    }
    Ok(files)
}

/// Builds (and writes into `dir`) the manifest of the checkpoint in `dir`.
pub(crate) fn build_manifest(
    dir: &Path,
    checkpoint: CheckpointId,
    context: &ManifestContext,
    digests: &SharedDigests,
) -> Result<SnapshotManifest, StateError> {
    let hashed = hash_files(dir, digests)?;
    let previous = digests
        .lock()
        .map(|d| d.previous.clone())
        .unwrap_or_default();
    let mut files = Vec::with_capacity(hashed.len());
    for (name, size, sha256) in &hashed {
        let path = RelativePath::new(name.as_str()).map_err(|problem| {
            StateError::Incompatible(format!("file name {name:?}: {problem}"))
        })?;
        files.push(SnapshotFile {
            path,
            size: *size,
            sha256: *sha256,
            shared: is_sst(name) && previous.contains(name),
        });
    }
    if let Ok(mut d) = digests.lock() {
        d.previous = hashed
            .iter()
            .map(|(n, _, _)| n.clone())
            .filter(|n| is_sst(n))
            .collect();
    }
    write_manifest(dir, checkpoint, context, files, Vec::new())
}

/// Assembles the manifest of `files` and writes it into `dir` for local recovery.
pub(crate) fn write_manifest(
    dir: &Path,
    checkpoint: CheckpointId,
    context: &ManifestContext,
    files: Vec<SnapshotFile>,
    changelog: Vec<RelativePath>,
) -> Result<SnapshotManifest, StateError> {
    let mut options: BTreeMap<String, String> = context.options.iter().cloned().collect();
    options.insert(
        "key_encoding".into(),
        "group-be16.keylen-be32.key.field".into(),
    );
    let manifest = SnapshotManifest {
        stream: context.owner.stream,
        task: context.owner.task,
        checkpoint,
        max_parallelism: context.key_groups.max_parallelism(),
        key_groups: context.range,
        backend: BackendInfo {
            kind: BACKEND.into(),
            version: format!("rocksdb-crate-{}", env!("CARGO_PKG_VERSION")),
            options,
        },
        files,
        changelog,
    };
    let bytes = manifest.to_bytes()?;
    let local = dir.join(LOCAL_MANIFEST);
    std::fs::write(&local, bytes).map_err(StateError::io("writing", &local))?;
    Ok(manifest)
}

/// Flushes the memtables of every column family of `names` (and `default`) together.
pub(crate) fn flush_all(db: &DB, names: &[String]) -> Result<(), StateError> {
    // Every column family: the cache registered all existing states at start and
    // every one written since, so no need to re-read RocksDB's MANIFEST here.
    let handles: Vec<_> = std::iter::once("default")
        .chain(names.iter().map(String::as_str))
        .filter_map(|n| db.cf_handle(n))
        .collect();
    let refs: Vec<_> = handles.iter().collect();
    let mut options = rocksdb::FlushOptions::default();
    options.set_wait(true);
    db.flush_cfs_opt(&refs, &options)
        .map_err(StateError::rocks("flushing"))
}

/// Checks every file of `manifest` in `dir`: present, same size, same SHA-256; and no
/// file the manifest does not list. Nothing is opened until all of it holds.
pub fn verify_snapshot(dir: &Path, manifest: &SnapshotManifest) -> Result<(), StateError> {
    check_snapshot(dir, manifest, DigestCheck::Hash)
}

/// What a restore checks of a snapshot's directory before it uses any of it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DigestCheck {
    /// The file list, every size and every file's SHA-256 against the manifest
    /// ([`verify_snapshot`]): for a directory of unknown history. The default.
    #[default]
    Hash,
    /// The file list and every size, not the SHA-256: the caller checked every
    /// file's digest against this manifest as it put the file there, just before
    /// (`stillpoint-backup`'s download checks every byte it writes or keeps), and
    /// hashing again would read the whole snapshot a second time. Changelog
    /// segments are still checked against their CRC32C as they are replayed.
    AlreadyHashed,
}

/// [`verify_snapshot`], hashing the files only if `digests` says so.
fn check_snapshot(
    dir: &Path,
    manifest: &SnapshotManifest,
    digests: DigestCheck,
) -> Result<(), StateError> {
    if manifest.backend.kind != BACKEND {
        return Err(StateError::Incompatible(format!(
            "written by backend `{}`",
            manifest.backend.kind
        )));
    }
    let on_disk: BTreeMap<String, u64> = list_files(dir)?.into_iter().collect();
    for file in &manifest.files {
        let name = file.path.as_str();
        let Some(size) = on_disk.get(name) else {
            return Err(StateError::MissingFile {
                dir: dir.to_path_buf(),
                file: name.into(),
            });
        };
        if *size != file.size {
            return Err(StateError::SizeMismatch {
                file: name.into(),
                expected: file.size,
                found: *size,
            });
        }
    }
    let listed: BTreeSet<&str> = manifest.files.iter().map(|f| f.path.as_str()).collect();
    if let Some(extra) = on_disk.keys().find(|name| !listed.contains(name.as_str())) {
        return Err(StateError::UnexpectedFile {
            file: extra.clone(),
        });
    }
    if digests == DigestCheck::AlreadyHashed {
        return Ok(());
    }
    // Hashed on every core, checked in manifest order.
    let hashed = each_on_threads(&manifest.files, threads(), |file| {
        hash_file(&dir.join(file.path.as_str()))
    });
    for (file, found) in manifest.files.iter().zip(hashed) {
        let found = found?;
        if found != file.sha256 {
            return Err(StateError::ChecksumMismatch {
                file: file.path.as_str().into(),
                expected: file.sha256.to_hex(),
                found: found.to_hex(),
            });
        }
    }
    Ok(())
}

/// Hard-links (or copies, across file systems) the database files of a verified
/// snapshot (not its changelog segments) into a fresh database directory: RocksDB
/// never opens the snapshot itself, which stays intact for the next restore.
fn materialize(dir: &Path, manifest: &SnapshotManifest, target: &Path) -> Result<(), StateError> {
    if target.exists() {
        return Err(StateError::Io {
            context: "restoring into",
            path: target.to_path_buf(),
            source: std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                "target directory exists",
            ),
        });
    }
    std::fs::create_dir_all(target).map_err(StateError::io("creating", target))?;
    for file in manifest
        .files
        .iter()
        .filter(|f| !manifest.changelog.contains(&f.path))
    {
        let from = dir.join(file.path.as_str());
        let to = target.join(file.path.as_str());
        if std::fs::hard_link(&from, &to).is_err() {
            std::fs::copy(&from, &to).map_err(StateError::io("copying", &from))?;
        }
    }
    Ok(())
}

fn check_restorable(manifest: &SnapshotManifest, key_groups: KeyGroups) -> Result<(), StateError> {
    if manifest.max_parallelism != key_groups.max_parallelism() {
        return Err(StateError::Incompatible(format!(
            "snapshot has {} key groups, the stream {}",
            manifest.max_parallelism,
            key_groups.max_parallelism()
        )));
    }
    Ok(())
}

impl RocksStateBackend {
    /// Restores a task with the same key groups as the snapshot: verify (every file's
    /// SHA-256 included), link the files into `target`, open, replay the changelog.
    pub fn restore(
        snapshot_dir: &Path,
        manifest: &SnapshotManifest,
        target: impl AsRef<Path>,
        config: StateConfig,
        key_groups: KeyGroups,
        owner: StateOwner,
    ) -> Result<Self, StateError> {
        let (dir, hash) = (snapshot_dir, DigestCheck::Hash);
        Self::restore_checked(dir, manifest, hash, target, config, key_groups, owner)
    }

    /// [`restore`](Self::restore), checking the snapshot's files as `digests` says.
    pub fn restore_checked(
        snapshot_dir: &Path,
        manifest: &SnapshotManifest,
        digests: DigestCheck,
        target: impl AsRef<Path>,
        config: StateConfig,
        key_groups: KeyGroups,
        owner: StateOwner,
    ) -> Result<Self, StateError> {
        check_restorable(manifest, key_groups)?;
        check_snapshot(snapshot_dir, manifest, digests)?;
        materialize(snapshot_dir, manifest, target.as_ref())?;
        let backend = Self::open_with(
            target,
            config,
            key_groups,
            manifest.key_groups,
            owner,
            Compactions::Held,
        )?;
        backend.replay(snapshot_dir, manifest, manifest.key_groups)?;
        backend.resume_compactions()?;
        Ok(backend)
    }

    /// Replays the changelog segments of the snapshot in `dir`, oldest first, keeping
    /// the key groups `keep`.
    fn replay(
        &self,
        dir: &Path,
        manifest: &SnapshotManifest,
        keep: KeyGroupRange,
    ) -> Result<(), StateError> {
        if manifest.changelog.is_empty() {
            return Ok(());
        }
        let paths: Vec<PathBuf> = manifest
            .changelog
            .iter()
            .map(|segment| dir.join(segment.as_str()))
            .collect();
        let entries = replay_segments(
            &self.db,
            &self.options,
            self.config.compression,
            &paths,
            keep,
        )?;
        tracing::debug!(
            segments = manifest.changelog.len(),
            entries,
            "changelog replayed"
        );
        Ok(())
    }

    /// Restores a task owning `range` from the snapshots of the old tasks (any
    /// parallelism): the snapshot overlapping `range` most becomes the base database
    /// (linked, then clipped with range deletes); the others' overlapping key groups
    /// are written into SST files and ingested. Every snapshot is verified first.
    pub fn restore_rescaled(
        snapshots: &[(PathBuf, SnapshotManifest)],
        target: impl AsRef<Path>,
        config: StateConfig,
        key_groups: KeyGroups,
        range: KeyGroupRange,
        owner: StateOwner,
    ) -> Result<Self, StateError> {
        let hash = DigestCheck::Hash;
        Self::restore_rescaled_checked(snapshots, hash, target, config, key_groups, range, owner)
    }

    /// [`restore_rescaled`](Self::restore_rescaled), checking the snapshots' files as
    /// `digests` says.
    pub fn restore_rescaled_checked(
        snapshots: &[(PathBuf, SnapshotManifest)],
        digests: DigestCheck,
        target: impl AsRef<Path>,
        config: StateConfig,
        key_groups: KeyGroups,
        range: KeyGroupRange,
        owner: StateOwner,
    ) -> Result<Self, StateError> {
        key_groups.check(range)?;
        for (dir, manifest) in snapshots {
            check_restorable(manifest, key_groups)?;
            check_snapshot(dir, manifest, digests)?;
        }
        let overlap =
            |m: &SnapshotManifest| m.key_groups.intersection(&range).map_or(0, |r| r.len());
        let target = target.as_ref();
        let base = snapshots
            .iter()
            .filter(|(_, m)| overlap(m) > 0)
            .max_by_key(|(_, m)| overlap(m));
        let backend = match base {
            Some((dir, manifest)) => {
                materialize(dir, manifest, target)?;
                let backend = Self::open_with(
                    target,
                    config.clone(),
                    key_groups,
                    range,
                    owner,
                    Compactions::Held,
                )?;
                backend.clip_to(range)?;
                backend.replay(dir, manifest, range)?;
                backend
            }
            None => Self::open_with(
                target,
                config.clone(),
                key_groups,
                range,
                owner,
                Compactions::Held,
            )?,
        };
        let scratch = target.with_extension("rescale-tmp");
        for (index, (dir, manifest)) in snapshots.iter().enumerate() {
            let is_base = base.is_some_and(|(base_dir, _)| base_dir == dir);
            let Some(part) = manifest.key_groups.intersection(&range) else {
                continue;
            };
            if is_base {
                continue;
            }
            let source_dir = scratch.join(format!("source-{index}"));
            materialize(dir, manifest, &source_dir)?;
            let result =
                backend.ingest_from(&source_dir, part, &scratch.join(format!("sst-{index}")));
            let _ = std::fs::remove_dir_all(&source_dir);
            result?;
            backend.replay(dir, manifest, part)?;
        }
        let _ = std::fs::remove_dir_all(&scratch);
        backend.resume_compactions()?;
        Ok(backend)
    }

    /// Deletes every key outside `range`, in every state, with range deletes.
    fn clip_to(&self, range: KeyGroupRange) -> Result<(), StateError> {
        let (lower, upper) = group_bounds(range);
        for state in self.states() {
            let Some(cf) = self.db.cf_handle(&state) else {
                continue;
            };
            self.db
                .delete_range_cf(&cf, [0_u8, 0].as_slice(), lower.as_slice())
                .map_err(StateError::rocks("range delete"))?;
            self.db
                .delete_range_cf(&cf, upper.as_slice(), [0xff_u8, 0xff, 0xff].as_slice())
                .map_err(StateError::rocks("range delete"))?;
        }
        Ok(())
    }

    /// Copies key groups `part` of the database in `source_dir` into this one through
    /// SST files and ingestion.
    fn ingest_from(
        &self,
        source_dir: &Path,
        part: KeyGroupRange,
        sst_dir: &Path,
    ) -> Result<(), StateError> {
        let options = self.options.clone();
        let families = DB::list_cf(&options, source_dir)
            .map_err(StateError::rocks("listing column families"))?;
        let source = DB::open_cf_with_opts_for_read_only(
            &options,
            source_dir,
            families.iter().map(|name| (name, options.clone())),
            false,
        )
        .map_err(StateError::rocks("opening a snapshot to rescale"))?;
        std::fs::create_dir_all(sst_dir).map_err(StateError::io("creating", sst_dir))?;
        let (lower, upper) = group_bounds(part);
        for state in families.iter().filter(|f| f.as_str() != "default") {
            let Some(cf) = source.cf_handle(state) else {
                continue;
            };
            let sst = sst_dir.join(format!("{state}.sst"));
            let mut writer = SstFileWriter::create(&options);
            writer
                .open(&sst)
                .map_err(StateError::rocks("opening an SST writer"))?;
            let mut written = 0_u64;
            let mut read = rocksdb::ReadOptions::default();
            read.set_iterate_lower_bound(lower.clone());
            read.set_iterate_upper_bound(upper.clone());
            for item in source.iterator_cf_opt(&cf, read, rocksdb::IteratorMode::Start) {
                let (key, value) = item.map_err(StateError::rocks("scanning a snapshot"))?;
                writer
                    .put(&key, &value)
                    .map_err(StateError::rocks("writing an SST"))?;
                written += 1;
            }
            if written == 0 {
                continue;
            }
            writer
                .finish()
                .map_err(StateError::rocks("finishing an SST"))?;
            let target_cf = column_family(&self.db, &self.options, state)?;
            let mut ingest = IngestExternalFileOptions::default();
            ingest.set_move_files(true);
            self.db
                .ingest_external_file_cf_opts(&target_cf, &ingest, vec![sst])
                .map_err(StateError::rocks("ingesting an SST"))?;
        }
        let _ = std::fs::remove_dir_all(sst_dir);
        Ok(())
    }
}
