//! How the sidecar connects to the engine: plain TCP without Nagle, and a
//! look at the engine's first SETTINGS frame as it arrives, to learn how many
//! streams one connection may carry (SETTINGS_MAX_CONCURRENT_STREAMS). The
//! request plane opens another engine connection when every open one is at
//! that limit, and keeps each caller below it.
//!
//! A connection can also be watched: the first time it ends the
//! [`ConnectionWatch`] says how ([`ConnectionEnd`]: after the engine's GOAWAY,
//! closed by the engine, reset, failed, or dropped by the HTTP/2 layer after
//! an unanswered keepalive ping). A watched socket reads every frame head
//! the engine sends for that, and the first 8 bytes of a GOAWAY. For engines whose API carries no identity of
//! their own, that is how a restart or a death is noticed at once, between
//! two health polls. And its reads can be bounded per turn of the task that
//! drives it ([`ReadsPerTurn`]), as the request plane's engine connections
//! are.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::task::{Context, Poll, ready};

use hyper_util::rt::TokioIo;
use llm_sidecar_core::ConnectionEnd;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tonic::codegen::Service;
use tonic::codegen::http::Uri;

use crate::h2_frames::{FrameReader, SETTINGS_MAX_CONCURRENT_STREAMS, SettingsPayload, flag, kind};

/// The engine's stream limit per connection, once its SETTINGS said; `u32::MAX`
/// when it set none (unlimited) or has not said yet.
#[derive(Debug, Clone)]
pub struct StreamLimit(Arc<AtomicU32>);

impl Default for StreamLimit {
    fn default() -> Self {
        StreamLimit(Arc::new(AtomicU32::new(u32::MAX)))
    }
}

impl StreamLimit {
    /// The limit, if the engine has one.
    pub fn get(&self) -> Option<u32> {
        match self.0.load(Ordering::Acquire) {
            u32::MAX => None,
            n => Some(n),
        }
    }

    fn set(&self, value: Option<u32>) {
        self.0.store(value.unwrap_or(u32::MAX), Ordering::Release);
    }
}

/// Says once how a watched connection ended.
#[derive(Debug, Clone)]
pub struct ConnectionWatch(Arc<tokio::sync::watch::Sender<Option<ConnectionEnd>>>);

impl Default for ConnectionWatch {
    fn default() -> Self {
        ConnectionWatch(Arc::new(tokio::sync::watch::channel(None).0))
    }
}

impl ConnectionWatch {
    fn ended(&self, how: impl FnOnce() -> ConnectionEnd) {
        self.0.send_if_modified(|seen| {
            if seen.is_some() {
                return false;
            }
            *seen = Some(how());
            true
        });
    }

    /// Waits until a watched connection ended; how it ended.
    pub async fn wait(&self) -> ConnectionEnd {
        let mut ended = self.0.subscribe();
        let how = match ended.wait_for(Option::is_some).await {
            Ok(how) => how.clone(),
            // The sender lives in `self`: it cannot be gone while we wait.
            Err(_) => None,
        };
        match how {
            Some(how) => how,
            None => std::future::pending().await,
        }
    }
}

/// A tonic connector for the engine's address; every connection it makes
/// reports the engine's stream limit to `limit` and, when watched, its end.
#[derive(Debug, Clone)]
pub struct EngineConnector {
    limit: StreamLimit,
    watch: Option<ConnectionWatch>,
}

impl EngineConnector {
    /// A connector that reports each connection's stream limit to `limit`.
    pub fn new(limit: StreamLimit) -> Self {
        EngineConnector { limit, watch: None }
    }

    /// The connections it makes report their end to `watch`.
    pub fn watched(mut self, watch: ConnectionWatch) -> Self {
        self.watch = Some(watch);
        self
    }
}

impl Service<Uri> for EngineConnector {
    type Response = TokioIo<EngineSocket<TcpStream>>;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<Self::Response>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let (limit, watch) = (self.limit.clone(), self.watch.clone());
        Box::pin(async move {
            let address = uri
                .authority()
                .map(|a| a.as_str().to_string())
                .ok_or_else(|| io::Error::other(format!("no host:port in {uri}")))?;
            let mut spy = open(&address, limit).await?;
            if let Some(watch) = watch {
                spy.inner_mut().watch(watch);
            }
            Ok(spy)
        })
    }
}

/// One TCP connection to the engine at `address` (`host:port`), no Nagle,
/// its first SETTINGS frame read for the stream limit.
pub(crate) async fn open(
    address: &str,
    limit: StreamLimit,
) -> io::Result<TokioIo<EngineSocket<TcpStream>>> {
    let stream = TcpStream::connect(address).await?;
    stream.set_nodelay(true)?;
    Ok(TokioIo::new(EngineSocket::new(stream, limit)))
}

/// How much one turn of the task that drives a connection may read; the task
/// begins each turn with [`ReadsPerTurn::begin`].
#[derive(Debug, Clone)]
pub(crate) struct ReadsPerTurn {
    read: Arc<AtomicUsize>,
    most: usize,
}

impl ReadsPerTurn {
    pub(crate) fn new(most: usize) -> Self {
        ReadsPerTurn {
            read: Arc::default(),
            most,
        }
    }

    /// A turn begins: nothing read in it yet.
    pub(crate) fn begin(&self) {
        self.read.store(0, Ordering::Relaxed);
    }

    fn spent(&self) -> bool {
        self.read.load(Ordering::Relaxed) >= self.most
    }

    fn add(&self, bytes: usize) {
        self.read.fetch_add(bytes, Ordering::Relaxed);
    }
}

/// An engine connection's socket: reads the server's frames until its first
/// SETTINGS frame is complete and records the stream limit, tells its watch
/// how the connection ended, and reads no more than its turn allows;
/// everything passes untouched.
pub struct EngineSocket<S> {
    inner: S,
    /// `None` once the first SETTINGS frame was read; else the reader, the
    /// payload so far, and its bytes still to come once the frame started.
    reading: Option<(FrameReader, SettingsPayload, Option<u32>)>,
    limit: StreamLimit,
    /// Told once how the connection ended, if it is watched.
    watch: Option<ConnectionWatch>,
    /// A watched socket's look at every frame, for the engine's GOAWAY.
    goaway: Option<GoAwayLook>,
    /// Past its allowance, a read waits for the next turn of the task.
    turn: Option<ReadsPerTurn>,
}

impl<S> EngineSocket<S> {
    fn new(inner: S, limit: StreamLimit) -> Self {
        EngineSocket {
            inner,
            reading: Some((FrameReader::server_side(), SettingsPayload::default(), None)),
            limit,
            watch: None,
            goaway: None,
            turn: None,
        }
    }

    /// Tells `watch` how the connection ends.
    fn watch(&mut self, watch: ConnectionWatch) {
        self.watch = Some(watch);
        self.goaway = Some(GoAwayLook::default());
    }

    /// How the connection ended, given what the socket saw last: a GOAWAY
    /// the engine sent before explains any end that follows it.
    fn end(&self, otherwise: impl FnOnce() -> ConnectionEnd) -> impl FnOnce() -> ConnectionEnd {
        let said = self.goaway.as_ref().and_then(|g| g.code);
        move || match said {
            Some(code) => ConnectionEnd::GoAway { code },
            None => otherwise(),
        }
    }

    /// Reads at most `turn`'s allowance per turn of the task polling it.
    pub(crate) fn reads_per_turn(mut self, turn: ReadsPerTurn) -> Self {
        self.turn = Some(turn);
        self
    }

    fn saw(&mut self, bytes: &[u8]) {
        use std::cell::Cell;
        let Some((reader, payload, left_before)) = self.reading.as_mut() else {
            return;
        };
        // Payload bytes of the first SETTINGS frame still to come; `Some(0)`
        // once it is complete (other frames may follow it in the same chunk).
        let left: Cell<Option<u32>> = Cell::new(*left_before);
        reader.feed(
            bytes,
            |h| {
                let first =
                    left.get().is_none() && h.kind == kind::SETTINGS && h.flags & flag::ACK == 0;
                if first {
                    left.set(Some(h.len));
                }
                first
            },
            |p| {
                payload.push(p);
                left.set(left.get().map(|l| l.saturating_sub(p.len() as u32)));
            },
        );
        *left_before = left.get();
        if left.get() == Some(0) {
            self.limit
                .set(payload.value(SETTINGS_MAX_CONCURRENT_STREAMS));
            self.reading = None;
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for EngineSocket<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.turn.as_ref().is_some_and(ReadsPerTurn::spent) {
            // Not now: the rest of this turn first, then another one.
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        let before = buf.filled().len();
        let read = ready!(Pin::new(&mut this.inner).poll_read(cx, buf));
        if let Some(turn) = &this.turn {
            turn.add(buf.filled().len() - before);
        }
        if let Ok(()) = &read {
            if this.reading.is_some() {
                this.saw(&buf.filled()[before..]);
            }
            if let Some(look) = this.goaway.as_mut() {
                look.saw(&buf.filled()[before..]);
            }
        }
        if let Some(watch) = &this.watch {
            match &read {
                Err(e) if e.kind() == io::ErrorKind::ConnectionReset => {
                    watch.ended(this.end(|| ConnectionEnd::Reset));
                }
                Err(e) => {
                    let error = e.to_string();
                    watch.ended(this.end(|| ConnectionEnd::Failed { error }));
                }
                Ok(()) if buf.filled().len() == before && buf.remaining() > 0 => {
                    watch.ended(this.end(|| ConnectionEnd::Closed));
                }
                Ok(()) => {}
            }
        }
        read?;
        Poll::Ready(Ok(()))
    }
}

impl<S> Drop for EngineSocket<S> {
    fn drop(&mut self) {
        if let Some(watch) = &self.watch {
            // Dropped without an end from the engine: after its GOAWAY, the
            // HTTP/2 layer closing the connection it said it would stop
            // serving; else the HTTP/2 layer gave up on it (a keepalive ping
            // went unanswered: a frozen engine).
            watch.ended(self.end(|| ConnectionEnd::KeepaliveTimeout));
        }
    }
}

/// A watched socket's reading of the engine's frames: the error code of the
/// last GOAWAY it sent, once its first 8 payload bytes arrived.
struct GoAwayLook {
    reader: FrameReader,
    payload: Vec<u8>,
    code: Option<u32>,
}

impl Default for GoAwayLook {
    fn default() -> Self {
        GoAwayLook {
            reader: FrameReader::server_side(),
            payload: Vec::new(),
            code: None,
        }
    }
}

impl GoAwayLook {
    fn saw(&mut self, bytes: &[u8]) {
        use std::cell::RefCell;
        // Last-stream-id (4 bytes), then the error code (4 bytes).
        const HEAD: usize = 8;
        let payload = RefCell::new(std::mem::take(&mut self.payload));
        self.reader.feed(
            bytes,
            |h| {
                let goaway = h.kind == kind::GOAWAY;
                if goaway {
                    payload.borrow_mut().clear();
                }
                goaway
            },
            |p| {
                let mut held = payload.borrow_mut();
                let room = HEAD.saturating_sub(held.len());
                held.extend_from_slice(&p[..p.len().min(room)]);
            },
        );
        self.payload = payload.into_inner();
        if let Ok(code) = <[u8; 4]>::try_from(self.payload.get(4..HEAD).unwrap_or_default()) {
            self.code = Some(u32::from_be_bytes(code));
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for EngineSocket<S> {
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

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(kind: u8, flags: u8, payload: &[u8]) -> Vec<u8> {
        let mut f = (payload.len() as u32).to_be_bytes()[1..].to_vec();
        f.extend([kind, flags, 0, 0, 0, 0]);
        f.extend(payload);
        f
    }

    #[test]
    fn the_stream_limit_is_read_from_the_first_settings_frame_whatever_follows_it() {
        let mut settings = SETTINGS_MAX_CONCURRENT_STREAMS.to_be_bytes().to_vec();
        settings.extend(20u32.to_be_bytes());
        let mut bytes = frame(kind::SETTINGS, 0, &settings);
        bytes.extend(frame(0x8, 0, &[0, 0, 0, 1]));
        bytes.extend(frame(kind::SETTINGS, flag::ACK, &[]));
        for split in 1..=bytes.len() {
            let limit = StreamLimit::default();
            let mut spy = EngineSocket::new((), limit.clone());
            for chunk in bytes.chunks(split) {
                spy.saw(chunk);
            }
            assert_eq!(limit.get(), Some(20), "split {split}");
            assert!(spy.reading.is_none(), "done after the first SETTINGS");
        }
        let unlimited = StreamLimit::default();
        let mut spy = EngineSocket::new((), unlimited.clone());
        spy.saw(&frame(kind::SETTINGS, 0, &[]));
        assert_eq!(unlimited.get(), None, "no limit given: unlimited");
        assert!(spy.reading.is_none());
    }

    /// A socket whose reads are scripted: each item one read.
    struct Scripted(std::collections::VecDeque<io::Result<Vec<u8>>>);

    impl AsyncRead for Scripted {
        fn poll_read(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            match self.0.pop_front() {
                Some(Ok(bytes)) => {
                    buf.put_slice(&bytes);
                    Poll::Ready(Ok(()))
                }
                Some(Err(e)) => Poll::Ready(Err(e)),
                None => Poll::Pending,
            }
        }
    }

    fn goaway(code: u32) -> Vec<u8> {
        let mut payload = 7u32.to_be_bytes().to_vec();
        payload.extend(code.to_be_bytes());
        payload.extend(b"debug data");
        frame(kind::GOAWAY, 0, &payload)
    }

    #[test]
    fn a_goaway_code_is_read_however_the_frame_is_split() {
        let mut bytes = frame(kind::SETTINGS, 0, &[]);
        bytes.extend(frame(0x6, 0, &[0; 8]));
        bytes.extend(goaway(11));
        for split in 1..=bytes.len() {
            let mut look = GoAwayLook::default();
            for chunk in bytes.chunks(split) {
                look.saw(chunk);
            }
            assert_eq!(look.code, Some(11), "split {split}");
        }
    }

    /// Reads the script to its end (or its first error), then drops the
    /// socket; how its watch says the connection ended.
    fn end_of(script: Vec<io::Result<Vec<u8>>>) -> ConnectionEnd {
        let watch = ConnectionWatch::default();
        let mut socket = EngineSocket::new(Scripted(script.into()), StreamLimit::default());
        socket.watch(watch.clone());
        let waker = std::task::Waker::noop();
        let mut cx = Context::from_waker(waker);
        let mut space = [0u8; 256];
        loop {
            let mut buf = ReadBuf::new(&mut space);
            match Pin::new(&mut socket).poll_read(&mut cx, &mut buf) {
                Poll::Ready(Ok(())) if buf.filled().is_empty() => break,
                Poll::Ready(Ok(())) => {}
                Poll::Ready(Err(_)) | Poll::Pending => break,
            }
        }
        drop(socket);
        let seen = watch.0.borrow().clone();
        seen.expect("the watch was told")
    }

    #[test]
    fn a_watched_connection_says_how_it_ended() {
        let settings = frame(kind::SETTINGS, 0, &[]);
        let reset = || io::Error::from(io::ErrorKind::ConnectionReset);
        let cases = [
            (
                vec![Ok(settings.clone()), Ok(vec![])],
                ConnectionEnd::Closed,
            ),
            (
                vec![Ok(settings.clone()), Ok(goaway(0)), Ok(vec![])],
                ConnectionEnd::GoAway { code: 0 },
            ),
            (
                vec![Ok(settings.clone()), Err(reset())],
                ConnectionEnd::Reset,
            ),
            (
                vec![Ok(settings.clone()), Ok(goaway(0)), Err(reset())],
                ConnectionEnd::GoAway { code: 0 },
            ),
            (
                vec![Ok(settings.clone()), Err(io::Error::other("boom"))],
                ConnectionEnd::Failed {
                    error: "boom".into(),
                },
            ),
            // Dropped by the HTTP/2 layer with nothing from the engine.
            (vec![Ok(settings.clone())], ConnectionEnd::KeepaliveTimeout),
            // Dropped after the engine's GOAWAY: the stop it said.
            (
                vec![Ok(settings.clone()), Ok(goaway(0))],
                ConnectionEnd::GoAway { code: 0 },
            ),
        ];
        for (script, end) in cases {
            assert_eq!(end_of(script), end);
        }
    }
}
