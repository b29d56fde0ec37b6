//! Where workers are registered: the record, its key, and the backends.
//!
//! A backend implements [`Discovery`]. The driver calls it one write at a time,
//! in order, and tells the core how each write went; a backend never retries on
//! its own (the core decides retries) and reports a lost registration through
//! the channel handed to [`Discovery::register`].

mod etcd;
mod file;
pub(crate) mod worker;

use std::future::Future;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

pub use etcd::EtcdDiscovery;
pub use file::FileDiscovery;

use crate::parse::{ConfigError, parse_host_port};

/// Which discovery backend, and where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DiscoveryUri {
    /// `file:<dir>`: one JSON file per worker under `dir`.
    File(PathBuf),
    /// `etcd://host:port[,host:port...]`: keys with leases in etcd.
    Etcd(Vec<String>),
    /// Dynamo's `kubernetes` backend: the worker's `DynamoWorkerMetadata`
    /// object (`llm-sidecar-dynamo` only; `--discovery` never parses to it).
    Kubernetes {
        /// The pod's namespace.
        namespace: String,
        /// The object's name.
        object: String,
    },
}

impl DiscoveryUri {
    /// Parses `file:<dir>` or `etcd://host:port[,host:port...]`.
    pub fn parse(value: &str) -> Result<Self, ConfigError> {
        let err = |message: &str| ConfigError::Discovery {
            value: value.to_string(),
            message: message.to_string(),
        };
        if let Some(dir) = value.strip_prefix("file:") {
            let dir = dir.strip_prefix("//").unwrap_or(dir);
            if dir.is_empty() {
                return Err(err(
                    "file: needs a directory, like file:.llm-sidecar/discovery",
                ));
            }
            return Ok(DiscoveryUri::File(PathBuf::from(dir)));
        }
        if let Some(hosts) = value.strip_prefix("etcd://") {
            let endpoints = hosts
                .split(',')
                .map(|h| parse_host_port("--discovery", h.trim()))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|_| err("etcd:// needs host:port[,host:port...]"))?;
            return Ok(DiscoveryUri::Etcd(endpoints));
        }
        Err(err("use file:<dir> or etcd://host:port[,host:port...]"))
    }
}

impl DiscoveryUri {
    /// Checks what can be checked without writing: a `file:` root that exists
    /// must be a directory, and must not be on a kernel filesystem (`/proc`,
    /// `/sys`, `/dev`), where no record could ever be written. A root that does
    /// not exist yet, or is read-only for now, is fine: start-up retries.
    pub fn check_local(&self) -> Result<(), ConfigError> {
        let DiscoveryUri::File(dir) = self else {
            return Ok(());
        };
        let err = |message: String| ConfigError::Discovery {
            value: self.to_string(),
            message,
        };
        match std::fs::metadata(dir) {
            Ok(meta) if !meta.is_dir() => {
                return Err(err(format!("{} is not a directory", dir.display())));
            }
            Ok(_) | Err(_) => {}
        }
        // The deepest part of the path that exists, resolved.
        let existing = dir.ancestors().find_map(|a| {
            std::fs::canonicalize(if a.as_os_str().is_empty() {
                Path::new(".")
            } else {
                a
            })
            .ok()
        });
        if let Some(real) = existing
            && ["/proc", "/sys", "/dev"]
                .iter()
                .any(|virt| real.starts_with(virt))
        {
            return Err(err(format!(
                "{} is on a kernel filesystem ({}); records cannot be written there",
                dir.display(),
                real.display()
            )));
        }
        Ok(())
    }
}

impl std::fmt::Display for DiscoveryUri {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DiscoveryUri::File(dir) => write!(f, "file:{}", dir.display()),
            DiscoveryUri::Etcd(hosts) => write!(f, "etcd://{}", hosts.join(",")),
            DiscoveryUri::Kubernetes { namespace, object } => {
                write!(f, "kubernetes:{namespace}/dynamoworkermetadatas/{object}")
            }
        }
    }
}

/// The engine as the record describes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineRecord {
    /// `trtllm`, `vllm`, `sglang`.
    pub kind: String,
    /// The engine's own version string.
    pub version: String,
    /// The identity the sidecar watches; a change means another engine answers.
    pub identity: String,
}

/// The model as the record describes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelRecord {
    /// Model id or path.
    pub name: String,
    /// Maximum input length in tokens.
    pub max_input_len: i64,
    /// Maximum sequence length (input + output) in tokens.
    pub max_seq_len: i64,
    /// The engine's KV cache, in tokens, where its API says it (SGLang's
    /// `max_total_num_tokens`): how many tokens all running sequences may
    /// hold together, which is not the model's sequence length.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_cache_tokens: Option<i64>,
}

/// A worker's discovery record (docs/CONTRACT.md, "Discovery").
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// The instance id, lowercase hex, as in the key.
    pub instance_id: String,
    /// Key segment: namespace.
    pub namespace: String,
    /// Key segment: component.
    pub component: String,
    /// Key segment: endpoint.
    pub endpoint: String,
    /// The request-plane address routers call, `host:port`.
    pub address: String,
    /// Always `grpc`.
    pub transport: String,
    /// The engine behind this worker.
    pub engine: EngineRecord,
    /// The model it serves.
    pub model: ModelRecord,
    /// The sidecar's process id.
    pub pid: u32,
    /// When this registration was written (RFC 3339).
    pub registered_at: String,
}

impl Record {
    /// `v1/instances/<namespace>/<component>/<endpoint>/<instance_id>`.
    pub fn key(&self) -> String {
        format!(
            "v1/instances/{}/{}/{}/{}",
            self.namespace, self.component, self.endpoint, self.instance_id
        )
    }
}

/// A cause kept whole, whatever its type (another system's error).
pub type Cause = Box<dyn std::error::Error + Send + Sync>;

/// Why a discovery operation failed, by what went wrong. Each variant names
/// what was being done and keeps its cause as the error's source: the log
/// line renders the whole chain (`report::error_chain`), so no variant
/// repeats its cause in its own text.
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    /// The file store could not be read or written at `path`.
    #[error("{path}")]
    File {
        /// The file or directory.
        path: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// An etcd call about `key` (or a prefix) failed or got no answer.
    #[error("{key}")]
    Etcd {
        /// The key or prefix the call was about.
        key: String,
        /// etcd's answer, or the transport's failure.
        #[source]
        source: CallStatus,
    },
    /// An etcd endpoint, as given, cannot be used (not a URI, or its TLS
    /// settings refused).
    #[error("etcd endpoint {endpoint}")]
    Endpoint {
        /// `host:port`, as given.
        endpoint: String,
        /// Why it cannot be used.
        #[source]
        source: Cause,
    },
    /// The backend did not answer within the connect-attempt timeout.
    #[error("no answer within {0}")]
    Timeout(String),
    /// The system that hosts the worker (Dynamo, for `llm-sidecar-dynamo`)
    /// failed at `what`.
    #[error("{what}")]
    Hosted {
        /// What was being done.
        what: String,
        /// The hosting system's error.
        #[source]
        source: Cause,
    },
    /// A call to the engine that the record needs failed.
    #[error("the engine's {call}")]
    Engine {
        /// The call, by its name.
        call: &'static str,
        /// The engine's answer.
        #[source]
        source: CallStatus,
    },
    /// The worker cannot be registered yet: what it waits for.
    #[error("{0}")]
    NotReady(&'static str),
    /// The record was not written: what it would carry is unusable (an
    /// engine's self-description out of bounds). Retried like any failed
    /// write, in case the engine is restarted with sane settings.
    #[error("{0}")]
    Refused(String),
}

/// A failed gRPC call's status, read as an operator reads it: its code and
/// message (tonic's own rendering adds details and metadata that say
/// nothing here); the transport's failure, when that was the cause, is its
/// source.
#[derive(Debug)]
pub struct CallStatus(pub tonic::Status);

impl std::fmt::Display for CallStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.0.message().is_empty() {
            write!(f, "{:?}", self.0.code())
        } else {
            write!(f, "{:?}: {}", self.0.code(), self.0.message())
        }
    }
}

impl std::error::Error for CallStatus {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        std::error::Error::source(&self.0)
    }
}

/// A discovery backend. Calls come one at a time, in order.
pub trait Discovery: Send + Sync + 'static {
    /// Writes (or rewrites) the record. `lost` is where the backend reports, later,
    /// that the store dropped the record on its own (an expired lease).
    fn register(
        &self,
        record: &Record,
        lost: mpsc::UnboundedSender<String>,
    ) -> impl Future<Output = Result<(), DiscoveryError>> + Send;

    /// Removes the record written by the last `register`, if any. Removing a
    /// record that is not there succeeds.
    fn withdraw(&self) -> impl Future<Output = Result<(), DiscoveryError>> + Send;

    /// Where the record lives, for operators (`/state`, logs).
    fn location(&self, record: &Record) -> String;
}

/// A store whose every record can be read back, for `llm-sidecar
/// instances`. Apart from [`Discovery`]: the sidecar never lists, and a
/// hosting system's discovery (Dynamo's) is listed with that system's tools.
pub trait ListRecords {
    /// Every record in the store.
    fn list(&self) -> impl Future<Output = Result<Vec<ListedRecord>, DiscoveryError>> + Send;
}

/// One entry found in discovery: its key and what it held.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ListedRecord {
    /// The discovery key.
    pub key: String,
    /// The parsed record, or why it could not be read.
    #[serde(flatten)]
    pub content: Listed,
}

/// The content of a listed entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum Listed {
    /// A well-formed record.
    Record(Box<Record>),
    /// An entry that is not a valid record (and why).
    Invalid {
        /// The parse error.
        error: String,
    },
}

impl Listed {
    /// Reads one stored record: what `instances` shows for it. Anything that is
    /// not a record becomes `Invalid` with the reason; nothing panics.
    pub fn parse(bytes: &[u8]) -> Listed {
        match serde_json::from_slice::<Record>(bytes) {
            Ok(r) => Listed::Record(Box::new(r)),
            Err(e) => Listed::Invalid {
                error: e.to_string(),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the operator reads: what was being done, then each cause once.
    #[test]
    fn an_error_reads_as_what_was_done_then_each_cause_once() {
        use crate::report::error_chain;
        let file = DiscoveryError::File {
            path: "/d/v1/x.json".into(),
            source: std::io::Error::from(std::io::ErrorKind::PermissionDenied),
        };
        assert_eq!(error_chain(&file), "/d/v1/x.json: permission denied");
        let etcd = DiscoveryError::Etcd {
            key: "v1/instances/a".into(),
            source: CallStatus(tonic::Status::unavailable("etcdserver: no leader")),
        };
        assert_eq!(
            error_chain(&etcd),
            "v1/instances/a: Unavailable: etcdserver: no leader"
        );
        let bare = DiscoveryError::Etcd {
            key: "v1/instances/a".into(),
            source: CallStatus(tonic::Status::new(tonic::Code::Unknown, "")),
        };
        assert_eq!(error_chain(&bare), "v1/instances/a: Unknown");
        let engine = DiscoveryError::Engine {
            call: "GetServerInfo",
            source: CallStatus(tonic::Status::unimplemented("no such method")),
        };
        assert_eq!(
            error_chain(&engine),
            "the engine's GetServerInfo: Unimplemented: no such method"
        );
        let hosted = DiscoveryError::Hosted {
            what: "Dynamo discovery".into(),
            source: "Dynamo's worker failed: bind: address in use".into(),
        };
        assert_eq!(
            error_chain(&hosted),
            "Dynamo discovery: Dynamo's worker failed: bind: address in use"
        );
        // The cause is kept, not flattened: a caller can still ask what it was.
        let std::io::ErrorKind::PermissionDenied = std::error::Error::source(&file)
            .and_then(|s| s.downcast_ref::<std::io::Error>())
            .map(std::io::Error::kind)
            .expect("the OS error")
        else {
            panic!("the OS error's kind is kept");
        };
    }

    #[test]
    fn uris_parse_or_explain() {
        assert_eq!(
            DiscoveryUri::parse("file:.llm-sidecar/discovery").unwrap(),
            DiscoveryUri::File(".llm-sidecar/discovery".into())
        );
        assert_eq!(
            DiscoveryUri::parse("etcd://127.0.0.1:2379,[::1]:2379").unwrap(),
            DiscoveryUri::Etcd(vec!["127.0.0.1:2379".into(), "[::1]:2379".into()])
        );
        for bad in [
            "",
            "file:",
            "etcd://",
            "etcd://host",
            "redis://x:1",
            "/tmp/x",
        ] {
            assert!(DiscoveryUri::parse(bad).is_err(), "{bad:?}");
        }
    }
}
