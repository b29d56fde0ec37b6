//! The request plane: a byte-level gRPC proxy in front of the engine.
//!
//! Every call on `--listen` is forwarded to the engine as it came: headers and
//! metadata, the message stream and the trailers pass through frame by frame,
//! never decoded. The proxy adds only what the lifecycle needs:
//!
//! - admission through the core's [`Gate`]: a refused call gets UNAVAILABLE
//!   "draining" and never reaches the engine;
//! - in-flight accounting: an admitted call counts until its response ends or is
//!   dropped (a caller's cancel drops the engine stream, which resets it);
//! - the cut at the drain deadline (UNAVAILABLE trailers to the caller, a reset
//!   to the engine), and `grpc-timeout` enforced on the sidecar side as well;
//! - message size limits, read from the 5-byte gRPC message prefix;
//! - the sidecar's own `grpc.health.v1`, and the engine's health RPC answered
//!   locally whenever the worker is not Serving.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body as HttpBody, Frame};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use llm_sidecar_core::gate::Gate;
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};
use tonic::Code;
use tonic::body::Body;
use tonic::codegen::Service;
use tonic::transport::Channel;

/// Counters of the request plane, for `/metrics`.
#[derive(Debug, Default)]
pub(crate) struct ProxyMetrics {
    pub(crate) admitted: AtomicU64,
    pub(crate) refused: AtomicU64,
    pub(crate) cancelled_by_caller: AtomicU64,
    pub(crate) cut_at_deadline: AtomicU64,
    pub(crate) deadline_exceeded: AtomicU64,
    pub(crate) too_large: AtomicU64,
    pub(crate) engine_unreachable: AtomicU64,
    pub(crate) bytes_to_engine: AtomicU64,
    pub(crate) bytes_to_caller: AtomicU64,
}

/// Limits on what a caller may send.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Largest gRPC message, either direction, in bytes.
    pub max_message_bytes: u32,
    /// Concurrent streams per caller connection.
    pub max_concurrent_streams: u32,
    /// Largest header list a caller may send, in bytes.
    pub max_header_list_bytes: u32,
}

/// Everything the request handlers share.
pub(crate) struct Plane {
    pub(crate) gate: Gate,
    /// The sidecar's own health is SERVING.
    pub(crate) serving: AtomicBool,
    /// Fires at the drain deadline: every call still in flight is cut.
    pub(crate) cut: CancellationToken,
    /// Woken when the last call leaves a closed gate.
    pub(crate) drained: Notify,
    pub(crate) metrics: ProxyMetrics,
    pub(crate) engine: Channel,
    pub(crate) health: tonic_health::pb::health_server::HealthServer<crate::own_health::OwnHealth>,
    pub(crate) health_rpc_path: &'static str,
    pub(crate) limits: Limits,
}

/// A response with only a status: HTTP 200, `grpc-status` in the headers.
fn status_response(code: Code, message: &str) -> http::Response<Body> {
    tonic::Status::new(code, message).into_http()
}

/// Parses `grpc-timeout` (`<digits><unit>`, unit H M S m u n).
fn grpc_timeout(headers: &http::HeaderMap) -> Option<Duration> {
    let v = headers.get("grpc-timeout")?.to_str().ok()?;
    if v.len() < 2 || v.len() > 9 {
        return None;
    }
    let (digits, unit) = v.split_at(v.len() - 1);
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.saturating_mul(3600)),
        "M" => Duration::from_secs(n.saturating_mul(60)),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// Serves the request plane on `listener` until `cancel` fires.
pub(crate) async fn serve(
    listener: TcpListener,
    plane: Arc<Plane>,
    cancel: CancellationToken,
    connections: tokio_util::task::TaskTracker,
) {
    loop {
        let accepted = tokio::select! {
            () = cancel.cancelled() => return,
            accepted = listener.accept() => accepted,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) => {
                tracing::warn!("request plane: accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let plane = plane.clone();
        let cancel = cancel.clone();
        connections.spawn(async move {
            let limits = plane.limits;
            let service = service_fn(move |req| handle(plane.clone(), req));
            let conn = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                .max_concurrent_streams(limits.max_concurrent_streams)
                .max_header_list_size(limits.max_header_list_bytes)
                .initial_stream_window_size(1 << 20)
                .initial_connection_window_size(4 << 20)
                .serve_connection(TokioIo::new(stream), service);
            let mut conn = std::pin::pin!(conn);
            tokio::select! {
                // Garbage, HTTP/1 or a protocol error ends this connection only.
                _ = conn.as_mut() => return,
                () = cancel.cancelled() => {}
            }
            // Exiting: GOAWAY, let the last frames (trailers) reach the caller.
            conn.as_mut().graceful_shutdown();
            let _ = tokio::time::timeout(Duration::from_secs(2), conn).await;
        });
    }
}

async fn handle(
    plane: Arc<Plane>,
    req: http::Request<Incoming>,
) -> Result<http::Response<Body>, Infallible> {
    let path = req.uri().path();
    if path.starts_with("/grpc.health.v1.Health/") {
        let mut health = plane.health.clone();
        return Ok(match health.call(req).await {
            Ok(response) => response,
            Err(never) => match never {},
        });
    }
    if path == plane.health_rpc_path && !plane.serving.load(Ordering::Acquire) {
        plane.metrics.refused.fetch_add(1, Ordering::Relaxed);
        return Ok(status_response(Code::Unavailable, "draining"));
    }
    if !plane.gate.try_enter() {
        plane.metrics.refused.fetch_add(1, Ordering::Relaxed);
        return Ok(status_response(Code::Unavailable, "draining"));
    }
    plane.metrics.admitted.fetch_add(1, Ordering::Relaxed);
    let guard = InFlight {
        plane: plane.clone(),
        ended: false,
        bytes: 0,
    };
    Ok(forward(plane, req, guard).await)
}

/// Why a call ended early, shared by the request and response bodies.
#[derive(Default)]
struct Verdict {
    too_large: AtomicBool,
}

async fn forward(
    plane: Arc<Plane>,
    req: http::Request<Incoming>,
    mut guard: InFlight,
) -> http::Response<Body> {
    let deadline = grpc_timeout(req.headers()).map(|d| tokio::time::Instant::now() + d);
    let verdict = Arc::new(Verdict::default());
    let (parts, incoming) = req.into_parts();
    let request_body = RequestBody {
        inner: incoming,
        plane: plane.clone(),
        limiter: Limiter::new(plane.limits.max_message_bytes),
        verdict: verdict.clone(),
        bytes: 0,
    };
    let request = http::Request::from_parts(parts, Body::new(request_body));
    let mut engine = plane.engine.clone();
    let call = async move {
        std::future::poll_fn(|cx| engine.poll_ready(cx)).await?;
        engine.call(request).await
    };
    let until_deadline = async {
        match deadline {
            Some(at) => tokio::time::sleep_until(at).await,
            None => std::future::pending().await,
        }
    };
    let response = tokio::select! {
        response = call => response,
        () = plane.cut.cancelled() => {
            plane.metrics.cut_at_deadline.fetch_add(1, Ordering::Relaxed);
            guard.ended = true;
            return status_response(Code::Unavailable, "drain deadline reached; retry on another worker");
        }
        () = until_deadline => {
            plane.metrics.deadline_exceeded.fetch_add(1, Ordering::Relaxed);
            guard.ended = true;
            return status_response(Code::DeadlineExceeded, "deadline exceeded (grpc-timeout)");
        }
    };
    match response {
        Ok(response) => {
            let (parts, body) = response.into_parts();
            let body = ResponseBody {
                inner: Some(body),
                cut: Box::pin(plane.cut.clone().cancelled_owned()),
                deadline: deadline.map(|at| Box::pin(tokio::time::sleep_until(at))),
                limiter: Limiter::new(plane.limits.max_message_bytes),
                verdict,
                guard,
            };
            http::Response::from_parts(parts, Body::new(body))
        }
        Err(e) => {
            guard.ended = true;
            if verdict.too_large.load(Ordering::Acquire) {
                plane.metrics.too_large.fetch_add(1, Ordering::Relaxed);
                return status_response(
                    Code::ResourceExhausted,
                    &too_large_message(plane.limits.max_message_bytes),
                );
            }
            plane
                .metrics
                .engine_unreachable
                .fetch_add(1, Ordering::Relaxed);
            let text = crate::engine::error_chain(&e);
            status_response(Code::Unavailable, &format!("engine unavailable: {text}"))
        }
    }
}

fn too_large_message(limit: u32) -> String {
    format!("message larger than the sidecar's limit of {limit} bytes")
}

/// An admitted call. Leaving the gate when dropped keeps the count exact
/// whatever ends the call: its end, a caller's cancel, a cut, a panic.
struct InFlight {
    plane: Arc<Plane>,
    /// The call ended on its own terms (not dropped half-way by the caller).
    ended: bool,
    /// Response bytes forwarded, added to the shared counter once, at the end.
    bytes: u64,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.plane
            .metrics
            .bytes_to_caller
            .fetch_add(self.bytes, Ordering::Relaxed);
        if !self.ended {
            self.plane
                .metrics
                .cancelled_by_caller
                .fetch_add(1, Ordering::Relaxed);
        }
        if self.plane.gate.leave().drained {
            self.plane.drained.notify_one();
        }
    }
}

/// Reads gRPC message prefixes (1 flag byte, 4 length bytes) across chunks and
/// refuses a message longer than the limit; the payload is never copied.
struct Limiter {
    limit: u32,
    header: [u8; 5],
    header_len: usize,
    payload_left: u64,
}

impl Limiter {
    fn new(limit: u32) -> Self {
        Limiter {
            limit,
            header: [0; 5],
            header_len: 0,
            payload_left: 0,
        }
    }

    /// Feeds one chunk; `Err(len)` if a message declares more than the limit.
    fn feed(&mut self, mut chunk: &[u8]) -> Result<(), u32> {
        while !chunk.is_empty() {
            if self.payload_left > 0 {
                let take = (chunk.len() as u64).min(self.payload_left);
                self.payload_left -= take;
                chunk = &chunk[take as usize..];
                continue;
            }
            let take = (5 - self.header_len).min(chunk.len());
            self.header[self.header_len..self.header_len + take].copy_from_slice(&chunk[..take]);
            self.header_len += take;
            chunk = &chunk[take..];
            if self.header_len == 5 {
                let len = u32::from_be_bytes([
                    self.header[1],
                    self.header[2],
                    self.header[3],
                    self.header[4],
                ]);
                if len > self.limit {
                    return Err(len);
                }
                self.payload_left = u64::from(len);
                self.header_len = 0;
            }
        }
        Ok(())
    }
}

/// The caller's request stream on its way to the engine.
struct RequestBody {
    inner: Incoming,
    plane: Arc<Plane>,
    limiter: Limiter,
    verdict: Arc<Verdict>,
    /// Bytes forwarded, added to the shared counter once, when the body is dropped:
    /// a shared atomic per frame would bounce its cache line between cores.
    bytes: u64,
}

impl Drop for RequestBody {
    fn drop(&mut self) {
        self.plane
            .metrics
            .bytes_to_engine
            .fetch_add(self.bytes, Ordering::Relaxed);
    }
}

impl HttpBody for RequestBody {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        match ready!(Pin::new(&mut this.inner).poll_frame(cx)) {
            Some(Ok(frame)) => {
                if let Some(data) = frame.data_ref() {
                    this.plane
                        .metrics
                        .bytes_to_engine
                        .fetch_add(data.len() as u64, Ordering::Relaxed);
                    if this.limiter.feed(data).is_err() {
                        this.verdict.too_large.store(true, Ordering::Release);
                        // Failing the body resets the engine stream; the caller gets
                        // RESOURCE_EXHAUSTED from `forward` or the response body.
                        return Poll::Ready(Some(Err("request message too large".into())));
                    }
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Some(Err(e)) => Poll::Ready(Some(Err(Box::new(e)))),
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// The engine's response stream on its way to the caller.
struct ResponseBody {
    /// `None` once the call is over (the engine stream is dropped, i.e. reset).
    inner: Option<Body>,
    cut: Pin<Box<WaitForCancellationFutureOwned>>,
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
    limiter: Limiter,
    verdict: Arc<Verdict>,
    guard: InFlight,
}

impl ResponseBody {
    /// Ends the call with a status in the trailers, dropping the engine stream.
    fn end_with(
        &mut self,
        code: Code,
        message: &str,
    ) -> Poll<Option<Result<Frame<Bytes>, tonic::Status>>> {
        self.inner = None;
        self.guard.ended = true;
        let mut trailers = http::HeaderMap::new();
        let _ = tonic::Status::new(code, message).add_header(&mut trailers);
        Poll::Ready(Some(Ok(Frame::trailers(trailers))))
    }
}

impl HttpBody for ResponseBody {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, tonic::Status>>> {
        let this = &mut *self;
        if this.inner.is_none() {
            return Poll::Ready(None);
        }
        if this.cut.as_mut().poll(cx).is_ready() {
            this.guard
                .plane
                .metrics
                .cut_at_deadline
                .fetch_add(1, Ordering::Relaxed);
            return this.end_with(
                Code::Unavailable,
                "drain deadline reached; retry on another worker",
            );
        }
        if let Some(deadline) = this.deadline.as_mut()
            && deadline.as_mut().poll(cx).is_ready()
        {
            this.guard
                .plane
                .metrics
                .deadline_exceeded
                .fetch_add(1, Ordering::Relaxed);
            return this.end_with(Code::DeadlineExceeded, "deadline exceeded (grpc-timeout)");
        }
        let Some(inner) = this.inner.as_mut() else {
            return Poll::Ready(None);
        };
        match ready!(Pin::new(inner).poll_frame(cx)) {
            Some(Ok(frame)) => {
                if let Some(data) = frame.data_ref() {
                    this.guard.bytes += data.len() as u64;
                    if this.limiter.feed(data).is_err() {
                        this.guard
                            .plane
                            .metrics
                            .too_large
                            .fetch_add(1, Ordering::Relaxed);
                        let limit = this.limiter.limit;
                        return this.end_with(Code::ResourceExhausted, &too_large_message(limit));
                    }
                } else if frame.is_trailers() {
                    this.inner = None;
                    this.guard.ended = true;
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Some(Err(status)) => {
                if this.verdict.too_large.load(Ordering::Acquire) {
                    this.guard
                        .plane
                        .metrics
                        .too_large
                        .fetch_add(1, Ordering::Relaxed);
                    let limit = this.limiter.limit;
                    return this.end_with(Code::ResourceExhausted, &too_large_message(limit));
                }
                // The engine connection broke mid-call: retryable elsewhere.
                let message = format!("engine stream failed: {}", status.message());
                this.end_with(Code::Unavailable, &message)
            }
            None => {
                this.inner = None;
                this.guard.ended = true;
                Poll::Ready(None)
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeouts_parse() {
        let mut h = http::HeaderMap::new();
        for (v, want) in [
            ("5S", Duration::from_secs(5)),
            ("250m", Duration::from_millis(250)),
            ("1H", Duration::from_secs(3600)),
        ] {
            h.insert("grpc-timeout", v.parse().unwrap());
            assert_eq!(grpc_timeout(&h), Some(want));
        }
        for bad in ["", "S", "5", "5x", "1234567890S"] {
            h.insert("grpc-timeout", bad.parse().unwrap());
            assert_eq!(grpc_timeout(&h), None, "{bad:?}");
        }
    }

    #[test]
    fn limiter_reads_prefixes_across_chunks() {
        let mut l = Limiter::new(10);
        let msg = |n: u32| {
            let mut v = vec![0u8];
            v.extend_from_slice(&n.to_be_bytes());
            v.extend(std::iter::repeat_n(7u8, n as usize));
            v
        };
        let mut stream = msg(10);
        stream.extend(msg(3));
        for chunk in stream.chunks(3) {
            assert_eq!(l.feed(chunk), Ok(()));
        }
        let big = msg(11);
        assert_eq!(l.feed(&big[..2]), Ok(()));
        assert_eq!(l.feed(&big[2..]), Err(11));
    }
}
