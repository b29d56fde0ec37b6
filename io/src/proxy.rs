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

/// How a call on the request plane ended. Every call that reaches the proxy ends
/// in exactly one of these, so the sidecar's account reconciles with what the
/// callers and the engine saw (docs/RELIABILITY.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// Forwarded; the engine ended it with OK.
    Ok,
    /// Forwarded; the engine ended it with a status of its own, passed unchanged.
    EngineStatus,
    /// Admission was closed: UNAVAILABLE "draining", never forwarded.
    Refused,
    /// The caller went away (cancel, reset) before the call ended.
    CancelledByCaller,
    /// Still running at the drain deadline: UNAVAILABLE to the caller, reset to the engine.
    CutAtDeadline,
    /// The caller's `grpc-timeout` passed: DEADLINE_EXCEEDED.
    DeadlineExceeded,
    /// A message above `--max-message-bytes`: RESOURCE_EXHAUSTED.
    TooLarge,
    /// The engine could not be reached: UNAVAILABLE, retryable elsewhere.
    EngineUnreachable,
    /// The engine connection broke mid-call: UNAVAILABLE, retryable elsewhere.
    EngineFailed,
}

impl Outcome {
    /// Every outcome, in the order the metrics and the exit account list them.
    pub(crate) const ALL: [Outcome; 9] = [
        Outcome::Ok,
        Outcome::EngineStatus,
        Outcome::Refused,
        Outcome::CancelledByCaller,
        Outcome::CutAtDeadline,
        Outcome::DeadlineExceeded,
        Outcome::TooLarge,
        Outcome::EngineUnreachable,
        Outcome::EngineFailed,
    ];

    /// The metric label and the key in the exit account.
    pub(crate) fn label(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::EngineStatus => "engine_status",
            Outcome::Refused => "refused",
            Outcome::CancelledByCaller => "cancelled_by_caller",
            Outcome::CutAtDeadline => "cut_at_deadline",
            Outcome::DeadlineExceeded => "deadline_exceeded",
            Outcome::TooLarge => "too_large",
            Outcome::EngineUnreachable => "engine_unreachable",
            Outcome::EngineFailed => "engine_failed",
        }
    }

    /// The outcome a `grpc-status` value from the engine means.
    fn of_engine_status(value: Option<&http::HeaderValue>) -> Outcome {
        match value.map(http::HeaderValue::as_bytes) {
            Some(b"0") => Outcome::Ok,
            _ => Outcome::EngineStatus,
        }
    }
}

/// Counters of the request plane, for `/metrics` and the account at exit.
#[derive(Debug, Default)]
pub(crate) struct ProxyMetrics {
    /// Calls let through the gate (forwarded or about to be).
    pub(crate) admitted: AtomicU64,
    /// Calls ended, indexed like [`Outcome::ALL`].
    ended: [AtomicU64; Outcome::ALL.len()],
    pub(crate) bytes_to_engine: AtomicU64,
    pub(crate) bytes_to_caller: AtomicU64,
}

impl ProxyMetrics {
    fn record(&self, outcome: Outcome) {
        self.ended[outcome as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Calls that ended with `outcome` so far.
    pub(crate) fn ended(&self, outcome: Outcome) -> u64 {
        self.ended[outcome as usize].load(Ordering::Relaxed)
    }

    /// One line with every counter, `key=value`, for the log at exit: the
    /// sidecar's side of the reconciliation once its `/metrics` is gone.
    pub(crate) fn account(&self) -> String {
        let mut line = format!("admitted={}", self.admitted.load(Ordering::Relaxed));
        for outcome in Outcome::ALL {
            line.push_str(&format!(" {}={}", outcome.label(), self.ended(outcome)));
        }
        line
    }
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

/// How long a caller gets to finish the TLS handshake.
const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves the request plane on `listener` until `cancel` fires, over TLS when
/// `tls` is set.
pub(crate) async fn serve(
    listener: TcpListener,
    tls: Option<crate::tls::ServerTls>,
    plane: Arc<Plane>,
    cancel: CancellationToken,
    connections: tokio_util::task::TaskTracker,
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
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let stream = crate::net::LingeringClose::new(stream);
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
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let limits = plane.limits;
    let service = service_fn(move |req| handle(plane.clone(), req));
    let conn = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
        .max_concurrent_streams(limits.max_concurrent_streams)
        .max_header_list_size(limits.max_header_list_bytes)
        .initial_stream_window_size(1 << 20)
        .initial_connection_window_size(4 << 20)
        .serve_connection(TokioIo::new(io), service);
    let mut conn = std::pin::pin!(conn);
    tokio::select! {
        // Garbage, HTTP/1 or a protocol error ends this connection only.
        _ = conn.as_mut() => return,
        () = cancel.cancelled() => {}
    }
    // Exiting: GOAWAY, let the last frames (trailers) reach the caller.
    conn.as_mut().graceful_shutdown();
    let _ = tokio::time::timeout(Duration::from_secs(2), conn).await;
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
    if (path == plane.health_rpc_path && !plane.serving.load(Ordering::Acquire))
        || !plane.gate.try_enter()
    {
        return Ok(refuse(&plane, req.into_body()).await);
    }
    plane.metrics.admitted.fetch_add(1, Ordering::Relaxed);
    let guard = InFlight {
        plane: plane.clone(),
        outcome: None,
        bytes: 0,
    };
    Ok(forward(plane, req, guard).await)
}

/// How long a refused call's request may take to arrive before it is answered.
const REFUSED_BODY_WAIT: Duration = Duration::from_millis(250);

/// Answers a call that admission refused: UNAVAILABLE "draining", never forwarded.
///
/// The request is read to its end first. Answering while the caller is still
/// sending makes HTTP/2 reset the stream, and h2 counts those resets: past 1,024
/// on one connection it sends GOAWAY ENHANCE_YOUR_CALM, which would kill the
/// calls still draining on that connection (a router retrying into a draining
/// worker reaches that in seconds). A request that does not end within a short
/// wait, or grows past the message limit, is answered anyway.
async fn refuse(plane: &Plane, mut body: Incoming) -> http::Response<Body> {
    plane.metrics.record(Outcome::Refused);
    let limit = u64::from(plane.limits.max_message_bytes) + 5;
    let read_to_end = async {
        let mut read: u64 = 0;
        while let Some(Ok(frame)) =
            std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await
        {
            read += frame.data_ref().map_or(0, |d| d.len() as u64);
            if read > limit {
                break;
            }
        }
    };
    let _ = tokio::time::timeout(REFUSED_BODY_WAIT, read_to_end).await;
    status_response(Code::Unavailable, "draining")
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
            guard.outcome = Some(Outcome::CutAtDeadline);
            return status_response(Code::Unavailable, "drain deadline reached; retry on another worker");
        }
        () = until_deadline => {
            guard.outcome = Some(Outcome::DeadlineExceeded);
            return status_response(Code::DeadlineExceeded, "deadline exceeded (grpc-timeout)");
        }
    };
    match response {
        Ok(response) => {
            let (parts, body) = response.into_parts();
            // A trailers-only response carries its status in the headers.
            let status_in_headers = parts
                .headers
                .contains_key("grpc-status")
                .then(|| Outcome::of_engine_status(parts.headers.get("grpc-status")));
            let body = ResponseBody {
                inner: Some(body),
                status_in_headers,
                cut: Box::pin(plane.cut.clone().cancelled_owned()),
                deadline: deadline.map(|at| Box::pin(tokio::time::sleep_until(at))),
                limiter: Limiter::new(plane.limits.max_message_bytes),
                verdict,
                guard,
            };
            http::Response::from_parts(parts, Body::new(body))
        }
        Err(e) => {
            if verdict.too_large.load(Ordering::Acquire) {
                guard.outcome = Some(Outcome::TooLarge);
                return status_response(
                    Code::ResourceExhausted,
                    &too_large_message(plane.limits.max_message_bytes),
                );
            }
            guard.outcome = Some(Outcome::EngineUnreachable);
            let text = crate::engine::error_chain(&e);
            status_response(Code::Unavailable, &format!("engine unavailable: {text}"))
        }
    }
}

fn too_large_message(limit: u32) -> String {
    format!("message larger than the sidecar's limit of {limit} bytes")
}

/// An admitted call. Leaving the gate and recording the outcome when dropped
/// keeps both counts exact whatever ends the call: its end, a caller's cancel, a
/// cut, a panic.
struct InFlight {
    plane: Arc<Plane>,
    /// How the call ended; `None` when it is dropped half-way, i.e. the caller left.
    outcome: Option<Outcome>,
    /// Response bytes forwarded, added to the shared counter once, at the end.
    bytes: u64,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.plane
            .metrics
            .bytes_to_caller
            .fetch_add(self.bytes, Ordering::Relaxed);
        self.plane
            .metrics
            .record(self.outcome.unwrap_or(Outcome::CancelledByCaller));
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
                    this.bytes += data.len() as u64;
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
    /// The engine's status if it came in the response headers (trailers-only).
    status_in_headers: Option<Outcome>,
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
        outcome: Outcome,
        code: Code,
        message: &str,
    ) -> Poll<Option<Result<Frame<Bytes>, tonic::Status>>> {
        self.inner = None;
        self.guard.outcome = Some(outcome);
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
            return this.end_with(
                Outcome::CutAtDeadline,
                Code::Unavailable,
                "drain deadline reached; retry on another worker",
            );
        }
        if let Some(deadline) = this.deadline.as_mut()
            && deadline.as_mut().poll(cx).is_ready()
        {
            return this.end_with(
                Outcome::DeadlineExceeded,
                Code::DeadlineExceeded,
                "deadline exceeded (grpc-timeout)",
            );
        }
        let Some(inner) = this.inner.as_mut() else {
            return Poll::Ready(None);
        };
        match ready!(Pin::new(inner).poll_frame(cx)) {
            Some(Ok(frame)) => {
                if let Some(data) = frame.data_ref() {
                    this.guard.bytes += data.len() as u64;
                    if this.limiter.feed(data).is_err() {
                        let limit = this.limiter.limit;
                        return this.end_with(
                            Outcome::TooLarge,
                            Code::ResourceExhausted,
                            &too_large_message(limit),
                        );
                    }
                } else if let Some(trailers) = frame.trailers_ref() {
                    this.guard.outcome =
                        Some(Outcome::of_engine_status(trailers.get("grpc-status")));
                    this.inner = None;
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Some(Err(status)) => {
                if this.verdict.too_large.load(Ordering::Acquire) {
                    let limit = this.limiter.limit;
                    return this.end_with(
                        Outcome::TooLarge,
                        Code::ResourceExhausted,
                        &too_large_message(limit),
                    );
                }
                // The engine connection broke mid-call: retryable elsewhere.
                let message = format!("engine stream failed: {}", status.message());
                this.end_with(Outcome::EngineFailed, Code::Unavailable, &message)
            }
            None => {
                // Ended without trailers: the status, if any, came in the headers.
                this.inner = None;
                this.guard.outcome = Some(this.status_in_headers.unwrap_or(Outcome::EngineStatus));
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
