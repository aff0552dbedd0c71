//! Transfer progress: bars on a terminal (indicatif), plain log lines otherwise.

use std::io::IsTerminal;
use std::sync::Mutex;

use indicatif::{ProgressBar, ProgressStyle};
use stillpoint_backup::{Progress, TransferEvent, TransferKind};

/// Human-readable bytes (binary units).
pub(crate) fn bytes(n: u64) -> String {
    indicatif::HumanBytes(n).to_string()
}

fn verb(kind: TransferKind) -> &'static str {
    match kind {
        TransferKind::Upload => "upload",
        TransferKind::Download => "download",
        TransferKind::Verify => "verify",
    }
}

/// Draws the store's transfer events.
pub(crate) struct Reporter {
    bar: Mutex<Option<ProgressBar>>,
    terminal: bool,
}

impl Reporter {
    pub(crate) fn new() -> Self {
        Self {
            bar: Mutex::new(None),
            terminal: std::io::stderr().is_terminal(),
        }
    }
}

impl Progress for Reporter {
    fn on_event(&self, event: &TransferEvent<'_>) {
        let Ok(mut bar) = self.bar.lock() else {
            return;
        };
        match *event {
            TransferEvent::Started {
                kind,
                files,
                bytes: total,
            } => {
                if self.terminal {
                    let new = ProgressBar::new(total);
                    if let Ok(style) = ProgressStyle::with_template(
                        "{msg:>9} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
                    ) {
                        new.set_style(style.progress_chars("=> "));
                    }
                    new.set_message(verb(kind));
                    *bar = Some(new);
                } else {
                    tracing::info!("{}: {files} files, {}", verb(kind), bytes(total));
                }
            }
            TransferEvent::File {
                bytes: size, path, ..
            } => match bar.as_ref() {
                Some(bar) => bar.inc(size),
                None => tracing::debug!(path, size, "file done"),
            },
            TransferEvent::Finished { kind } => {
                if let Some(bar) = bar.take() {
                    bar.finish_and_clear();
                }
                tracing::info!("{} finished", verb(kind));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn bytes_read_like_a_person_writes_them() {
        assert_eq!(super::bytes(512), "512 B");
        assert_eq!(super::bytes(1536), "1.50 KiB");
        assert_eq!(super::bytes(3 << 30), "3.00 GiB");
    }
}
