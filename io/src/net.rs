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
