//! `RelativePath`: a file path inside a snapshot or store that cannot escape it.

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A `/`-separated path relative to a snapshot directory or a job's store root.
///
/// Constructed only through [`RelativePath::new`], which refuses anything that could
/// name a file outside its root: absolute paths, `..`, drive prefixes, backslashes and
/// NUL bytes. A manifest holding such a path fails to parse, so no code that writes
/// files ever sees one.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RelativePath(String);

/// Why a string is not an acceptable [`RelativePath`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PathProblem {
    /// The path is empty.
    #[error("path is empty")]
    Empty,
    /// Longer than [`RelativePath::MAX_LEN`] bytes.
    #[error("path is longer than {max} bytes", max = RelativePath::MAX_LEN)]
    TooLong,
    /// Starts with `/`.
    #[error("path is absolute")]
    Absolute,
    /// Starts with a Windows drive or UNC prefix such as `C:`.
    #[error("path has a drive prefix")]
    DrivePrefix,
    /// Contains a `..` component.
    #[error("path contains a `..` component")]
    ParentComponent,
    /// Contains an empty or `.` component (`a//b`, `a/./b`, a trailing `/`).
    #[error("path contains an empty or `.` component")]
    EmptyComponent,
    /// Contains a backslash, which some platforms read as a separator.
    #[error("path contains a backslash")]
    Backslash,
    /// Contains a NUL byte or another control character.
    #[error("path contains a control character")]
    ControlCharacter,
}

impl RelativePath {
    /// The longest path accepted, in bytes.
    pub const MAX_LEN: usize = 1024;

    /// Validates `path`.
    pub fn new(path: impl Into<String>) -> Result<Self, PathProblem> {
        let path = path.into();
        Self::check(&path)?;
        Ok(Self(path))
    }

    fn check(path: &str) -> Result<(), PathProblem> {
        if path.is_empty() {
            return Err(PathProblem::Empty);
        }
        if path.len() > Self::MAX_LEN {
            return Err(PathProblem::TooLong);
        }
        if path.starts_with('/') {
            return Err(PathProblem::Absolute);
        }
        let bytes = path.as_bytes();
        if bytes.get(1) == Some(&b':') && bytes.first().is_some_and(u8::is_ascii_alphabetic) {
            return Err(PathProblem::DrivePrefix);
        }
        if path.contains('\\') {
            return Err(PathProblem::Backslash);
        }
        if path.chars().any(char::is_control) {
            return Err(PathProblem::ControlCharacter);
        }
        for component in path.split('/') {
            match component {
                ".." => return Err(PathProblem::ParentComponent),
                "" | "." => return Err(PathProblem::EmptyComponent),
                _ => {}
            }
        }
        Ok(())
    }

    /// The path as a string, `/`-separated.
    #[must_use]
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The last component.
    #[must_use]
    pub fn file_name(&self) -> &str {
        self.0.rsplit('/').next().unwrap_or(&self.0)
    }

    /// `self/child`, if the result is still a valid relative path.
    pub fn join(&self, child: &str) -> Result<Self, PathProblem> {
        Self::new(format!("{}/{child}", self.0))
    }
}

impl fmt::Display for RelativePath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for RelativePath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl std::str::FromStr for RelativePath {
    type Err = PathProblem;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        Self::new(text)
    }
}

impl AsRef<str> for RelativePath {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl Serialize for RelativePath {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for RelativePath {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        Self::new(text).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(input: &str, expected: Result<(), PathProblem>) {
        assert_eq!(
            RelativePath::new(input).map(|_| ()),
            expected,
            "input {input:?}"
        );
    }

    #[test]
    fn accepts_plain_relative_paths() {
        check("000123.sst", Ok(()));
        check("shared/ab/abcdef.sst", Ok(()));
        check("..hidden", Ok(()));
        check("a..b/c", Ok(()));
    }

    #[test]
    fn refuses_paths_that_escape_or_are_ambiguous() {
        check("", Err(PathProblem::Empty));
        check("/etc/passwd", Err(PathProblem::Absolute));
        check("..", Err(PathProblem::ParentComponent));
        check("a/../../b", Err(PathProblem::ParentComponent));
        check("a/..", Err(PathProblem::ParentComponent));
        check("C:/x", Err(PathProblem::DrivePrefix));
        check("a\\..\\b", Err(PathProblem::Backslash));
        check("a//b", Err(PathProblem::EmptyComponent));
        check("./a", Err(PathProblem::EmptyComponent));
        check("a/", Err(PathProblem::EmptyComponent));
        check("a\0b", Err(PathProblem::ControlCharacter));
        check(
            &"x".repeat(RelativePath::MAX_LEN + 1),
            Err(PathProblem::TooLong),
        );
    }

    #[test]
    fn join_and_file_name() {
        let dir = RelativePath::new("tasks/task-1").unwrap();
        assert_eq!(dir.file_name(), "task-1");
        assert_eq!(
            dir.join("MANIFEST").map(|p| p.to_string()),
            Ok("tasks/task-1/MANIFEST".into())
        );
        assert_eq!(dir.join("../x"), Err(PathProblem::ParentComponent));
    }
}
