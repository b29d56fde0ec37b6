//! The embedded registry: one JSON file per worker, written atomically.
//!
//! `<dir>/<key>.json` is written to a temporary file in the same directory,
//! synced, and renamed over the target, so readers see the old record, the new
//! one, or none, never a partial file. Withdraw removes the file.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use tokio::sync::mpsc;

use super::{Discovery, DiscoveryError, Listed, ListedRecord, Record};

/// File-backed discovery rooted at a directory.
#[derive(Debug)]
pub struct FileDiscovery {
    root: PathBuf,
    /// The file the last successful register wrote.
    written: Mutex<Option<PathBuf>>,
}

impl FileDiscovery {
    /// Discovery rooted at `root` (created on first write).
    pub fn new(root: impl Into<PathBuf>) -> Self {
        FileDiscovery {
            root: root.into(),
            written: Mutex::new(None),
        }
    }

    fn path_of(&self, record: &Record) -> PathBuf {
        self.root.join(format!("{}.json", record.key()))
    }
}

fn io_err(path: &Path, source: std::io::Error) -> DiscoveryError {
    DiscoveryError::Io {
        path: path.display().to_string(),
        source,
    }
}

fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), DiscoveryError> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(|e| io_err(dir, e))?;
    let file_name = path
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("record");
    let tmp = dir.join(format!(".{file_name}.{}.tmp", std::process::id()));
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
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

fn collect(dir: &Path, root: &Path, out: &mut Vec<ListedRecord>) -> std::io::Result<()> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    for entry in entries {
        let path = entry?.path();
        if path.is_dir() {
            collect(&path, root, out)?;
            continue;
        }
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if !name.ends_with(".json") || name.starts_with('.') {
            continue;
        }
        let rel = path.strip_prefix(root).unwrap_or(&path).to_string_lossy();
        let key = rel.trim_end_matches(".json").to_string();
        let content = match std::fs::read(&path) {
            Ok(bytes) => Listed::parse(&bytes),
            Err(e) => Listed::Invalid {
                error: e.to_string(),
            },
        };
        out.push(ListedRecord { key, content });
    }
    Ok(())
}

impl Discovery for FileDiscovery {
    async fn register(
        &self,
        record: &Record,
        _lost: mpsc::UnboundedSender<()>,
    ) -> Result<(), DiscoveryError> {
        let path = self.path_of(record);
        let mut bytes = serde_json::to_vec_pretty(record).unwrap_or_default();
        bytes.push(b'\n');
        let target = path.clone();
        tokio::task::spawn_blocking(move || write_atomically(&target, &bytes))
            .await
            .map_err(|e| io_err(&path, std::io::Error::other(e)))??;
        *self.written.lock().unwrap_or_else(|p| p.into_inner()) = Some(path);
        Ok(())
    }

    async fn withdraw(&self) -> Result<(), DiscoveryError> {
        let path = self
            .written
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let Some(path) = path else { return Ok(()) };
        let target = path.clone();
        let removed = tokio::task::spawn_blocking(move || match std::fs::remove_file(&target) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            other => other,
        })
        .await
        .map_err(|e| io_err(&path, std::io::Error::other(e)))?;
        removed.map_err(|e| io_err(&path, e))
    }

    async fn list(&self) -> Result<Vec<ListedRecord>, DiscoveryError> {
        let root = self.root.clone();
        let mut out = Vec::new();
        collect(&root, &root, &mut out).map_err(|e| io_err(&root, e))?;
        out.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(out)
    }

    fn location(&self, record: &Record) -> String {
        self.path_of(record).display().to_string()
    }
}
