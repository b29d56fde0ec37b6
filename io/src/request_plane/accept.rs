//! Accepting callers: the listener loop and the connection cap, the TLS
//! handshake, HTTP/2 settings, the handshake and idle timeouts, the GOAWAY at
//! exit, and a close that never resets a busy caller. Each connection is
//! served with h2's server directly, by one task that also runs the
//! connection's calls (`calls.rs`).

use std::io;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio::time::Sleep;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use std::sync::atomic::Ordering;

use super::Plane;
use super::calls::Calls;
use super::frame_watch::{FrameWatch, Watched};
use super::shards::Shards;
use crate::exit_bounds::{CLOSE_LINGER, GOAWAY_FLUSH};
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
/// `tls` is set. Each connection runs on the shard with the fewest open
/// (`shards`), its task tracked by `connections`, so the driver can wait for
/// their GOAWAYs at exit.
pub(crate) async fn serve(
    listener: TcpListener,
    tls: Option<ServerTls>,
    plane: Arc<Plane>,
    cancel: CancellationToken,
    connections: TaskTracker,
    shards: Arc<Shards>,
) {
    let mut refusing = false;
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
        let Some(slot) = ConnectionSlot::take(&plane) else {
            // Closed at once: the caller learns now and can go elsewhere,
            // instead of hanging in the backlog.
            plane.connections_refused.fetch_add(1, Ordering::Relaxed);
            if !refusing {
                refusing = true;
                tracing::warn!(
                    max = plane.limits.max_connections,
                    "request plane: {} caller connections open, the most allowed; closing new \
                     ones until some end",
                    plane.limits.max_connections
                );
            }
            drop(stream);
            continue;
        };
        refusing = false;
        let _ = stream.set_nodelay(true);
        let shard = shards.pick();
        let plane = plane.clone();
        let cancel = cancel.clone();
        let tls = tls.clone();
        // The socket leaves this runtime's reactor for its shard's (the same
        // one for shard 0: a re-registration, once per connection).
        let stream = match stream.into_std() {
            Ok(stream) => stream,
            Err(e) => {
                tracing::warn!(%peer, "request plane: cannot hand a connection to its thread: {e}");
                continue;
            }
        };
        let handle = shard.handle().clone();
        connections.spawn_on(
            async move {
                let _slots = (slot, shard);
                let stream = match tokio::net::TcpStream::from_std(stream) {
                    Ok(stream) => LingeringClose::new(stream),
                    Err(e) => {
                        tracing::warn!(%peer, "request plane: a connection's thread cannot take it: {e}");
                        return;
                    }
                };
                serve_accepted(stream, tls, plane, cancel, peer).await;
            },
            &handle,
        );
    }
}

/// One accepted connection, through its TLS handshake if `tls` is set.
async fn serve_accepted(
    stream: LingeringClose<tokio::net::TcpStream>,
    tls: Option<ServerTls>,
    plane: Arc<Plane>,
    cancel: CancellationToken,
    peer: std::net::SocketAddr,
) {
    let Some(tls) = tls else {
        return serve_connection(stream, plane, cancel, peer.ip()).await;
    };
    let handshake = tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, tls.acceptor.accept(stream));
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
    serve_connection(stream, plane, cancel, peer.ip()).await;
}

/// One of `--max-connections`, held for as long as its connection lives.
struct ConnectionSlot(Arc<Plane>);

impl ConnectionSlot {
    fn take(plane: &Arc<Plane>) -> Option<ConnectionSlot> {
        let max = plane.limits.max_connections as usize;
        let open = &plane.connections_open;
        let mut now = open.load(Ordering::Acquire);
        loop {
            if now >= max {
                return None;
            }
            match open.compare_exchange_weak(now, now + 1, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return Some(ConnectionSlot(plane.clone())),
                Err(seen) => now = seen,
            }
        }
    }
}

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        self.0.connections_open.fetch_sub(1, Ordering::AcqRel);
    }
}

/// What h2 may hold, per caller stream, of an answer the caller's window
/// allows but its socket has not taken yet. The relay reads the engine only
/// as fast as h2 grants room, so this bounds what a caller that opens its
/// windows wide and never reads makes the sidecar hold: a token is a DATA
/// frame of some 25 bytes with about four times that in h2's books, so
/// 16 KiB of tokens is some 80 KiB per stream (h2's default, 400 KiB, let a
/// stream hold about 2 MiB). Answers still flow at socket speed: h2 grants
/// room again as soon as its frames are written.
const CALLER_STREAM_SEND_BUFFER: usize = 16 << 10;

/// One caller connection: HTTP/2 only, until it ends, its handshake or idle
/// time runs out, it floods, or the sidecar exits.
async fn serve_connection<IO>(io: IO, plane: Arc<Plane>, cancel: CancellationToken, address: IpAddr)
where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let limits = plane.limits;
    let watched = Watched::new(address);
    let io = FrameWatch::new(io, watched.clone(), limits.control_frame_budget);
    let handshake = h2::server::Builder::new()
        .max_send_buffer_size(CALLER_STREAM_SEND_BUFFER)
        .max_concurrent_streams(plane.stream_cap())
        .max_header_list_size(limits.max_header_list_bytes)
        .initial_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .handshake::<_, Bytes>(io);
    let mut conn = CallerConnection {
        state: State::Handshaking(handshake),
        closing: false,
        calls: Calls::new(),
        plane,
        watched: watched.clone(),
    };
    let handshake_by = tokio::time::Instant::now() + limits.handshake_timeout;
    loop {
        let idle_check = match watched.idle_for() {
            Some(idle) => limits.idle_timeout.saturating_sub(idle),
            None => limits.idle_timeout,
        };
        tokio::select! {
            // Garbage, HTTP/1, a protocol error or a flood ends this connection only.
            () = std::future::poll_fn(|cx| conn.poll_serve(cx)) => return,
            () = cancel.cancelled() => break,
            () = tokio::time::sleep_until(handshake_by), if !watched.handshake_done() => {
                // Armed when the loop last went round; the handshake may have
                // completed since.
                if !watched.handshake_done() {
                    tracing::debug!(
                        "request plane: no HTTP/2 preface within the handshake timeout; closing"
                    );
                    return;
                }
            }
            () = tokio::time::sleep(idle_check) => {
                if watched.idle_for().is_some_and(|idle| idle >= limits.idle_timeout) {
                    tracing::debug!("request plane: caller connection idle; GOAWAY");
                    break;
                }
            }
        }
    }
    // Exiting (or idle): GOAWAY, let the last frames (trailers) reach the caller.
    conn.graceful_shutdown();
    let _ =
        tokio::time::timeout(GOAWAY_FLUSH, std::future::poll_fn(|cx| conn.poll_serve(cx))).await;
}

/// How many times one turn of a connection's task goes round (read and
/// write, then the calls woken meanwhile) before it lets the runtime's other
/// tasks run.
const ROUNDS_PER_TURN: usize = 8;

/// A caller connection's HTTP/2 state and its calls, polled by its task.
struct CallerConnection<IO> {
    state: State<IO>,
    /// GOAWAY was asked for before the handshake completed.
    closing: bool,
    calls: Calls,
    plane: Arc<Plane>,
    watched: Arc<Watched>,
}

enum State<IO> {
    Handshaking(h2::server::Handshake<IO, Bytes>),
    Serving(h2::server::Connection<IO, Bytes>),
    Ended,
}

impl<IO> CallerConnection<IO>
where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    /// Serves the connection until it ends: reads the caller's frames,
    /// starts a call for each new stream (polled at once), polls the calls
    /// that were woken, and writes what they queued, round after round
    /// within one turn while there is work.
    fn poll_serve(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        self.calls.run_woken(cx);
        if let State::Handshaking(handshake) = &mut self.state {
            match ready!(Pin::new(handshake).poll(cx)) {
                Ok(mut serving) => {
                    if self.closing {
                        serving.graceful_shutdown();
                    }
                    self.state = State::Serving(serving);
                }
                Err(e) => {
                    tracing::debug!("request plane: caller connection failed: {e}");
                    self.state = State::Ended;
                }
            }
        }
        let State::Serving(serving) = &mut self.state else {
            return Poll::Ready(());
        };
        for _ in 0..ROUNDS_PER_TURN {
            loop {
                match serving.poll_accept(cx) {
                    Poll::Ready(Some(Ok((request, respond)))) => {
                        let open = self.watched.call_opened();
                        let plane = self.plane.clone();
                        self.calls
                            .start(super::forward::call(plane, request, respond, open));
                    }
                    Poll::Ready(Some(Err(e))) => {
                        tracing::debug!("request plane: caller connection failed: {e}");
                        self.state = State::Ended;
                        return Poll::Ready(());
                    }
                    Poll::Ready(None) => {
                        self.state = State::Ended;
                        return Poll::Ready(());
                    }
                    Poll::Pending => break,
                }
            }
            // What these calls queue is written by the next round's accept.
            if self.calls.run_woken(cx) == 0 {
                return Poll::Pending;
            }
        }
        cx.waker().wake_by_ref();
        Poll::Pending
    }

    /// GOAWAY: no new streams past the ones the caller already sent; the
    /// connection ends once its calls have.
    fn graceful_shutdown(&mut self) {
        match &mut self.state {
            State::Handshaking(_) => self.closing = true,
            State::Serving(serving) => serving.graceful_shutdown(),
            State::Ended => {}
        }
    }
}

/// A connection that closes the way a careful HTTP server closes one:
/// half-close (FIN after the last frame), then read and discard whatever the
/// caller still sends until it closes its side too, for at most [`CLOSE_LINGER`].
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
    /// side, its connection failed, or [`CLOSE_LINGER`] passed.
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.linger.is_none() {
            ready!(Pin::new(&mut this.inner).poll_shutdown(cx))?;
            this.linger = Some(Box::pin(tokio::time::sleep(CLOSE_LINGER)));
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
