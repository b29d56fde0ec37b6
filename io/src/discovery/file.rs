//! The embedded registry: one JSON file per worker, written atomically.
//!
//! `<dir>/<key>.json` is written to a temporary file in the same directory,
//! synced, and renamed over the target, so readers see the old record, the new
//! one, or none, never a partial file. Withdraw removes the file.
//!
//! Someone who can write the directory must not be able to steer the sidecar's
//! writes elsewhere: the temporary file has an unpredictable name and is
//! created exclusively (`O_CREAT|O_EXCL`, which never follows a symbolic link),
//! and no directory below the root may be a symbolic link. While registered, a
//! guard looks for the record every check interval and reports it lost if
//! someone removed it, so the core writes it again.

use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Component, Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::{Discovery, DiscoveryError, ListRecords, Listed, ListedRecord, Record};

/// A record file larger than this is not read by `instances` (records are a
/// few hundred bytes; a huge file is not one of ours).
const MAX_RECORD_BYTES: u64 = 1 << 20;

/// File-backed discovery rooted at a directory.
#[derive(Debug)]
pub struct FileDiscovery {
    root: PathBuf,
    /// How often the guard looks for the registered record.
    check_every: Duration,
    /// The file the last successful register wrote, and its guard.
    written: Mutex<Option<(PathBuf, CancellationToken)>>,
}

impl FileDiscovery {
    /// Discovery rooted at `root` (created on first write); a registered
    /// record is looked for every `check_every`.
    pub fn new(root: impl Into<PathBuf>, check_every: Duration) -> Self {
        FileDiscovery {
            root: root.into(),
            check_every,
            written: Mutex::new(None),
        }
    }

    fn path_of(&self, record: &Record) -> PathBuf {
        self.root.join(format!("{}.json", record.key()))
    }

    fn written(&self) -> std::sync::MutexGuard<'_, Option<(PathBuf, CancellationToken)>> {
        self.written.lock().unwrap_or_else(|p| p.into_inner())
    }
}

fn io_err(path: &Path, source: std::io::Error) -> DiscoveryError {
    DiscoveryError::File {
        path: path.display().to_string(),
        source,
    }
}

/// A name nobody can guess ahead of time (no RNG dependency: std's randomly
/// keyed hasher, fed the time).
fn unpredictable_suffix() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos(),
    );
    format!("{:016x}", h.finish())
}

/// Creates `dir` below `root` one directory at a time, refusing any that is a
/// symbolic link or not a directory (the root itself is the operator's and may
/// be anything that leads to a directory).
fn create_dirs_below(root: &Path, dir: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(root)?;
    let below = dir.strip_prefix(root).unwrap_or(dir);
    let mut at = root.to_path_buf();
    for part in below.components() {
        let Component::Normal(name) = part else {
            continue;
        };
        at.push(name);
        match std::fs::symlink_metadata(&at) {
            Ok(meta) if meta.file_type().is_symlink() => {
                return Err(std::io::Error::other(format!(
                    "{} is a symbolic link; refusing to write through it",
                    at.display()
                )));
            }
            Ok(meta) if meta.is_dir() => {}
            Ok(_) => {
                return Err(std::io::Error::other(format!(
                    "{} is not a directory",
                    at.display()
                )));
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => match std::fs::create_dir(&at) {
                Ok(()) => {}
                // Made a moment ago by someone else: look at it again next time.
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(e),
            },
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn write_atomically(root: &Path, path: &Path, bytes: &[u8]) -> Result<(), DiscoveryError> {
    let dir = path.parent().unwrap_or(Path::new("."));
    create_dirs_below(root, dir).map_err(|e| io_err(dir, e))?;
    let file_name = path
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("record");
    let tmp = dir.join(format!(".{file_name}.{}.tmp", unpredictable_suffix()));
    let result = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o644)
            .open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if let Err(e) = result {
        let _ = std::fs::remove_file(&tmp);
        return Err(io_err(path, e));
    }
    Ok(())
}

/// Reads one entry for `instances`: regular files only, bounded, never
/// blocking on a FIFO or a device.
fn read_entry(path: &Path) -> Listed {
    let invalid = |error: String| Listed::Invalid { error };
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) => return invalid(e.to_string()),
    };
    if !meta.file_type().is_file() {
        return invalid("not a regular file".to_string());
    }
    if meta.len() > MAX_RECORD_BYTES {
        return invalid(format!("larger than {MAX_RECORD_BYTES} bytes"));
    }
    let mut bytes = Vec::new();
    let read =
        std::fs::File::open(path).and_then(|f| f.take(MAX_RECORD_BYTES).read_to_end(&mut bytes));
    match read {
        Ok(_) => Listed::parse(&bytes),
        Err(e) => invalid(e.to_string()),
    }
}

fn collect(dir: &Path, root: &Path, out: &mut Vec<ListedRecord>) -> std::io::Result<()> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    for entry in entries {
        let entry = entry?;
        let path = entry.path();
        // Never follow a symbolic link into another directory (a loop would
        // list the same records again and again).
        let file_type = entry.file_type()?;
        if file_type.is_dir() {
            collect(&path, root, out)?;
            continue;
        }
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if !name.ends_with(".json") || name.starts_with('.') {
            continue;
        }
        let rel = path.strip_prefix(root).unwrap_or(&path).to_string_lossy();
        let key = rel.trim_end_matches(".json").to_string();
        out.push(ListedRecord {
            key,
            content: read_entry(&path),
        });
    }
    Ok(())
}

/// Looks for `path` every `every` until cancelled; reports it lost once if gone.
async fn guard(
    path: PathBuf,
    every: Duration,
    lost: mpsc::UnboundedSender<String>,
    cancel: CancellationToken,
) {
    let mut ticker = tokio::time::interval(every);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticker.tick().await;
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            _ = ticker.tick() => {}
        }
        // A directory on its path replaced by a file hides it as surely.
        let gone = matches!(
            tokio::fs::symlink_metadata(&path).await,
            Err(e) if matches!(
                e.kind(),
                std::io::ErrorKind::NotFound | std::io::ErrorKind::NotADirectory
            )
        );
        if gone && !cancel.is_cancelled() {
            tracing::warn!(record = %path.display(), "the record file was removed by someone else");
            let _ = lost.send("its record file was removed".to_string());
            return;
        }
    }
}

impl Discovery for FileDiscovery {
    async fn register(
        &self,
        record: &Record,
        lost: mpsc::UnboundedSender<String>,
    ) -> Result<(), DiscoveryError> {
        let path = self.path_of(record);
        let mut bytes = serde_json::to_vec_pretty(record).unwrap_or_default();
        bytes.push(b'\n');
        let (root, target) = (self.root.clone(), path.clone());
        tokio::task::spawn_blocking(move || write_atomically(&root, &target, &bytes))
            .await
            .map_err(|e| io_err(&path, std::io::Error::other(e)))??;
        let cancel = CancellationToken::new();
        tokio::spawn(guard(path.clone(), self.check_every, lost, cancel.clone()));
        if let Some((_, old)) = self.written().replace((path, cancel)) {
            old.cancel();
        }
        Ok(())
    }

    async fn withdraw(&self) -> Result<(), DiscoveryError> {
        let path = {
            let written = self.written();
            let Some((path, guard)) = written.as_ref() else {
                return Ok(());
            };
            guard.cancel();
            path.clone()
        };
        let target = path.clone();
        let removed = tokio::task::spawn_blocking(move || match std::fs::remove_file(&target) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            other => other,
        })
        .await
        .map_err(|e| io_err(&path, std::io::Error::other(e)))?;
        removed.map_err(|e| io_err(&path, e))
    }

    fn location(&self, record: &Record) -> String {
        self.path_of(record).display().to_string()
    }
}

impl ListRecords for FileDiscovery {
    async fn list(&self) -> Result<Vec<ListedRecord>, DiscoveryError> {
        let root = self.root.clone();
        let mut out = Vec::new();
        collect(&root, &root, &mut out).map_err(|e| io_err(&root, e))?;
        out.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "llm-sidecar-file-{}-{name}-{}",
            std::process::id(),
            unpredictable_suffix()
        ));
        std::fs::create_dir_all(&dir).expect("scratch dir");
        dir
    }

    #[test]
    fn a_symlinked_directory_below_the_root_is_refused() {
        let root = scratch("root");
        let elsewhere = scratch("elsewhere");
        std::os::unix::fs::symlink(&elsewhere, root.join("v1")).expect("symlink");
        let target = root.join("v1/instances/a/b/c/1.json");
        let err = write_atomically(&root, &target, b"{}").expect_err("refused");
        let line = crate::report::error_chain(&err);
        assert!(line.contains("symbolic link"), "{line}");
        assert_eq!(
            std::fs::read_dir(&elsewhere)
                .map(|d| d.count())
                .unwrap_or(0),
            0,
            "nothing was created through the link"
        );
        let _ = std::fs::remove_dir_all(&root);
        let _ = std::fs::remove_dir_all(&elsewhere);
    }

    #[test]
    fn temporary_names_are_not_predictable() {
        assert_ne!(unpredictable_suffix(), unpredictable_suffix());
    }
}
