//! `cargo xtask release [--dry-run] VERSION`: bump every crate's version together,
//! write the changelog section from the commits since the last tag, then package and
//! `cargo publish --workspace --dry-run` (cargo orders the crates by dependency).
//!
//! `--dry-run` does all of it in a scratch copy of the workspace under
//! `target/release-dry-run`, changing nothing here, and skips the verifying build of
//! each package (`--no-verify`: verifying rebuilds RocksDB from C++ for a crate that
//! uses it, about 25 minutes on the 2-core machines). A real release verifies.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::util::{capture, cargo_bin, run_command, target_dir, workspace_root};

const CHANGELOG: &str = "docs/CHANGELOG.md";

/// Whether `version` is `MAJOR.MINOR.PATCH` with an optional `-PRERELEASE`.
pub(crate) fn valid_version(version: &str) -> bool {
    let (core, pre) = version.split_once('-').unwrap_or((version, "x"));
    let numbers: Vec<&str> = core.split('.').collect();
    numbers.len() == 3
        && numbers.iter().all(|n| {
            !n.is_empty()
                && n.bytes().all(|b| b.is_ascii_digit())
                && (n.len() == 1 || !n.starts_with('0'))
        })
        && !pre.is_empty()
        && pre.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'.')
}

/// The root manifest with `[workspace.package] version` and every workspace-internal
/// dependency's `version` set to `version`.
pub(crate) fn bump_versions(manifest: &str, version: &str) -> Result<String> {
    let mut section = String::new();
    let mut bumped_package = false;
    let mut out = String::with_capacity(manifest.len());
    for line in manifest.lines() {
        let trimmed = line.trim_start();
        if trimmed.starts_with('[') {
            section = trimmed.trim().to_owned();
        }
        let replaced = match section.as_str() {
            "[workspace.package]"
                if trimmed.starts_with("version ") || trimmed.starts_with("version=") =>
            {
                bumped_package = true;
                format!("version = \"{version}\"")
            }
            "[workspace.dependencies]"
                if trimmed.starts_with("stillpoint") && trimmed.contains("path =") =>
            {
                replace_version_field(line, version)?
            }
            _ => line.to_owned(),
        };
        out.push_str(&replaced);
        out.push('\n');
    }
    if !bumped_package {
        bail!("no `version` in [workspace.package] of the root Cargo.toml");
    }
    Ok(out)
}

fn replace_version_field(line: &str, version: &str) -> Result<String> {
    let start = line
        .find("version = \"")
        .with_context(|| format!("workspace dependency without a version: {line}"))?
        + "version = \"".len();
    let end = line[start..]
        .find('"')
        .with_context(|| format!("unterminated version: {line}"))?
        + start;
    Ok(format!("{}{version}{}", &line[..start], &line[end..]))
}

/// The changelog section for `version` from commit subjects (newest first).
pub(crate) fn changelog_section(version: &str, date: &str, subjects: &[String]) -> String {
    let mut section = format!("## {version} — {date}\n\n");
    if subjects.is_empty() {
        section.push_str("- No changes since the previous release.\n");
    }
    for subject in subjects {
        section.push_str(&format!("- {subject}\n"));
    }
    section.push('\n');
    section
}

/// The changelog with `section` inserted above the newest existing section.
pub(crate) fn insert_section(changelog: &str, section: &str) -> String {
    let title = "# Changelog\n\n";
    let body = changelog.strip_prefix(title).unwrap_or(changelog);
    format!("{title}{section}{body}")
}

fn commits_since_last_tag(root: &Path) -> Result<Vec<String>> {
    let tag = capture(
        Command::new("git")
            .current_dir(root)
            .args(["describe", "--tags", "--abbrev=0"])
            .stderr(std::process::Stdio::null()),
    )
    .ok()
    .map(|t| t.trim().to_owned());
    let range = tag.map_or_else(|| "HEAD".to_owned(), |t| format!("{t}..HEAD"));
    let log = capture(Command::new("git").current_dir(root).args([
        "log",
        "--no-merges",
        "--format=%s",
        &range,
    ]))?;
    Ok(log.lines().map(str::to_owned).collect())
}

fn copy_workspace(root: &Path, scratch: &Path) -> Result<()> {
    if scratch.exists() {
        std::fs::remove_dir_all(scratch)?;
    }
    let files = capture(Command::new("git").current_dir(root).args([
        "ls-files",
        "--cached",
        "--others",
        "--exclude-standard",
    ]))?;
    for file in files.lines() {
        let from = root.join(file);
        if !from.is_file() {
            continue; // deleted but not yet committed
        }
        let to = scratch.join(file);
        if let Some(parent) = to.parent() {
            std::fs::create_dir_all(parent)?;
        }
        std::fs::copy(&from, &to).with_context(|| format!("copying {file}"))?;
    }
    Ok(())
}

fn apply(dir: &Path, version: &str, section: &str) -> Result<()> {
    let manifest_path = dir.join("Cargo.toml");
    let manifest = std::fs::read_to_string(&manifest_path)?;
    std::fs::write(&manifest_path, bump_versions(&manifest, version)?)?;
    let changelog_path = dir.join(CHANGELOG);
    let changelog = std::fs::read_to_string(&changelog_path).unwrap_or_default();
    std::fs::write(&changelog_path, insert_section(&changelog, section))?;
    Ok(())
}

pub(crate) fn run(args: &[String]) -> Result<()> {
    let dry_run = args.iter().any(|a| a == "--dry-run");
    let versions: Vec<&String> = args.iter().filter(|a| *a != "--dry-run").collect();
    let [version] = versions.as_slice() else {
        bail!("usage: cargo xtask release [--dry-run] VERSION");
    };
    if !valid_version(version) {
        bail!("`{version}` is not a MAJOR.MINOR.PATCH[-PRE] version");
    }
    let root = workspace_root()?;
    let date = capture(Command::new("date").args(["-u", "+%Y-%m-%d"]))?
        .trim()
        .to_owned();
    let section = changelog_section(version, &date, &commits_since_last_tag(&root)?);
    println!("{section}");

    let dir = if dry_run {
        let scratch = target_dir()?.join("release-dry-run");
        copy_workspace(&root, &scratch)?;
        scratch
    } else {
        root.clone()
    };
    apply(&dir, version, &section)?;

    let mut publish = Command::new(cargo_bin());
    publish
        .current_dir(&dir)
        .env("CARGO_TARGET_DIR", target_dir()?)
        .args(["publish", "--workspace", "--dry-run", "--allow-dirty"]);
    if dry_run {
        publish.arg("--no-verify");
    }
    run_command(&mut publish)?;
    if dry_run {
        println!(
            "release dry run of {version} packaged every crate (in {})",
            dir.display()
        );
    } else {
        println!(
            "bumped to {version} and wrote {CHANGELOG}; commit, tag v{version}, then `cargo publish --workspace`"
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_are_checked() {
        for ok in ["0.1.0", "1.20.3", "2.0.0-rc.1"] {
            assert!(valid_version(ok), "{ok}");
        }
        for bad in ["1.0", "01.0.0", "1.0.0-", "v1.0.0", "1.0.0-rc+1", "a.b.c"] {
            assert!(!valid_version(bad), "{bad}");
        }
    }

    #[test]
    fn bumps_package_and_internal_dependency_versions_only() {
        let manifest = "[workspace.package]\nversion = \"0.1.0\"\nedition = \"2024\"\n\n[workspace.dependencies]\nstillpoint-wire = { path = \"crates/stillpoint-wire\", version = \"0.1.0\" }\nbytes = \"1.10\"\n";
        let bumped = bump_versions(manifest, "0.2.0").unwrap();
        assert_eq!(
            bumped,
            "[workspace.package]\nversion = \"0.2.0\"\nedition = \"2024\"\n\n[workspace.dependencies]\nstillpoint-wire = { path = \"crates/stillpoint-wire\", version = \"0.2.0\" }\nbytes = \"1.10\"\n"
        );
        assert!(bump_versions("[package]\nname = \"x\"\n", "1.0.0").is_err());
    }

    #[test]
    fn changelog_sections_go_on_top() {
        let section = changelog_section(
            "0.2.0",
            "2026-12-02",
            &["wire: codec".into(), "xtask".into()],
        );
        assert_eq!(
            section,
            "## 0.2.0 — 2026-12-02\n\n- wire: codec\n- xtask\n\n"
        );
        let old = "# Changelog\n\n## 0.1.0 — 2026-11-01\n\n- first\n";
        assert_eq!(
            insert_section(old, &section),
            "# Changelog\n\n## 0.2.0 — 2026-12-02\n\n- wire: codec\n- xtask\n\n## 0.1.0 — 2026-11-01\n\n- first\n"
        );
    }
}
