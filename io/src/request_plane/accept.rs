//! Accepting callers: the listener loop, the TLS handshake, HTTP/2 settings,
//! the GOAWAY at exit, and a close that never resets a busy caller.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio::time::Sleep;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::Plane;
use crate::exit_bounds::{GOAWAY_FLUSH, LINGER};
use crate::tls::ServerTls;

/// How long a caller gets to finish the TLS handshake.
const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// After a failed accept (out of file descriptors, say), wait this long before
/// the next one instead of spinning on the same error.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(50);

/// HTTP/2 flow-control windows towards callers: large enough that a stream of
/// tokens never waits for a window update on loopback or in a pod.
const STREAM_WINDOW: u32 = 1 << 20;
const CONNECTION_WINDOW: u32 = 4 << 20;

/// Serves the request plane on `listener` until `cancel` fires, over TLS when
/// `tls` is set. Every connection task is tracked by `connections`, so the
/// driver can wait for their GOAWAYs at exit.
pub(crate) async fn serve(
    listener: TcpListener,
    tls: Option<ServerTls>,
    plane: Arc<Plane>,
    cancel: CancellationToken,
    connections: TaskTracker,
) {
    loop {
        let accepted = tokio::select! {
            () = cancel.cancelled() => return,
            accepted = listener.accept() => accepted,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(e) => {
                tracing::warn!("request plane: accept failed: {e}");
                tokio::time::sleep(ACCEPT_ERROR_PAUSE).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let stream = LingeringClose::new(stream);
        let plane = plane.clone();
        let cancel = cancel.clone();
        let tls = tls.clone();
        connections.spawn(async move {
            let Some(tls) = tls else {
                return serve_connection(stream, plane, cancel).await;
            };
            let handshake =
                tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, tls.acceptor.accept(stream));
            let stream = tokio::select! {
                () = cancel.cancelled() => return,
                handshake = handshake => match handshake {
                    Ok(Ok(stream)) => stream,
                    // A failed handshake (no or untrusted client certificate, not
                    // TLS at all) ends this connection only; the caller's TLS stack
                    // gets the alert.
                    Ok(Err(e)) => {
                        tracing::debug!(%peer, "request plane: TLS handshake failed: {e}");
                        return;
                    }
                    Err(_) => {
                        tracing::debug!(%peer, "request plane: TLS handshake timed out");
                        return;
                    }
                },
            };
            serve_connection(stream, plane, cancel).await;
        });
    }
}

/// One caller connection: HTTP/2 only, until it ends or the sidecar exits.
async fn serve_connection<IO>(io: IO, plane: Arc<Plane>, cancel: CancellationToken)
where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let limits = plane.limits;
    let service = service_fn(move |req| super::forward::handle(plane.clone(), req));
    let conn = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
        .max_concurrent_streams(limits.max_concurrent_streams)
        .max_header_list_size(limits.max_header_list_bytes)
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .serve_connection(TokioIo::new(io), service);
    let mut conn = std::pin::pin!(conn);
    tokio::select! {
        // Garbage, HTTP/1 or a protocol error ends this connection only.
        _ = conn.as_mut() => return,
        () = cancel.cancelled() => {}
    }
    // Exiting: GOAWAY, let the last frames (trailers) reach the caller.
    conn.as_mut().graceful_shutdown();
    let _ = tokio::time::timeout(GOAWAY_FLUSH, conn).await;
}

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
struct LingeringClose<S> {
    inner: S,
    /// Set once the write side is shut: the end of the linger.
    linger: Option<Pin<Box<Sleep>>>,
}

impl<S> LingeringClose<S> {
    fn new(inner: S) -> Self {
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
