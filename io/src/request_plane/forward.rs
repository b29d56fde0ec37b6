//! One call: routed to the sidecar's own health, refused, or forwarded to the
//! engine with its request and response bodies passed through frame by frame.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body as HttpBody, Frame};
use hyper::body::Incoming;
use tokio_util::sync::WaitForCancellationFutureOwned;
use tonic::Code;
use tonic::body::Body;
use tonic::codegen::Service;

use super::Plane;
use super::admitted::Admitted;
use super::engine_pool::Lease;
use super::framing::{
    MessageLimiter, PREFIX_LEN, grpc_timeout, header_list_size, too_large_headers_message,
    too_large_message,
};
use super::outcome::CallOutcome;

/// How long a refused call's request may take to arrive before it is answered.
const REFUSED_BODY_WAIT: Duration = Duration::from_millis(250);

/// The status message of a call cut at the drain deadline.
const CUT_MESSAGE: &str = "drain deadline reached; retry on another worker";

/// The status message of a call whose `grpc-timeout` passed.
const DEADLINE_MESSAGE: &str = "deadline exceeded (grpc-timeout)";

/// A response with only a status: HTTP 200, `grpc-status` in the headers.
fn status_response(code: Code, message: &str) -> http::Response<Body> {
    tonic::Status::new(code, message).into_http()
}

/// Routes one call: the sidecar's own `grpc.health.v1`; the engine's health
/// RPC while not Serving, and anything while admission is closed, refused;
/// everything else forwarded.
pub(crate) async fn handle(
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
    let admitted =
        if plane.health_rpc_path.get() == Some(&path) && !plane.serving.load(Ordering::Acquire) {
            plane.counters.record(CallOutcome::Refused);
            None
        } else {
            Admitted::try_new(&plane)
        };
    let Some(call) = admitted else {
        return Ok(refuse(&plane, req.into_body()).await);
    };
    let guard = InFlight {
        lease: plane.engine.lease(),
        call,
        bytes: 0,
    };
    Ok(forward(plane, req, guard).await)
}

/// Answers a call that admission refused: UNAVAILABLE "draining", never forwarded.
///
/// The request is read to its end first. Answering while the caller is still
/// sending makes HTTP/2 reset the stream, and h2 counts those resets: past 1,024
/// on one connection it sends GOAWAY ENHANCE_YOUR_CALM, which would kill the
/// calls still draining on that connection (a router retrying into a draining
/// worker reaches that in seconds). A request that does not end within a short
/// wait, or grows past the message limit, is answered anyway.
async fn refuse(plane: &Plane, mut body: Incoming) -> http::Response<Body> {
    let limit = u64::from(plane.limits.max_message_bytes) + PREFIX_LEN as u64;
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

/// Set by the request body when the caller sent a message over the limit; the
/// response side reads it to tell "too large" from an engine failure.
#[derive(Default)]
struct TooLargeFlag(AtomicBool);

impl TooLargeFlag {
    fn raise(&self) {
        self.0.store(true, Ordering::Release);
    }

    fn raised(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

async fn forward(
    plane: Arc<Plane>,
    req: http::Request<Incoming>,
    mut guard: InFlight,
) -> http::Response<Body> {
    let deadline = grpc_timeout(req.headers()).map(|d| tokio::time::Instant::now() + d);
    let too_large = Arc::new(TooLargeFlag::default());
    let (parts, incoming) = req.into_parts();
    let request_body = RequestBody {
        inner: incoming,
        plane: plane.clone(),
        limiter: MessageLimiter::new(plane.limits.max_message_bytes),
        too_large: too_large.clone(),
        bytes: 0,
    };
    let request = http::Request::from_parts(parts, Body::new(request_body));
    let call = guard.lease.send(request);
    let until_deadline = async {
        match deadline {
            Some(at) => tokio::time::sleep_until(at).await,
            None => std::future::pending().await,
        }
    };
    let cut = plane.cut_token();
    let response = tokio::select! {
        response = call => response,
        () = cut.cancelled() => {
            guard.call.set_outcome(CallOutcome::CutAtDeadline);
            return status_response(Code::Unavailable, CUT_MESSAGE);
        }
        () = until_deadline => {
            guard.call.set_outcome(CallOutcome::DeadlineExceeded);
            return status_response(Code::DeadlineExceeded, DEADLINE_MESSAGE);
        }
    };
    match response {
        Ok(response) => {
            let (parts, body) = response.into_parts();
            let header_limit = plane.limits.max_header_list_bytes;
            if header_list_size(&parts.headers) > header_limit as usize {
                // Passed on, these headers would make the caller's HTTP/2 stack
                // fail its whole connection; this call fails alone instead.
                guard.call.set_outcome(CallOutcome::TooLarge);
                return status_response(
                    Code::ResourceExhausted,
                    &too_large_headers_message(header_limit),
                );
            }
            if parts.headers.contains_key("grpc-status") {
                // Trailers-only: the engine ended the call with its headers, so
                // the caller's stream ends with them too (HEADERS with
                // END_STREAM). An empty DATA frame after them is what gRPC
                // clients built on C-core reject.
                guard.call.set_outcome(CallOutcome::of_engine_status(
                    parts.headers.get("grpc-status"),
                ));
                return http::Response::from_parts(parts, Body::empty());
            }
            let body = ResponseBody {
                inner: Some(body),
                header_limit,
                cut: Box::pin(cut.cancelled_owned()),
                deadline: deadline.map(|at| Box::pin(tokio::time::sleep_until(at))),
                limiter: MessageLimiter::new(plane.limits.max_message_bytes),
                too_large,
                guard,
            };
            http::Response::from_parts(parts, Body::new(body))
        }
        Err(e) => {
            if too_large.raised() {
                guard.call.set_outcome(CallOutcome::TooLarge);
                return status_response(
                    Code::ResourceExhausted,
                    &too_large_message(plane.limits.max_message_bytes),
                );
            }
            guard.call.set_outcome(CallOutcome::EngineUnreachable);
            let text = crate::report::error_chain(e.as_ref());
            status_response(Code::Unavailable, &format!("engine unavailable: {text}"))
        }
    }
}

/// An admitted call. Leaving the gate and recording the outcome when dropped
/// keeps both counts exact whatever ends the call: its end, a caller's cancel, a
/// cut, a panic.
struct InFlight {
    /// The engine connection the call runs on.
    lease: Lease,
    /// The gate's side: dropped after `Drop for InFlight` ran, so the bytes
    /// are counted before the call leaves the gate.
    call: Admitted,
    /// Response bytes forwarded, added to the shared counter once, at the end.
    bytes: u64,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.call
            .plane()
            .counters
            .bytes_to_caller
            .fetch_add(self.bytes, Ordering::Relaxed);
    }
}

/// The caller's request stream on its way to the engine.
struct RequestBody {
    inner: Incoming,
    plane: Arc<Plane>,
    limiter: MessageLimiter,
    too_large: Arc<TooLargeFlag>,
    /// Bytes forwarded, added to the shared counter once, when the body is dropped:
    /// a shared atomic per frame would bounce its cache line between cores.
    bytes: u64,
}

impl Drop for RequestBody {
    fn drop(&mut self) {
        self.plane
            .counters
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
                        this.too_large.raise();
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
    inner: Option<Incoming>,
    /// The largest trailers passed on to the caller.
    header_limit: u32,
    cut: Pin<Box<WaitForCancellationFutureOwned>>,
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
    limiter: MessageLimiter,
    too_large: Arc<TooLargeFlag>,
    guard: InFlight,
}

type Polled = Poll<Option<Result<Frame<Bytes>, tonic::Status>>>;

impl ResponseBody {
    /// Ends the call with a status in the trailers, dropping the engine stream.
    fn end_with(&mut self, outcome: CallOutcome, code: Code, message: &str) -> Polled {
        self.inner = None;
        self.guard.call.set_outcome(outcome);
        let mut trailers = http::HeaderMap::new();
        let _ = tonic::Status::new(code, message).add_header(&mut trailers);
        Poll::Ready(Some(Ok(Frame::trailers(trailers))))
    }

    /// Ends the call because a message, either way, was over the limit.
    fn end_too_large(&mut self) -> Polled {
        let message = too_large_message(self.limiter.limit());
        self.end_with(CallOutcome::TooLarge, Code::ResourceExhausted, &message)
    }
}

impl HttpBody for ResponseBody {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Polled {
        let this = &mut *self;
        if this.inner.is_none() {
            return Poll::Ready(None);
        }
        if this.cut.as_mut().poll(cx).is_ready() {
            return this.end_with(CallOutcome::CutAtDeadline, Code::Unavailable, CUT_MESSAGE);
        }
        if let Some(deadline) = this.deadline.as_mut()
            && deadline.as_mut().poll(cx).is_ready()
        {
            return this.end_with(
                CallOutcome::DeadlineExceeded,
                Code::DeadlineExceeded,
                DEADLINE_MESSAGE,
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
                        return this.end_too_large();
                    }
                } else if let Some(trailers) = frame.trailers_ref() {
                    if header_list_size(trailers) > this.header_limit as usize {
                        let message = too_large_headers_message(this.header_limit);
                        return this.end_with(
                            CallOutcome::TooLarge,
                            Code::ResourceExhausted,
                            &message,
                        );
                    }
                    this.guard
                        .call
                        .set_outcome(CallOutcome::of_engine_status(trailers.get("grpc-status")));
                    this.inner = None;
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Some(Err(e)) => {
                if this.too_large.raised() {
                    return this.end_too_large();
                }
                // The engine connection broke mid-call: retryable elsewhere.
                let message = format!("engine stream failed: {}", crate::report::error_chain(&e));
                this.end_with(CallOutcome::EngineFailed, Code::Unavailable, &message)
            }
            None => {
                // Ended without trailers (a trailers-only answer never gets here):
                // no status at all, which the caller reads as an error.
                this.inner = None;
                this.guard.call.set_outcome(CallOutcome::EngineStatus);
                Poll::Ready(None)
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_none()
    }
}
