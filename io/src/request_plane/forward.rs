//! One call: routed to the sidecar's own health, refused, or forwarded to the
//! engine with its request and response bodies passed through frame by frame.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Bytes;
use h2::{RecvStream, SendStream};
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

/// The status message of a call whose caller's request failed (it reset its
/// stream): nobody reads it, but the call gets one.
const CALLER_GONE_MESSAGE: &str = "the caller's request failed";

/// Why a call ended before the engine's answer headers were passed on.
enum Unanswered {
    /// The engine stream could not be opened, or failed before its headers.
    Engine(String),
    /// The caller's request could not go on to the engine.
    Request(RequestFailed),
}

async fn forward(
    plane: Arc<Plane>,
    req: http::Request<Incoming>,
    mut guard: InFlight,
) -> http::Response<Body> {
    let deadline = grpc_timeout(req.headers()).map(|d| tokio::time::Instant::now() + d);
    let (parts, incoming) = req.into_parts();
    let end_of_stream = incoming.is_end_stream();
    let request = http::Request::from_parts(parts, ());
    let lease = &guard.lease;
    let limits = plane.limits;
    let pump_plane = plane.clone();
    let call = async move {
        let (mut answer, engine_stream) = lease
            .send(request, end_of_stream)
            .await
            .map_err(|e| Unanswered::Engine(crate::report::error_chain(e.as_ref())))?;
        let mut pump = (!end_of_stream).then(|| RequestPump {
            inner: incoming,
            engine: engine_stream,
            held: None,
            limiter: MessageLimiter::new(limits.max_message_bytes),
            plane: pump_plane,
            bytes: 0,
        });
        // The request goes out while the answer's headers are awaited; a
        // request still streaming once they came goes on in the response body.
        let head = std::future::poll_fn(|cx| {
            if let Err(failed) = drive_request(&mut pump, cx) {
                return Poll::Ready(Err(Unanswered::Request(failed)));
            }
            Pin::new(&mut answer)
                .poll(cx)
                .map_err(|e| Unanswered::Engine(crate::report::error_chain(&e)))
        })
        .await?;
        Ok::<_, Unanswered>((head, pump))
    };
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
        Ok((response, pump)) => {
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
                data_done: false,
                pump,
                header_limit,
                cut: Box::pin(cut.cancelled_owned()),
                deadline: deadline.map(|at| Box::pin(tokio::time::sleep_until(at))),
                limiter: MessageLimiter::new(plane.limits.max_message_bytes),
                guard,
            };
            http::Response::from_parts(parts, Body::new(body))
        }
        Err(Unanswered::Request(RequestFailed::TooLarge)) => {
            guard.call.set_outcome(CallOutcome::TooLarge);
            status_response(
                Code::ResourceExhausted,
                &too_large_message(plane.limits.max_message_bytes),
            )
        }
        Err(Unanswered::Request(RequestFailed::CallerGone)) => {
            guard.call.set_outcome(CallOutcome::CancelledByCaller);
            status_response(Code::Cancelled, CALLER_GONE_MESSAGE)
        }
        Err(Unanswered::Engine(text)) => {
            guard.call.set_outcome(CallOutcome::EngineUnreachable);
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

/// The caller's request on its way into the engine stream, frame by frame:
/// each DATA frame is read from the caller only once the previous one went out,
/// and sent once the engine stream has window for it, so a caller can never
/// make the sidecar hold more than one frame of its request.
struct RequestPump {
    inner: Incoming,
    engine: SendStream<Bytes>,
    /// A DATA frame read and waiting for window, and whether it ends the request.
    held: Option<(Bytes, bool)>,
    limiter: MessageLimiter,
    plane: Arc<Plane>,
    /// Bytes forwarded, added to the shared counter once, when the pump is dropped:
    /// a shared atomic per frame would bounce its cache line between cores.
    bytes: u64,
}

/// How a request stopped going into the engine stream.
enum PumpEnd {
    /// All of it went out (END_STREAM sent).
    Sent,
    /// The engine stream is gone (reset or ended): the response side says how.
    EngineGone,
    /// It failed on the caller's side; the engine stream is reset.
    Failed(RequestFailed),
}

/// Why the caller's request could not go on to the engine.
#[derive(Clone, Copy)]
enum RequestFailed {
    /// A message over the limit.
    TooLarge,
    /// The caller's request failed (a reset).
    CallerGone,
}

/// Moves what is left of the request, if anything, into the engine stream,
/// while the answer's headers are awaited and then from the response body. The
/// pump is dropped once it ended; only a failure on the caller's side is
/// returned (an engine stream gone is the response side's to report).
fn drive_request(
    pump: &mut Option<RequestPump>,
    cx: &mut Context<'_>,
) -> Result<(), RequestFailed> {
    let Some(request) = pump.as_mut() else {
        return Ok(());
    };
    let Poll::Ready(end) = request.poll_send(cx) else {
        return Ok(());
    };
    *pump = None;
    match end {
        PumpEnd::Sent | PumpEnd::EngineGone => Ok(()),
        PumpEnd::Failed(failed) => Err(failed),
    }
}

impl RequestPump {
    fn poll_send(&mut self, cx: &mut Context<'_>) -> Poll<PumpEnd> {
        loop {
            if let Some((data, end_of_stream)) = self.held.take() {
                if !data.is_empty() {
                    while self.engine.capacity() == 0 {
                        match self.engine.poll_capacity(cx) {
                            Poll::Pending => {
                                self.held = Some((data, end_of_stream));
                                return Poll::Pending;
                            }
                            Poll::Ready(Some(Ok(_))) => {}
                            Poll::Ready(Some(Err(_)) | None) => {
                                return Poll::Ready(PumpEnd::EngineGone);
                            }
                        }
                    }
                }
                if self.engine.send_data(data, end_of_stream).is_err() {
                    return Poll::Ready(PumpEnd::EngineGone);
                }
                if end_of_stream {
                    return Poll::Ready(PumpEnd::Sent);
                }
                continue;
            }
            match ready!(Pin::new(&mut self.inner).poll_frame(cx)) {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => {
                        self.bytes += data.len() as u64;
                        if self.limiter.feed(&data).is_err() {
                            self.engine.send_reset(h2::Reason::CANCEL);
                            return Poll::Ready(PumpEnd::Failed(RequestFailed::TooLarge));
                        }
                        if !data.is_empty() {
                            // A claim on the window, not the frame's size: h2
                            // raises it to what is buffered when it is sent.
                            self.engine.reserve_capacity(1);
                        }
                        self.held = Some((data, self.inner.is_end_stream()));
                    }
                    Err(frame) => {
                        if let Ok(trailers) = frame.into_trailers() {
                            self.engine.reserve_capacity(0);
                            return Poll::Ready(match self.engine.send_trailers(trailers) {
                                Ok(()) => PumpEnd::Sent,
                                Err(_) => PumpEnd::EngineGone,
                            });
                        }
                    }
                },
                Some(Err(_)) => {
                    self.engine.send_reset(h2::Reason::CANCEL);
                    return Poll::Ready(PumpEnd::Failed(RequestFailed::CallerGone));
                }
                None => {
                    return Poll::Ready(match self.engine.send_data(Bytes::new(), true) {
                        Ok(()) => PumpEnd::Sent,
                        Err(_) => PumpEnd::EngineGone,
                    });
                }
            }
        }
    }
}

impl Drop for RequestPump {
    fn drop(&mut self) {
        self.plane
            .counters
            .bytes_to_engine
            .fetch_add(self.bytes, Ordering::Relaxed);
    }
}

/// The engine's response stream on its way to the caller, and the rest of the
/// caller's request still going into the engine stream.
struct ResponseBody {
    /// `None` once the call is over (the engine stream is dropped, i.e. reset).
    inner: Option<RecvStream>,
    /// The engine's DATA has ended; its trailers are next.
    data_done: bool,
    /// The request while it is still being sent; dropped with `inner` at the end.
    pump: Option<RequestPump>,
    /// The largest trailers passed on to the caller.
    header_limit: u32,
    cut: Pin<Box<WaitForCancellationFutureOwned>>,
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
    limiter: MessageLimiter,
    guard: InFlight,
}

type Polled = Poll<Option<Result<Frame<Bytes>, tonic::Status>>>;

impl ResponseBody {
    /// Ends the call with a status in the trailers, dropping the engine stream.
    fn end_with(&mut self, outcome: CallOutcome, code: Code, message: &str) -> Polled {
        self.drop_engine_stream();
        self.guard.call.set_outcome(outcome);
        let mut trailers = http::HeaderMap::new();
        let _ = tonic::Status::new(code, message).add_header(&mut trailers);
        Poll::Ready(Some(Ok(Frame::trailers(trailers))))
    }

    /// Drops both halves of the engine stream: the call is over (a reset, if
    /// the stream was not).
    fn drop_engine_stream(&mut self) {
        self.inner = None;
        self.pump = None;
    }

    /// Ends the call because a message, either way, was over the limit.
    fn end_too_large(&mut self) -> Polled {
        let message = too_large_message(self.limiter.limit());
        self.end_with(CallOutcome::TooLarge, Code::ResourceExhausted, &message)
    }

    /// Ends the call because the engine stream broke mid-call: retryable elsewhere.
    fn end_engine_failed(&mut self, e: &h2::Error) -> Polled {
        let message = format!("engine stream failed: {}", crate::report::error_chain(e));
        self.end_with(CallOutcome::EngineFailed, Code::Unavailable, &message)
    }

    /// Passes on the engine's trailers, which end the call.
    fn end_with_trailers(&mut self, trailers: http::HeaderMap) -> Polled {
        if header_list_size(&trailers) > self.header_limit as usize {
            let message = too_large_headers_message(self.header_limit);
            return self.end_with(CallOutcome::TooLarge, Code::ResourceExhausted, &message);
        }
        self.guard
            .call
            .set_outcome(CallOutcome::of_engine_status(trailers.get("grpc-status")));
        self.drop_engine_stream();
        Poll::Ready(Some(Ok(Frame::trailers(trailers))))
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
        match drive_request(&mut this.pump, cx) {
            Ok(()) => {}
            Err(RequestFailed::TooLarge) => return this.end_too_large(),
            Err(RequestFailed::CallerGone) => {
                return this.end_with(
                    CallOutcome::CancelledByCaller,
                    Code::Cancelled,
                    CALLER_GONE_MESSAGE,
                );
            }
        }
        let Some(inner) = this.inner.as_mut() else {
            return Poll::Ready(None);
        };
        if !this.data_done {
            match ready!(inner.poll_data(cx)) {
                Some(Ok(data)) => {
                    // The engine may send as much again: its window is what the
                    // caller has not read yet, and this is on its way to it.
                    let _ = inner.flow_control().release_capacity(data.len());
                    this.guard.bytes += data.len() as u64;
                    if this.limiter.feed(&data).is_err() {
                        return this.end_too_large();
                    }
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Some(Err(e)) => return this.end_engine_failed(&e),
                None => this.data_done = true,
            }
        }
        match ready!(inner.poll_trailers(cx)) {
            Ok(Some(trailers)) => this.end_with_trailers(trailers),
            Ok(None) => {
                // Ended without trailers (a trailers-only answer never gets here):
                // no status at all, which the caller reads as an error.
                this.drop_engine_stream();
                this.guard.call.set_outcome(CallOutcome::EngineStatus);
                Poll::Ready(None)
            }
            Err(e) => this.end_engine_failed(&e),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_none()
    }
}
