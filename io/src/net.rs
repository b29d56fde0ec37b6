//! Binding listeners, with errors that say which listener and where, and
//! closing request-plane connections without wiping out their last answers.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio::time::Sleep;

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

/// How long a closing connection keeps reading what the caller still sends.
/// Go's HTTP/2 server gives a caller the same second after its final GOAWAY.
pub(crate) const LINGER: Duration = Duration::from_secs(1);

/// A connection that closes the way a careful HTTP server closes one:
/// half-close (FIN after the last frame), then read and discard whatever the
/// caller still sends until it closes its side too, for at most [`LINGER`].
///
/// Why: closing a socket that holds unread bytes makes the kernel send a TCP
/// reset instead of a FIN. At the sidecar's exit a busy caller has always sent
/// something more (a new request racing the GOAWAY, a window update, a reset of
/// a stream it gave up on); the reset then fails the caller's next write, and
/// its HTTP/2 stack fails every call on the connection with "transport error",
/// even those whose answer ("draining", or the trailers of a cut call) already
/// sits unread in its socket buffer. Reading until the caller's FIN lets it read
/// everything first.
pub(crate) struct LingeringClose<S> {
    inner: S,
    /// Set once the write side is shut: the end of the linger.
    linger: Option<Pin<Box<Sleep>>>,
}

impl<S> LingeringClose<S> {
    pub(crate) fn new(inner: S) -> Self {
        LingeringClose {
            inner,
            linger: None,
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for LingeringClose<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for LingeringClose<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    /// Shuts the write side, then completes when the caller has closed its
    /// side, its connection failed, or [`LINGER`] passed.
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.linger.is_none() {
            ready!(Pin::new(&mut this.inner).poll_shutdown(cx))?;
            this.linger = Some(Box::pin(tokio::time::sleep(LINGER)));
        }
        let mut scratch = [0u8; 4096];
        loop {
            if let Some(linger) = this.linger.as_mut()
                && linger.as_mut().poll(cx).is_ready()
            {
                return Poll::Ready(Ok(()));
            }
            let mut buf = ReadBuf::new(&mut scratch);
            match Pin::new(&mut this.inner).poll_read(cx, &mut buf) {
                Poll::Ready(Ok(())) if buf.filled().is_empty() => return Poll::Ready(Ok(())),
                Poll::Ready(Ok(())) => continue,
                // The caller's side is gone already: nothing left to protect.
                Poll::Ready(Err(_)) => return Poll::Ready(Ok(())),
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}
