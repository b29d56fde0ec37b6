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
    /// `None` once the first SETTINGS frame was read.
    reading: Option<(FrameReader, SettingsPayload, bool)>,
    limit: StreamLimit,
}

impl<S> SettingsSpy<S> {
    fn new(inner: S, limit: StreamLimit) -> Self {
        SettingsSpy {
            inner,
            reading: Some((
                FrameReader::server_side(),
                SettingsPayload::default(),
                false,
            )),
            limit,
        }
    }

    fn saw(&mut self, bytes: &[u8]) {
        let Some((reader, payload, in_settings)) = self.reading.as_mut() else {
            return;
        };
        reader.feed(
            bytes,
            |h| {
                *in_settings = h.kind == kind::SETTINGS && h.flags & flag::ACK == 0;
                *in_settings
            },
            |p| payload.push(p),
        );
        if *in_settings && reader.at_boundary() {
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
