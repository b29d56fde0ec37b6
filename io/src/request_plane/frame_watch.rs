//! Watching one caller connection's HTTP/2 frames as they pass, below h2:
//! how far the handshake got, how many calls are open and since when none
//! has been, and whether the caller floods the connection with frames that
//! cost work but carry none (PING, SETTINGS, PRIORITY, WINDOW_UPDATE,
//! RST_STREAM, empty DATA).
//!
//! The flood budget, per second: `budget` control frames, plus 10 for every
//! frame of real work (a request's HEADERS or DATA, a response's HEADERS or
//! DATA) in that second. A well-behaved caller stays far below it (a PING
//! every few seconds, a WINDOW_UPDATE per window of data). Past it, the
//! connection gets GOAWAY ENHANCE_YOUR_CALM (as h2 and Envoy answer abuse) and
//! is closed; other connections are not touched.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll, ready};
use std::time::{Duration, Instant};

use std::net::IpAddr;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::h2_frames::{ENHANCE_YOUR_CALM, FrameHead, FrameReader, flag, goaway, kind};

/// What a connection's watcher knows, shared with the connection's task and
/// its calls.
#[derive(Debug)]
pub(crate) struct Watched {
    born: Instant,
    /// The caller's preface and first frame have arrived.
    handshake_done: AtomicBool,
    /// Calls open on the connection.
    active: AtomicUsize,
    /// When the connection last went without a call, in ms since `born`.
    idle_since_ms: AtomicU64,
    /// Streams of the sidecar's own health service open on the connection.
    own_health: AtomicUsize,
    /// The caller's address, whose calls share the engine streams fairly
    /// with other addresses' (`engine_streams`).
    address: IpAddr,
}

impl Watched {
    pub(crate) fn new(address: IpAddr) -> Arc<Self> {
        Arc::new(Watched {
            address,
            born: Instant::now(),
            handshake_done: AtomicBool::new(false),
            active: AtomicUsize::new(0),
            idle_since_ms: AtomicU64::new(0),
            own_health: AtomicUsize::new(0),
        })
    }

    pub(crate) fn handshake_done(&self) -> bool {
        self.handshake_done.load(Ordering::Acquire)
    }

    /// A call opened on the connection; it counts as open until the
    /// returned guard is dropped.
    pub(crate) fn call_opened(self: &Arc<Self>) -> OpenCall {
        self.active.fetch_add(1, Ordering::AcqRel);
        OpenCall(self.clone())
    }

    /// How long the connection has had no call open; `None` while one is.
    pub(crate) fn idle_for(&self) -> Option<Duration> {
        if self.active.load(Ordering::Acquire) > 0 {
            return None;
        }
        let since = Duration::from_millis(self.idle_since_ms.load(Ordering::Acquire));
        Some(self.born.elapsed().saturating_sub(since))
    }
}

/// One call open on a connection, for the connection's idle clock.
pub(crate) struct OpenCall(Arc<Watched>);

impl OpenCall {
    /// The call's caller address.
    pub(crate) fn address(&self) -> IpAddr {
        self.0.address
    }

    /// A place for this call among the connection's own-health streams, if
    /// fewer than `cap` are open; held until the guard is dropped.
    pub(crate) fn own_health_slot(&self, cap: usize) -> Option<OwnHealthSlot> {
        let open = &self.0.own_health;
        if open.fetch_add(1, Ordering::AcqRel) >= cap {
            open.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        Some(OwnHealthSlot(self.0.clone()))
    }
}

/// One own-health stream's place on its connection.
pub(crate) struct OwnHealthSlot(Arc<Watched>);

impl Drop for OwnHealthSlot {
    fn drop(&mut self) {
        self.0.own_health.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Drop for OpenCall {
    fn drop(&mut self) {
        let watched = &self.0;
        if watched.active.fetch_sub(1, Ordering::AcqRel) == 1 {
            let ms = watched.born.elapsed().as_millis() as u64;
            watched.idle_since_ms.store(ms, Ordering::Release);
        }
    }
}

/// Control frames against work, per one-second window.
#[derive(Debug)]
struct FloodBudget {
    base: u32,
    window_start: Instant,
    control: u32,
    work: u32,
}

impl FloodBudget {
    /// Frames of real work buy this many control frames each.
    const PER_WORK_FRAME: u32 = 10;
    const WINDOW: Duration = Duration::from_secs(1);

    fn new(base: u32) -> Self {
        FloodBudget {
            base,
            window_start: Instant::now(),
            control: 0,
            work: 0,
        }
    }

    /// Starts a new window if this one is over (checked once per read, not
    /// per frame).
    fn tick(&mut self) {
        if self.window_start.elapsed() >= Self::WINDOW {
            self.window_start = Instant::now();
            self.control = 0;
            self.work = 0;
        }
    }

    fn exceeded(&self) -> bool {
        self.control
            > self
                .base
                .saturating_add(self.work.saturating_mul(Self::PER_WORK_FRAME))
    }
}

/// The socket of one caller connection, watched (see the module doc).
pub(crate) struct FrameWatch<S> {
    inner: S,
    shared: Arc<Watched>,
    inbound: FrameReader,
    outbound: FrameReader,
    budget: FloodBudget,
    /// The highest stream the caller opened: the GOAWAY's last stream id.
    last_stream: u32,
    /// Once flooded: the GOAWAY and how much of it is written; the
    /// connection then ends.
    goaway: Option<([u8; 17], usize)>,
}

impl<S> FrameWatch<S> {
    pub(crate) fn new(inner: S, shared: Arc<Watched>, control_frame_budget: u32) -> Self {
        FrameWatch {
            inner,
            shared,
            inbound: FrameReader::client_side(),
            outbound: FrameReader::server_side(),
            budget: FloodBudget::new(control_frame_budget),
            last_stream: 0,
            goaway: None,
        }
    }

    /// Books what the caller sent.
    fn inbound(&mut self, bytes: &[u8]) {
        let (budget, last_stream) = (&mut self.budget, &mut self.last_stream);
        budget.tick();
        self.inbound.feed(
            bytes,
            |h: FrameHead| {
                match h.kind {
                    kind::HEADERS => {
                        budget.work += 1;
                        *last_stream = (*last_stream).max(h.stream);
                    }
                    kind::DATA if h.len > 0 => budget.work += 1,
                    // A closing empty DATA ends a request; an open one is noise.
                    kind::DATA if h.flags & flag::END_STREAM != 0 => {}
                    kind::CONTINUATION | kind::GOAWAY => {}
                    // PRIORITY, RST_STREAM, SETTINGS, PING, WINDOW_UPDATE, an
                    // open empty DATA, and types nobody defined.
                    _ => budget.control += 1,
                }
                false
            },
            |_| {},
        );
        if !self.shared.handshake_done.load(Ordering::Relaxed)
            && self.inbound.past_preface()
            && (self.budget.work + self.budget.control) > 0
        {
            self.shared.handshake_done.store(true, Ordering::Release);
        }
        if self.goaway.is_none() && self.budget.exceeded() {
            tracing::warn!(
                control_frames = self.budget.control,
                "request plane: a caller sent more control frames than its budget; GOAWAY \
                 ENHANCE_YOUR_CALM and closing that connection"
            );
            self.goaway = Some((goaway(self.last_stream, ENHANCE_YOUR_CALM), 0));
        }
    }

    /// Books what the sidecar sent.
    fn outbound(&mut self, bytes: &[u8]) {
        let budget = &mut self.budget;
        self.outbound.feed(
            bytes,
            |h: FrameHead| {
                if h.kind == kind::HEADERS || (h.kind == kind::DATA && h.len > 0) {
                    budget.work += 1;
                }
                false
            },
            |_| {},
        );
    }
}

fn flooded() -> io::Error {
    io::Error::new(
        io::ErrorKind::ConnectionAborted,
        "caller exceeded its control-frame budget",
    )
}

impl<S: AsyncWrite + Unpin> FrameWatch<S> {
    /// Writes the GOAWAY (only between two of h2's frames), then fails.
    fn poll_goaway(&mut self, cx: &mut Context<'_>) -> Poll<io::Error> {
        if let Some((frame, written)) = self.goaway.as_mut()
            && self.outbound.at_boundary()
        {
            while *written < frame.len() {
                match ready!(Pin::new(&mut self.inner).poll_write(cx, &frame[*written..])) {
                    Ok(0) | Err(_) => return Poll::Ready(flooded()),
                    Ok(n) => *written += n,
                }
            }
            let _ = ready!(Pin::new(&mut self.inner).poll_flush(cx));
        }
        Poll::Ready(flooded())
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for FrameWatch<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.goaway.is_some() {
            return this.poll_goaway(cx).map(Err);
        }
        let before = buf.filled().len();
        ready!(Pin::new(&mut this.inner).poll_read(cx, buf))?;
        this.inbound(&buf.filled()[before..]);
        if this.goaway.is_some() {
            return this.poll_goaway(cx).map(Err);
        }
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for FrameWatch<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        if this.goaway.is_some() {
            return this.poll_goaway(cx).map(Err);
        }
        let n = ready!(Pin::new(&mut this.inner).poll_write(cx, buf))?;
        this.outbound(&buf[..n]);
        Poll::Ready(Ok(n))
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        if this.goaway.is_some() {
            return this.poll_goaway(cx).map(Err);
        }
        let n = ready!(Pin::new(&mut this.inner).poll_write_vectored(cx, bufs))?;
        let mut left = n;
        for slice in bufs {
            if left == 0 {
                break;
            }
            let take = left.min(slice.len());
            this.outbound(&slice[..take]);
            left -= take;
        }
        Poll::Ready(Ok(n))
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
