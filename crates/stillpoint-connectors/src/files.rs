//! Replayable sources over local files: a line-oriented file (bounded) and an
//! append-only log directory of segment files (unbounded: it waits for more).
//!
//! Both emit one record per word of each complete line (a line's words share its
//! offset: the source only ever stops between lines), keyed by the word, and report
//! as offset the position just after the last line they returned.

use std::fs::File;
use std::io::{BufRead, BufReader, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use bytes::Bytes;
use stillpoint_wire::SourceOffset;

use stillpoint::{EngineError, Record, Source, SourcePoll};

/// Longest line a file source accepts (a longer one is an error naming the file and
/// offset, never an unbounded allocation).
pub const MAX_LINE_BYTES: usize = 1 << 20;

/// Reads whole lines from `reader`, appending each line's words to `out`, until `max`
/// records were appended, `limit` bytes were consumed or no complete line is left.
/// Returns the bytes consumed and whether it stopped at the end of the input. A final
/// line without a newline counts only when `take_unterminated` (the input will not
/// grow). A limit is a line boundary the source reported; a line across it means the
/// input changed since, an error.
fn read_lines(
    reader: &mut impl BufRead,
    path: &Path,
    start: u64,
    (max, limit): (usize, u64),
    take_unterminated: bool,
    out: &mut Vec<Record>,
) -> Result<(u64, bool), EngineError> {
    let mut consumed = 0u64;
    let mut line = Vec::new();
    let before = out.len();
    while out.len() - before < max && consumed < limit {
        line.clear();
        let allowed = (MAX_LINE_BYTES as u64 + 1).min(limit - consumed);
        let read = std::io::Read::take(&mut *reader, allowed)
            .read_until(b'\n', &mut line)
            .map_err(|e| EngineError::io("read", path, &e))?;
        if read == 0 {
            return Ok((consumed, true));
        }
        let terminated = line.last() == Some(&b'\n');
        if !terminated
            && read as u64 == limit - consumed
            && !(take_unterminated
                && reader
                    .fill_buf()
                    .map_err(|e| EngineError::io("read", path, &e))?
                    .is_empty())
        {
            return Err(EngineError::Invalid(format!(
                "{}: the line at byte {} runs past the recorded offset {}: the input changed after its output was published",
                path.display(),
                start + consumed,
                start + limit
            )));
        }
        if !terminated {
            if line.len() > MAX_LINE_BYTES {
                return Err(EngineError::Invalid(format!(
                    "{}: the line at byte {} is longer than {MAX_LINE_BYTES} bytes",
                    path.display(),
                    start + consumed
                )));
            }
            if !take_unterminated {
                // A line still being written: leave it for a later poll.
                return Ok((consumed, true));
            }
        }
        consumed += read as u64;
        let text = String::from_utf8_lossy(&line);
        for word in text.split_whitespace() {
            out.push(Record::new(word.to_owned(), Bytes::new()));
        }
    }
    Ok((consumed, false))
}

fn open_at(path: &Path, position: u64) -> Result<BufReader<File>, EngineError> {
    let mut file = File::open(path).map_err(|e| EngineError::io("open", path, &e))?;
    file.seek(SeekFrom::Start(position))
        .map_err(|e| EngineError::io("seek", path, &e))?;
    Ok(BufReader::with_capacity(64 * 1024, file))
}

/// A bounded source over one text file: the offset is a byte position at the start of
/// a line; it finishes at the end of the file.
#[derive(Debug)]
pub struct FileLines {
    path: PathBuf,
    position: u64,
    reader: Option<BufReader<File>>,
}

impl FileLines {
    /// A source reading `path` from its beginning.
    #[must_use]
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            position: 0,
            reader: None,
        }
    }
}

impl Source for FileLines {
    fn seek(&mut self, offset: Option<&SourceOffset>) -> Result<(), EngineError> {
        let position = match offset {
            None => 0,
            Some(offset) => offset.as_u64().ok_or_else(|| {
                EngineError::Invalid(format!(
                    "{}: a file source's offset is a byte position",
                    self.path.display()
                ))
            })?,
        };
        let length = std::fs::metadata(&self.path)
            .map_err(|e| EngineError::io("stat", &self.path, &e))?
            .len();
        if position > length {
            return Err(EngineError::Invalid(format!(
                "{}: offset {position} is past the end of the file ({length} bytes): it was changed after the checkpoint",
                self.path.display()
            )));
        }
        self.position = position;
        self.reader = None;
        Ok(())
    }

    fn poll(&mut self, max: usize, out: &mut Vec<Record>) -> Result<SourcePoll, EngineError> {
        self.read(max, u64::MAX, out)
    }

    fn offset(&self) -> SourceOffset {
        SourceOffset::from_u64(self.position)
    }

    fn stops_at_offsets(&self) -> bool {
        true
    }

    fn poll_until(
        &mut self,
        max: usize,
        bound: &SourceOffset,
        out: &mut Vec<Record>,
    ) -> Result<SourcePoll, EngineError> {
        let bound = crate::generated::position_of(bound, "a file source")?;
        match bound.checked_sub(self.position) {
            Some(0) => Ok(SourcePoll::Idle),
            Some(limit) => self.read(max, limit, out),
            None => Err(EngineError::Invalid(format!(
                "{}: already past the recorded offset {bound}",
                self.path.display()
            ))),
        }
    }
}

impl FileLines {
    /// Reads at most `max` records and `limit` bytes.
    fn read(
        &mut self,
        max: usize,
        limit: u64,
        out: &mut Vec<Record>,
    ) -> Result<SourcePoll, EngineError> {
        let reader = match &mut self.reader {
            Some(reader) => reader,
            None => self.reader.insert(open_at(&self.path, self.position)?),
        };
        let before = out.len();
        let (consumed, at_end) =
            read_lines(reader, &self.path, self.position, (max, limit), true, out)?;
        self.position += consumed;
        if out.len() > before {
            Ok(SourcePoll::Records)
        } else if at_end {
            Ok(SourcePoll::Finished)
        } else {
            // Empty lines only: progress was made, poll again.
            Ok(SourcePoll::Idle)
        }
    }
}

/// An unbounded source over an append-only log directory: segment files (any names,
/// read in name order; only `*.log`) that writers append lines to and roll over by
/// starting a segment with a greater name. The offset is the segment's name and a
/// byte position in it. A line is taken only once its newline is written.
#[derive(Debug)]
pub struct LogDir {
    dir: PathBuf,
    segment: Option<String>,
    position: u64,
    reader: Option<BufReader<File>>,
}

impl LogDir {
    /// A source reading `dir` from its first segment.
    #[must_use]
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            segment: None,
            position: 0,
            reader: None,
        }
    }

    fn segments(&self) -> Result<Vec<String>, EngineError> {
        let entries = match std::fs::read_dir(&self.dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(EngineError::io("list", &self.dir, &e)),
        };
        let mut names = Vec::new();
        for entry in entries {
            let entry = entry.map_err(|e| EngineError::io("list", &self.dir, &e))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.ends_with(".log") {
                names.push(name);
            }
        }
        names.sort();
        Ok(names)
    }

    /// The segment after the current one, if a writer has started it.
    fn next_segment(&self) -> Result<Option<String>, EngineError> {
        Ok(self
            .segments()?
            .into_iter()
            .find(|name| self.segment.as_ref().is_none_or(|current| name > current)))
    }
}

impl LogDir {
    /// The segment name (empty: before the first) and position of a log offset.
    fn parse_offset(&self, offset: &SourceOffset) -> Result<(String, u64), EngineError> {
        let bytes = offset.as_bytes();
        let invalid = || {
            EngineError::Invalid(format!(
                "{}: not a log offset (segment name and position)",
                self.dir.display()
            ))
        };
        let split = bytes.len().checked_sub(8).ok_or_else(invalid)?;
        let (name, position) = bytes.split_at(split);
        let name = std::str::from_utf8(name).map_err(|_| invalid())?.to_owned();
        let position = u64::from_be_bytes(position.try_into().map_err(|_| invalid())?);
        Ok((name, position))
    }

    /// Reads at most `max` records, and at most `limit` bytes of the current segment.
    fn read(
        &mut self,
        max: usize,
        limit: u64,
        out: &mut Vec<Record>,
    ) -> Result<SourcePoll, EngineError> {
        if self.segment.is_none() {
            match self.next_segment()? {
                Some(first) => self.segment = Some(first),
                None => return Ok(SourcePoll::Idle),
            }
        }
        let Some(segment) = self.segment.clone() else {
            return Ok(SourcePoll::Idle);
        };
        let path = self.dir.join(&segment);
        let reader = match &mut self.reader {
            Some(reader) => reader,
            None => self.reader.insert(open_at(&path, self.position)?),
        };
        let before = out.len();
        let (consumed, at_end) =
            read_lines(reader, &path, self.position, (max, limit), false, out)?;
        self.position += consumed;
        if out.len() > before {
            return Ok(SourcePoll::Records);
        }
        if at_end {
            // Drop the reader so appended bytes are seen; roll over once a newer
            // segment exists and this one has no partial line left.
            self.reader = None;
            let length = std::fs::metadata(&path)
                .map_err(|e| EngineError::io("stat", &path, &e))?
                .len();
            if length == self.position
                && let Some(next) = self.next_segment()?
            {
                self.segment = Some(next);
                self.position = 0;
            }
        }
        Ok(SourcePoll::Idle)
    }
}

impl Source for LogDir {
    fn seek(&mut self, offset: Option<&SourceOffset>) -> Result<(), EngineError> {
        self.reader = None;
        let Some(offset) = offset else {
            self.segment = None;
            self.position = 0;
            return Ok(());
        };
        let (name, position) = self.parse_offset(offset)?;
        if !name.is_empty() {
            let path = self.dir.join(&name);
            let length = std::fs::metadata(&path)
                .map_err(|e| EngineError::io("stat", &path, &e))?
                .len();
            if position > length {
                return Err(EngineError::Invalid(format!(
                    "{}: offset {position} is past the end of the segment ({length} bytes): logs are append-only",
                    path.display()
                )));
            }
        }
        self.segment = (!name.is_empty()).then_some(name);
        self.position = position;
        Ok(())
    }

    fn poll(&mut self, max: usize, out: &mut Vec<Record>) -> Result<SourcePoll, EngineError> {
        self.read(max, u64::MAX, out)
    }

    fn offset(&self) -> SourceOffset {
        let mut bytes = self.segment.clone().unwrap_or_default().into_bytes();
        bytes.extend_from_slice(&self.position.to_be_bytes());
        // Segment names come from the directory listing; one longer than an offset may
        // be falls back to the start of the log, which only replays (never loses).
        SourceOffset::new(bytes).unwrap_or_else(|_| SourceOffset::from_u64(0))
    }

    fn stops_at_offsets(&self) -> bool {
        true
    }

    fn poll_until(
        &mut self,
        max: usize,
        bound: &SourceOffset,
        out: &mut Vec<Record>,
    ) -> Result<SourcePoll, EngineError> {
        let (segment, position) = self.parse_offset(bound)?;
        if self.segment.is_none() && !segment.is_empty() {
            // Not started: the first segment may be the bound's own.
            match self.next_segment()? {
                Some(first) => self.segment = Some(first),
                None => return Ok(SourcePoll::Idle),
            }
        }
        let current = self.segment.as_deref().unwrap_or_default();
        let past = || {
            EngineError::Invalid(format!(
                "{}: already past the recorded offset ({segment:?} at byte {position})",
                self.dir.display()
            ))
        };
        match current.cmp(segment.as_str()) {
            // Segments before the bound's are read whole (a roll-over reaches at most
            // the bound's segment, the next one by name).
            std::cmp::Ordering::Less => self.read(max, u64::MAX, out),
            std::cmp::Ordering::Equal => match position.checked_sub(self.position) {
                Some(0) => Ok(SourcePoll::Idle),
                Some(limit) => self.read(max, limit, out),
                None => Err(past()),
            },
            std::cmp::Ordering::Greater => Err(past()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(out: &[Record]) -> Vec<String> {
        out.iter()
            .map(|r| String::from_utf8_lossy(&r.key).into_owned())
            .collect()
    }

    #[test]
    fn a_file_source_resumes_between_lines_and_finishes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("in.txt");
        std::fs::write(&path, "a b\n\nc\nd e f\ng").unwrap();
        let mut source = FileLines::new(&path);
        source.seek(None).unwrap();
        let mut out = Vec::new();
        assert_eq!(source.poll(2, &mut out).unwrap(), SourcePoll::Records);
        assert_eq!(words(&out), ["a", "b"]);
        let offset = source.offset();
        let mut rest = Vec::new();
        while source.poll(2, &mut rest).unwrap() != SourcePoll::Finished {}
        assert_eq!(words(&rest), ["c", "d", "e", "f", "g"]);
        // Replay from the recorded offset gives the same records.
        let mut again = FileLines::new(&path);
        again.seek(Some(&offset)).unwrap();
        let mut replay = Vec::new();
        while again.poll(100, &mut replay).unwrap() != SourcePoll::Finished {}
        assert_eq!(words(&replay), words(&rest));
    }

    #[test]
    fn a_file_source_rejects_offsets_past_the_end_and_overlong_lines() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("in.txt");
        std::fs::write(&path, "a\n").unwrap();
        let mut source = FileLines::new(&path);
        let error = source.seek(Some(&SourceOffset::from_u64(99))).unwrap_err();
        assert!(error.to_string().contains("past the end"), "{error}");
        std::fs::write(&path, vec![b'x'; MAX_LINE_BYTES + 10]).unwrap();
        let mut source = FileLines::new(&path);
        source.seek(None).unwrap();
        let error = source.poll(10, &mut Vec::new()).unwrap_err();
        assert!(error.to_string().contains("longer than"), "{error}");
    }

    #[test]
    fn a_log_source_waits_for_whole_lines_and_rolls_over_segments() {
        use std::io::Write;
        let dir = tempfile::tempdir().unwrap();
        let mut source = LogDir::new(dir.path());
        source.seek(None).unwrap();
        let mut out = Vec::new();
        assert_eq!(source.poll(10, &mut out).unwrap(), SourcePoll::Idle);
        let first = dir.path().join("0001.log");
        let mut writer = std::fs::File::create(&first).unwrap();
        writer.write_all(b"a b\nc").unwrap();
        assert_eq!(source.poll(10, &mut out).unwrap(), SourcePoll::Records);
        assert_eq!(words(&out), ["a", "b"]);
        // `c` has no newline yet: not taken.
        assert_eq!(source.poll(10, &mut out).unwrap(), SourcePoll::Idle);
        let offset = source.offset();
        writer.write_all(b"\n").unwrap();
        std::fs::write(dir.path().join("0002.log"), "d\n").unwrap();
        let mut rest = Vec::new();
        for _ in 0..6 {
            source.poll(10, &mut rest).unwrap();
        }
        assert_eq!(words(&rest), ["c", "d"]);
        let mut again = LogDir::new(dir.path());
        again.seek(Some(&offset)).unwrap();
        let mut replay = Vec::new();
        for _ in 0..6 {
            again.poll(10, &mut replay).unwrap();
        }
        assert_eq!(words(&replay), ["c", "d"]);
        // A truncated segment is refused, never silently skipped.
        std::fs::write(&first, "").unwrap();
        let error = LogDir::new(dir.path()).seek(Some(&offset)).unwrap_err();
        assert!(error.to_string().contains("append-only"), "{error}");
    }

    /// Polls `source` up to `bound` (at most `max` records a poll) until its offset is
    /// the bound; the records read.
    fn replay_to(source: &mut dyn Source, bound: &SourceOffset, max: usize) -> Vec<String> {
        let mut out = Vec::new();
        for _ in 0..1000 {
            if source.offset() == *bound {
                return words(&out);
            }
            source.poll_until(max, bound, &mut out).unwrap();
        }
        panic!("never reached {bound:?}: {:?}", words(&out));
    }

    #[test]
    fn a_file_source_stops_exactly_at_a_recorded_offset() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("in.txt");
        std::fs::write(&path, "a b\n\nc\nd e f\ng h").unwrap();
        let mut source = FileLines::new(&path);
        assert!(source.stops_at_offsets());
        // Offsets reported along a first read, and the records before each.
        let mut seen = Vec::new();
        let mut points = vec![(source.offset(), Vec::new())];
        while source.poll(1, &mut seen).unwrap() != SourcePoll::Finished {
            points.push((source.offset(), words(&seen)));
        }
        for (bound, before) in &points {
            for max in [1, 2, 100] {
                let mut again = FileLines::new(&path);
                again.seek(None).unwrap();
                assert_eq!(
                    replay_to(&mut again, bound, max),
                    *before,
                    "{bound:?} by {max}"
                );
                // Once there it reads nothing more.
                let mut more = Vec::new();
                again.poll_until(max, bound, &mut more).unwrap();
                assert!(more.is_empty(), "{bound:?}");
            }
        }
        // An input rewritten since: a line now runs across the recorded offset.
        let bound = points[1].0.clone();
        std::fs::write(&path, "ab c\n").unwrap();
        let mut changed = FileLines::new(&path);
        changed.seek(None).unwrap();
        let error = changed.poll_until(10, &bound, &mut Vec::new()).unwrap_err();
        assert!(
            error.to_string().contains("runs past the recorded offset"),
            "{error}"
        );
    }

    #[test]
    fn a_log_source_stops_exactly_at_a_recorded_offset_in_a_later_segment() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("0001.log"), "a b\nc\n").unwrap();
        std::fs::write(dir.path().join("0002.log"), "d\ne f\n").unwrap();
        std::fs::write(dir.path().join("0003.log"), "g\n").unwrap();
        let mut source = LogDir::new(dir.path());
        source.seek(None).unwrap();
        assert!(source.stops_at_offsets());
        let mut seen = Vec::new();
        let mut points = vec![(source.offset(), Vec::new())];
        for _ in 0..30 {
            if source.poll(1, &mut seen).unwrap() == SourcePoll::Records {
                points.push((source.offset(), words(&seen)));
            }
        }
        assert_eq!(words(&seen), ["a", "b", "c", "d", "e", "f", "g"]);
        for (bound, before) in &points {
            for max in [1, 3] {
                let mut again = LogDir::new(dir.path());
                again.seek(None).unwrap();
                assert_eq!(
                    replay_to(&mut again, bound, max),
                    *before,
                    "{bound:?} by {max}"
                );
            }
        }
        // Already past the bound (restored beyond it): refused, never read on.
        let mut ahead = LogDir::new(dir.path());
        ahead.seek(Some(&points[5].0)).unwrap();
        let error = ahead
            .poll_until(10, &points[2].0, &mut Vec::new())
            .unwrap_err();
        assert!(error.to_string().contains("already past"), "{error}");
    }
}
