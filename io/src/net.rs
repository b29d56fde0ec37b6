//! Binding listeners, with errors that say which listener and where.

use std::net::SocketAddr;

use tokio::net::TcpListener;

/// A listen address could not be bound.
#[derive(Debug, thiserror::Error)]
#[error("cannot listen on {addr} ({what}): {source}")]
pub struct BindError {
    /// Which listener ("admin", "request plane", …).
    pub what: &'static str,
    /// The address.
    pub addr: SocketAddr,
    /// The OS error.
    #[source]
    pub source: std::io::Error,
}

/// Binds `addr` for the listener named `what`.
pub async fn bind(what: &'static str, addr: SocketAddr) -> Result<TcpListener, BindError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| BindError { what, addr, source })
}

/// File descriptors kept free of caller connections: the engine connections,
/// discovery, the admin server and its callers, the listeners, logs and the
/// runtime's own.
pub const RESERVED_FDS: u64 = 256;

/// Makes room for `connections` caller connections: raises the soft limit on
/// open files as far as the hard limit allows (systemd's default soft limit is
/// 1,024, which silent connections alone can use up), and returns how many
/// caller connections fit with [`RESERVED_FDS`] to spare. A limit that cannot
/// be read or raised leaves `connections` as it was.
pub fn room_for_connections(connections: u32) -> u32 {
    let wanted = u64::from(connections) + RESERVED_FDS;
    match rlimit::increase_nofile_limit(wanted) {
        Ok(soft) if soft >= wanted => connections,
        Ok(soft) => {
            let fit = soft.saturating_sub(RESERVED_FDS).max(1);
            let fit = u32::try_from(fit).unwrap_or(u32::MAX);
            tracing::warn!(
                "the open-file limit is {soft} and cannot be raised; accepting at most {fit} \
                 caller connections instead of {connections}"
            );
            fit
        }
        Err(e) => {
            tracing::warn!("cannot read or raise the open-file limit: {e}");
            connections
        }
    }
}

/// Raises the soft limit on open files to the hard limit, for a process whose
/// sockets another crate accepts without a bound of its own (Dynamo's request
/// plane): the most connections it can hold before accepts fail. Returns the
/// limit now, or `None` (said once) when it cannot be read or raised.
pub fn raise_open_file_limit() -> Option<u64> {
    match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(soft) => Some(soft),
        Err(e) => {
            tracing::warn!("cannot read or raise the open-file limit: {e}");
            None
        }
    }
}
