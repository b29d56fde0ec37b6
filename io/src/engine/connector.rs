//! How the sidecar connects to the engine: plain TCP without Nagle, and a
//! look at the engine's first SETTINGS frame as it arrives, to learn how many
//! streams one connection may carry (SETTINGS_MAX_CONCURRENT_STREAMS). The
//! request plane opens another engine connection when every open one is at
//! that limit, and keeps each caller below it.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::task::{Context, Poll, ready};

use hyper_util::rt::TokioIo;
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

/// A tonic connector for the engine's address; every connection it makes
/// reports the engine's stream limit to `limit`.
#[derive(Debug, Clone)]
pub struct EngineConnector {
    limit: StreamLimit,
}

impl EngineConnector {
    pub fn new(limit: StreamLimit) -> Self {
        EngineConnector { limit }
    }
}

impl Service<Uri> for EngineConnector {
    type Response = TokioIo<SettingsSpy<TcpStream>>;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<Self::Response>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let limit = self.limit.clone();
        Box::pin(async move {
            let address = uri
                .authority()
                .map(|a| a.as_str().to_string())
                .ok_or_else(|| io::Error::other(format!("no host:port in {uri}")))?;
            let stream = TcpStream::connect(address).await?;
            stream.set_nodelay(true)?;
            Ok(TokioIo::new(SettingsSpy::new(stream, limit)))
        })
    }
}

/// Reads the server's frames until its first SETTINGS frame is complete,
/// records the stream limit, then lets everything pass untouched.
pub struct SettingsSpy<S> {
    inner: S,
    /// `None` once the first SETTINGS frame was read; else the reader, the
    /// payload so far, and its bytes still to come once the frame started.
    reading: Option<(FrameReader, SettingsPayload, Option<u32>)>,
    limit: StreamLimit,
}

impl<S> SettingsSpy<S> {
    fn new(inner: S, limit: StreamLimit) -> Self {
        SettingsSpy {
            inner,
            reading: Some((FrameReader::server_side(), SettingsPayload::default(), None)),
            limit,
        }
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

impl<S: AsyncRead + Unpin> AsyncRead for SettingsSpy<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        let before = buf.filled().len();
        ready!(Pin::new(&mut this.inner).poll_read(cx, buf))?;
        if this.reading.is_some() {
            this.saw(&buf.filled()[before..]);
        }
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for SettingsSpy<S> {
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
            let mut spy = SettingsSpy::new((), limit.clone());
            for chunk in bytes.chunks(split) {
                spy.saw(chunk);
            }
            assert_eq!(limit.get(), Some(20), "split {split}");
            assert!(spy.reading.is_none(), "done after the first SETTINGS");
        }
        let unlimited = StreamLimit::default();
        let mut spy = SettingsSpy::new((), unlimited.clone());
        spy.saw(&frame(kind::SETTINGS, 0, &[]));
        assert_eq!(unlimited.get(), None, "no limit given: unlimited");
        assert!(spy.reading.is_none());
    }
}
