//! One call: routed to the sidecar's own health, refused, or forwarded to the
//! engine with its request and response passed through frame by frame.
//!
//! A call is a future its caller connection's task polls ([`super::calls`]),
//! written against h2's stream types on both sides: the caller's
//! `SendResponse`, `SendStream` and `RecvStream`, the engine's
//! `ResponseFuture`, `SendStream` and `RecvStream`. Nothing sits between the
//! two streams but the checks the lifecycle needs (admission, the cut, the
//! deadline, the size limits): each DATA frame the engine sends is handed to
//! the caller's stream as it came, once the caller has window for it.

use std::future::{Future, poll_fn};
use std::net::IpAddr;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use h2::server::SendResponse;
use h2::{RecvStream, SendStream};
use http_body::{Body as HttpBody, Frame};
use tokio_util::sync::WaitForCancellationFutureOwned;
use tonic::Code;
use tonic::body::Body;
use tonic::codegen::Service;

use super::Plane;
use super::admitted::Admitted;
use super::calls::Call;
use super::engine_pool::Lease;
use super::frame_watch::OpenCall;
use super::framing::{
    MessageLimiter, PREFIX_LEN, grpc_timeout, header_list_size, too_large_headers_message,
    too_large_message,
};
use super::outcome::{CUT_MESSAGE, CallOutcome};
use super::unanswered_stream::UnansweredStream;
use crate::engine::ENGINE_STREAM_WINDOW;

/// How long a refused call's request may take to arrive before it is answered.
const REFUSED_BODY_WAIT: Duration = Duration::from_millis(250);

/// How long a forwarded call's request may take to begin (its first DATA
/// after its HEADERS): a half-open call is answered then, and never holds an
/// engine stream meanwhile.
const REQUEST_START_WAIT: Duration = Duration::from_secs(10);

/// How long a request message, once begun, may take to arrive whole: a call
/// whose message stalls half-sent holds its engine stream (the engine waits
/// for the rest) no longer than this, and is answered DEADLINE_EXCEEDED. A
/// caller may wait as long as it likes between messages.
const MESSAGE_ARRIVAL_WAIT: Duration = REQUEST_START_WAIT;

/// How long the rest of an early-ended call's request is read and dropped
/// before its stream is let go (see [`linger`]).
const EARLY_END_LINGER: Duration = Duration::from_secs(2);

/// Own-health streams one caller connection may hold: a router watches a
/// worker with one, a load balancer's checks come one at a time.
const OWN_HEALTH_PER_CONNECTION: usize = 16;

/// Own-health streams the sidecar holds at once, every connection together:
/// a few kilobytes each, so a few megabytes at most.
const OWN_HEALTH_STREAMS: u64 = 1024;

/// How long an own-health call's request message may take to arrive: a
/// stream opened and never sent its request (half-open) is answered then,
/// rather than held for ever.
const OWN_HEALTH_REQUEST_WAIT: Duration = Duration::from_secs(5);

/// The status message of a call whose `grpc-timeout` passed.
const DEADLINE_MESSAGE: &str = "deadline exceeded (grpc-timeout)";

/// The status message of a call whose caller's request failed (it reset its
/// stream): nobody reads it, but the call gets one.
const CALLER_GONE_MESSAGE: &str = "the caller's request failed";

/// A trailers-only answer: `:status` 200, `content-type`, `grpc-status` and
/// `grpc-message` in the headers.
fn status_headers(code: Code, message: &str) -> http::Response<()> {
    tonic::Status::new(code, message).into_http::<()>()
}

/// A status as the trailers of a stream already answered: `grpc-status` and
/// `grpc-message`.
fn status_trailers(code: Code, message: &str) -> http::HeaderMap {
    let mut trailers = http::HeaderMap::new();
    let _ = tonic::Status::new(code, message).add_header(&mut trailers);
    trailers
}

/// Answers a call with a status alone (trailers-only: HEADERS with
/// END_STREAM). A caller already gone is nobody to tell.
fn send_status(respond: &mut SendResponse<Bytes>, code: Code, message: &str) {
    let _ = respond.send_response(status_headers(code, message), true);
}

/// One call, from its request headers to the end of its stream, as the
/// future its connection runs: the sidecar's own `grpc.health.v1`; the
/// engine's health RPC while not Serving, and anything while admission is
/// closed, refused; everything else forwarded. `open` is held until the call
/// ends.
///
/// Routing and admission happen here, before the future exists, and what the
/// future keeps for a forwarded call's whole life is its [`Relay`] (368 bytes
/// in all, measured with `size_of` on 2026-12-04; the answer bytes held and the
/// half-sent message's timer are among them): the request's
/// headers, and the opening of the engine stream (which may open its
/// connection, kilobytes of future), live in a box freed once the answer's
/// headers are passed on. Written as one async function, a
/// call kept 3.5 KB to its end (docs/PERFORMANCE-LOG.md, "The caller side on h2").
pub(crate) fn call(
    plane: Arc<Plane>,
    request: http::Request<RecvStream>,
    mut respond: SendResponse<Bytes>,
    open: OpenCall,
) -> Call {
    if reset_already(&mut respond) {
        // The caller's RST_STREAM came with its HEADERS (a rapid reset): an
        // engine stream opened now would only be reset again on the shared
        // engine connection, where a burst of such resets makes the engine
        // GOAWAY it, every caller's calls with it. It still passes the gate,
        // so the account stays whole: refused while admission is closed (a
        // caller's client resets a request it failed on the exit's GOAWAY),
        // else admitted and, dropped at once, cancelled by its caller.
        drop(Admitted::try_new(&plane));
        return Box::pin(async move {
            let _open = open;
        });
    }
    if let Some(why) = malformed(&request) {
        return Box::pin(async move {
            let _open = open;
            plane.counters.record(CallOutcome::Malformed);
            refuse(&plane, request.into_body()).await;
            send_status(
                &mut respond,
                Code::InvalidArgument,
                &format!("not a gRPC call: {why}"),
            );
        });
    }
    let path = request.uri().path();
    if path.starts_with("/grpc.health.v1.Health/") {
        return Box::pin(async move {
            let Some(slot) = OwnHealthStream::take(&plane, &open) else {
                plane
                    .counters
                    .own_health_refused
                    .fetch_add(1, Ordering::Relaxed);
                refuse(&plane, request.into_body()).await;
                send_status(
                    &mut respond,
                    Code::ResourceExhausted,
                    "too many grpc.health.v1 streams open",
                );
                return;
            };
            let _open = open;
            own_health(&plane, request, respond).await;
            drop(slot);
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
        return Box::pin(async move {
            let _open = open;
            refuse(&plane, request.into_body()).await;
            send_status(&mut respond, Code::Unavailable, "draining");
        });
    };
    let guard = InFlight {
        lease: None,
        call,
        bytes: 0,
    };
    Box::pin(Forwarded {
        phase: Phase::Answering(Box::pin(answer(
            plane,
            request,
            respond,
            guard,
            open.address(),
        ))),
        _open: open,
    })
}

/// The caller reset the stream before its call began: h2 read the
/// RST_STREAM in the same turn as the HEADERS.
fn reset_already(respond: &mut SendResponse<Bytes>) -> bool {
    let mut cx = Context::from_waker(std::task::Waker::noop());
    respond.poll_reset(&mut cx).is_ready()
}

/// Why a request is not a gRPC call, if it is not: gRPC is a POST to
/// `/<service>/<method>`. Anything else (a CONNECT, which carries no path at
/// all; a GET) is the caller's mistake, answered with a code it must not
/// retry elsewhere and never sent on to the engine, where it would fail as
/// if the engine were unreachable.
fn malformed<B>(request: &http::Request<B>) -> Option<String> {
    if request.method() != http::Method::POST {
        return Some(format!(
            ":method {} (gRPC calls are POST)",
            request.method()
        ));
    }
    let path = request.uri().path();
    let named = path
        .strip_prefix('/')
        .and_then(|rest| rest.split_once('/'))
        .is_some_and(|(service, method)| !service.is_empty() && !method.is_empty());
    (!named).then(|| format!(":path {path:?} names no /<service>/<method>"))
}

/// A forwarded call, as its connection runs it.
struct Forwarded {
    phase: Phase,
    _open: OpenCall,
}

// The large variant is the one a call lives in; the small one is boxed on
// purpose, so that it is freed.
#[allow(clippy::large_enum_variant)]
enum Phase {
    /// The engine stream opened, the request sent, the answer's headers
    /// awaited: boxed, and freed once they are passed on.
    Answering(Pin<Box<dyn Future<Output = Option<Relay>> + Send>>),
    /// The rest of the call.
    Relaying(Relay),
}

impl Future for Forwarded {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        loop {
            match &mut self.phase {
                Phase::Answering(answer) => match ready!(answer.as_mut().poll(cx)) {
                    Some(relay) => self.phase = Phase::Relaying(relay),
                    None => return Poll::Ready(()),
                },
                Phase::Relaying(relay) => return relay.poll(cx),
            }
        }
    }
}

/// One own-health stream, counted on its connection and in the sidecar's
/// total while it is open.
struct OwnHealthStream<'a> {
    plane: &'a Plane,
    _slot: super::frame_watch::OwnHealthSlot,
}

impl<'a> OwnHealthStream<'a> {
    /// A place for one more own-health stream, if its connection and the
    /// sidecar have room.
    fn take(plane: &'a Plane, open: &OpenCall) -> Option<Self> {
        let slot = open.own_health_slot(OWN_HEALTH_PER_CONNECTION)?;
        let total = &plane.counters.own_health_open;
        if total.fetch_add(1, Ordering::AcqRel) >= OWN_HEALTH_STREAMS {
            total.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        Some(OwnHealthStream { plane, _slot: slot })
    }
}

impl Drop for OwnHealthStream<'_> {
    fn drop(&mut self) {
        self.plane
            .counters
            .own_health_open
            .fetch_sub(1, Ordering::AcqRel);
    }
}

/// The sidecar's own health service, answered here. A request that does not
/// arrive within [`OWN_HEALTH_REQUEST_WAIT`] is answered DEADLINE_EXCEEDED.
async fn own_health(
    plane: &Plane,
    request: http::Request<RecvStream>,
    mut respond: SendResponse<Bytes>,
) {
    let mut health = plane.health.clone();
    let answered = tokio::time::timeout(
        OWN_HEALTH_REQUEST_WAIT,
        health.call(request.map(RequestBody::new)),
    )
    .await;
    let response = match answered {
        Ok(Ok(response)) => response,
        Ok(Err(never)) => match never {},
        Err(_) => {
            let message = format!(
                "the health request did not arrive within {}",
                llm_sidecar_core::HumanDuration(OWN_HEALTH_REQUEST_WAIT)
            );
            return send_status(&mut respond, Code::DeadlineExceeded, &message);
        }
    };
    send_body(respond, response).await;
}

/// Reads a refused call's request to its end before it is answered.
///
/// Answering while the caller is still sending makes HTTP/2 reset the stream,
/// and h2 counts those resets: past 1,024 on one connection it sends GOAWAY
/// ENHANCE_YOUR_CALM, which would kill the calls still draining on that
/// connection (a router retrying into a draining worker reaches that in
/// seconds). A request that does not end within a short wait, or grows past
/// the message limit, is answered anyway.
async fn refuse(plane: &Plane, body: RecvStream) {
    drain(body, drain_limit(plane), REFUSED_BODY_WAIT).await;
}

/// What is read of a request being dropped: one message at the limit.
fn drain_limit(plane: &Plane) -> u64 {
    u64::from(plane.limits.max_message_bytes) + PREFIX_LEN as u64
}

/// Reads and drops a request's DATA (giving its window back) until it ends,
/// passes `limit` bytes, or `wait` runs out.
async fn drain(mut body: RecvStream, limit: u64, wait: Duration) {
    let read_to_end = async {
        let mut read: u64 = 0;
        while let Some(Ok(data)) = poll_fn(|cx| body.poll_data(cx)).await {
            let _ = body.flow_control().release_capacity(data.len());
            read += data.len() as u64;
            if read > limit {
                break;
            }
        }
    };
    let _ = tokio::time::timeout(wait, read_to_end).await;
}

/// Why a call ended before the engine's answer headers were passed on.
enum Unanswered {
    /// The engine stream could not be opened, or failed before its headers.
    Engine(String),
    /// The caller's request could not go on to the engine.
    Request(RequestFailed),
    /// The request's first DATA did not come within [`REQUEST_START_WAIT`].
    NotStarted,
    /// The cut or the caller's deadline came first.
    Ended(Ending),
    /// The caller reset its stream: nobody to answer.
    CallerGone,
}

/// Opens the call's engine stream, sends the request into it and waits for
/// the answer's headers; passes them on and returns the relay for the rest,
/// or `None` once the call is over (answered with a status, or the caller
/// gone).
async fn answer(
    plane: Arc<Plane>,
    request: http::Request<RecvStream>,
    mut respond: SendResponse<Bytes>,
    mut guard: InFlight,
    address: IpAddr,
) -> Option<Relay> {
    let deadline = grpc_timeout(request.headers()).map(|d| tokio::time::Instant::now() + d);
    let mut ends = Endings {
        cut: Box::pin(plane.cut_token().cancelled_owned()),
        deadline: deadline.map(|at| Box::pin(tokio::time::sleep_until(at))),
    };
    let answered = engine_answer(
        &plane,
        &mut guard.lease,
        address,
        request,
        &mut ends,
        &mut respond,
    )
    .await;
    let (response, pump) = match answered {
        Ok(answered) => answered,
        Err(why) => {
            unanswered(&plane, why, &mut guard.call, &mut respond);
            return None;
        }
    };
    let (parts, body) = response.into_parts();
    let header_limit = plane.limits.max_header_list_bytes;
    if header_list_size(&parts.headers) > header_limit as usize {
        // Passed on, these headers would make the caller's HTTP/2 stack
        // fail its whole connection; this call fails alone instead.
        guard.call.set_outcome(CallOutcome::TooLarge);
        let message = too_large_headers_message(header_limit);
        send_status(&mut respond, Code::ResourceExhausted, &message);
        return None;
    }
    if parts.headers.contains_key("grpc-status") {
        // Trailers-only: the engine ended the call with its headers, so the
        // caller's stream ends with them too (HEADERS with END_STREAM). An
        // empty DATA frame after them is what gRPC clients built on C-core
        // reject.
        guard.call.set_outcome(CallOutcome::of_engine_status(
            parts.headers.get("grpc-status"),
        ));
        let _ = respond.send_response(http::Response::from_parts(parts, ()), true);
        return None;
    }
    let caller = respond
        .send_response(http::Response::from_parts(parts, ()), false)
        .ok()?;
    Some(Relay {
        engine: Some(body),
        held: BytesMut::new(),
        data_done: false,
        pump,
        caller,
        header_limit,
        limiter: MessageLimiter::new(plane.limits.max_message_bytes),
        ends,
        guard,
    })
}

/// The engine stream (opened at once unless its connection is being
/// opened), the request on its way into it, and the answer's headers. A
/// request still streaming once they came goes on in the relay, as the
/// returned pump.
async fn engine_answer(
    plane: &Arc<Plane>,
    lease: &mut Option<Lease>,
    address: IpAddr,
    request: http::Request<RecvStream>,
    ends: &mut Endings,
    respond: &mut SendResponse<Bytes>,
) -> Result<(http::Response<RecvStream>, Option<RequestPump>), Unanswered> {
    let (parts, mut body) = request.into_parts();
    let end_of_stream = body.is_end_stream();
    let request = http::Request::from_parts(parts, ());
    let mut limiter = MessageLimiter::new(plane.limits.max_message_bytes);
    // The engine stream opens once the request has begun (its first DATA,
    // or its end): a caller that sends HEADERS and nothing more holds no
    // engine stream, and is answered after REQUEST_START_WAIT.
    let first = if end_of_stream {
        None
    } else {
        match request_start(&mut body, ends, respond).await {
            Ok(first) => first,
            Err(why) => {
                linger(plane, body);
                return Err(why);
            }
        }
    };
    let mut bytes = 0;
    if let Some(data) = &first {
        bytes = data.len() as u64;
        if limiter.feed(data).is_err() {
            linger(plane, body);
            return Err(Unanswered::Request(RequestFailed::TooLarge));
        }
    }
    let opened = {
        // An engine stream first (at once, or in turn with other caller
        // addresses when they run short), then an engine connection: the
        // least busy among the calls that have one, so a call waiting here
        // counts on no connection.
        let mut send = pin!(async {
            let caller = plane.engine_streams.acquire(address).await;
            let lease = lease.insert(plane.engine.lease(caller));
            lease.send(request, end_of_stream).await
        });
        poll_fn(|cx| {
            if let Some(ending) = ends.poll(cx) {
                return Poll::Ready(Err(Unanswered::Ended(ending)));
            }
            if let Poll::Ready(sent) = send.as_mut().poll(cx) {
                return Poll::Ready(
                    sent.map_err(|e| Unanswered::Engine(crate::report::error_chain(e.as_ref()))),
                );
            }
            respond.poll_reset(cx).map(|_| Err(Unanswered::CallerGone))
        })
        .await
    };
    let (answer, mut engine_stream) = match opened {
        Ok(opened) => opened,
        Err(why) => {
            if !end_of_stream {
                linger(plane, body);
            }
            return Err(why);
        }
    };
    let mut pump = (!end_of_stream).then(|| {
        let ended = body.is_end_stream();
        if first.as_ref().is_some_and(|data| !data.is_empty()) {
            // A claim on the window for it, as the pump makes for every frame.
            engine_stream.reserve_capacity(1);
        }
        RequestPump {
            held: first.map(|data| (data, ended)),
            inner: Some(body),
            engine: engine_stream,
            message_by: limiter.mid_message().then(RequestPump::message_wait),
            limiter,
            plane: plane.clone(),
            bytes,
        }
    });
    // The request goes out while the answer's headers are awaited. Given up
    // before they come, the engine stream is reset only once the engine has
    // taken it (`unanswered_stream`): the lease goes with it till then.
    let mut awaiting =
        UnansweredStream::new(answer, lease.take(), plane.counters.unanswered.clone());
    let head = poll_fn(|cx| {
        if let Some(ending) = ends.poll(cx) {
            return Poll::Ready(Err(Unanswered::Ended(ending)));
        }
        if let Err(failed) = drive_request(&mut pump, cx) {
            return Poll::Ready(Err(Unanswered::Request(failed)));
        }
        if let Poll::Ready((head, held)) = awaiting.poll_answer(cx) {
            *lease = held;
            return Poll::Ready(
                head.map_err(|e| Unanswered::Engine(crate::report::error_chain(&e))),
            );
        }
        respond.poll_reset(cx).map(|_| Err(Unanswered::CallerGone))
    })
    .await?;
    Ok((head, pump))
}

/// Ends a call that got no answer headers from the engine: its outcome, and
/// the status the caller reads (none for a caller gone: dropping the call
/// resets the engine stream, and the outcome is the caller's cancel).
fn unanswered(
    plane: &Plane,
    why: Unanswered,
    call: &mut Admitted,
    respond: &mut SendResponse<Bytes>,
) {
    let (outcome, code, message) = match why {
        Unanswered::Ended(ending) => {
            let (outcome, code, message) = ending.status();
            (outcome, code, message.to_string())
        }
        Unanswered::Request(RequestFailed::TooLarge) => (
            CallOutcome::TooLarge,
            Code::ResourceExhausted,
            too_large_message(plane.limits.max_message_bytes),
        ),
        Unanswered::Request(RequestFailed::CallerGone) => (
            CallOutcome::CancelledByCaller,
            Code::Cancelled,
            CALLER_GONE_MESSAGE.to_string(),
        ),
        Unanswered::Request(RequestFailed::MessageStalled) => (
            CallOutcome::DeadlineExceeded,
            Code::DeadlineExceeded,
            message_stalled(),
        ),
        Unanswered::NotStarted => (
            CallOutcome::DeadlineExceeded,
            Code::DeadlineExceeded,
            format!(
                "the request's first message did not arrive within {}",
                llm_sidecar_core::HumanDuration(REQUEST_START_WAIT)
            ),
        ),
        Unanswered::Engine(text) => (
            CallOutcome::EngineUnreachable,
            Code::Unavailable,
            format!("engine unavailable: {text}"),
        ),
        Unanswered::CallerGone => return,
    };
    call.set_outcome(outcome);
    send_status(respond, code, &message);
}

/// The status message of a call whose request message stalled half-sent.
fn message_stalled() -> String {
    format!(
        "a request message did not arrive whole within {} of its first bytes",
        llm_sidecar_core::HumanDuration(MESSAGE_ARRIVAL_WAIT)
    )
}

/// Ends a stream with trailers, first giving back the window it had claimed
/// for data that will not come.
fn send_trailers(
    stream: &mut SendStream<Bytes>,
    trailers: http::HeaderMap,
) -> Result<(), h2::Error> {
    stream.reserve_capacity(0);
    stream.send_trailers(trailers)
}

/// What may end a call from outside it: the cut at the drain deadline and
/// the caller's `grpc-timeout`.
struct Endings {
    cut: Pin<Box<WaitForCancellationFutureOwned>>,
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
}

#[derive(Clone, Copy)]
enum Ending {
    Cut,
    DeadlineExceeded,
}

impl Endings {
    fn poll(&mut self, cx: &mut Context<'_>) -> Option<Ending> {
        if self.cut.as_mut().poll(cx).is_ready() {
            return Some(Ending::Cut);
        }
        if let Some(deadline) = self.deadline.as_mut()
            && deadline.as_mut().poll(cx).is_ready()
        {
            return Some(Ending::DeadlineExceeded);
        }
        None
    }
}

impl Ending {
    fn status(self) -> (CallOutcome, Code, &'static str) {
        match self {
            Ending::Cut => (CallOutcome::CutAtDeadline, Code::Unavailable, CUT_MESSAGE),
            Ending::DeadlineExceeded => (
                CallOutcome::DeadlineExceeded,
                Code::DeadlineExceeded,
                DEADLINE_MESSAGE,
            ),
        }
    }
}

/// An admitted call. Leaving the gate and recording the outcome when dropped
/// keeps both counts exact whatever ends the call: its end, a caller's cancel, a
/// cut, a panic.
struct InFlight {
    /// The engine connection the call runs on, once it has a place among
    /// its caller address's engine streams.
    lease: Option<Lease>,
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

/// `Ready` once the caller's stream has window for more data: the engine's
/// answer is read only as fast as the caller takes it, so what the sidecar
/// holds for a slow caller is bounded by that caller's window. `Err`: the
/// caller's stream is gone (reset, or its connection failed).
fn poll_window(caller: &mut SendStream<Bytes>, cx: &mut Context<'_>) -> Poll<Result<(), ()>> {
    if caller.capacity() > 0 {
        return Poll::Ready(Ok(()));
    }
    // A claim on the window, not the next frame's size: h2 raises it to what
    // is buffered when the frame is sent.
    caller.reserve_capacity(1);
    loop {
        match ready!(caller.poll_capacity(cx)) {
            Some(Ok(0)) => {}
            Some(Ok(_)) => return Poll::Ready(Ok(())),
            Some(Err(_)) | None => return Poll::Ready(Err(())),
        }
    }
}

/// The caller's request on its way into the engine stream, frame by frame:
/// each DATA frame is read from the caller only once the previous one went out,
/// and sent once the engine stream has window for it, so a caller can never
/// make the sidecar hold more than one frame of its request.
struct RequestPump {
    /// The caller's request; `None` only once dropped (see `Drop`).
    inner: Option<RecvStream>,
    engine: SendStream<Bytes>,
    /// A DATA frame read and waiting for window, and whether it ends the request.
    held: Option<(Bytes, bool)>,
    limiter: MessageLimiter,
    /// Armed while a message is half-sent: it must arrive whole by then.
    /// Never made for a caller whose messages come whole in their frames.
    message_by: Option<Pin<Box<tokio::time::Sleep>>>,
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
    /// It failed on the caller's side; the call ends, and the engine stream
    /// is reset when it is dropped (once the engine took it: see
    /// `unanswered_stream`).
    Failed(RequestFailed),
}

/// Why the caller's request could not go on to the engine.
#[derive(Clone, Copy)]
enum RequestFailed {
    /// A message over the limit.
    TooLarge,
    /// The caller's request failed (a reset).
    CallerGone,
    /// A message began and did not arrive whole within [`MESSAGE_ARRIVAL_WAIT`].
    MessageStalled,
}

/// Waits for the request to begin: its first DATA (returned, its window
/// given back), or its end without any (`None`), for at most
/// [`REQUEST_START_WAIT`]. A well-behaved caller sends its HEADERS and first
/// DATA together, so this is ready at its first poll.
async fn request_start(
    body: &mut RecvStream,
    ends: &mut Endings,
    respond: &mut SendResponse<Bytes>,
) -> Result<Option<Bytes>, Unanswered> {
    // Made only when the first DATA is not there at once: no clock read
    // for a well-behaved caller.
    let mut wait: Option<Pin<Box<tokio::time::Sleep>>> = None;
    poll_fn(|cx| {
        if let Some(ending) = ends.poll(cx) {
            return Poll::Ready(Err(Unanswered::Ended(ending)));
        }
        match body.poll_data(cx) {
            Poll::Ready(Some(Ok(data))) => {
                let _ = body.flow_control().release_capacity(data.len());
                return Poll::Ready(Ok(Some(data)));
            }
            Poll::Ready(Some(Err(_))) => {
                return Poll::Ready(Err(Unanswered::Request(RequestFailed::CallerGone)));
            }
            Poll::Ready(None) => return Poll::Ready(Ok(None)),
            Poll::Pending => {}
        }
        let wait = wait.get_or_insert_with(|| Box::pin(tokio::time::sleep(REQUEST_START_WAIT)));
        if wait.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Err(Unanswered::NotStarted));
        }
        respond.poll_reset(cx).map(|_| Err(Unanswered::CallerGone))
    })
    .await
}

/// Moves what is left of the request, if anything, into the engine stream,
/// while the answer's headers are awaited and then during the relay. The
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
    /// The time a message begun now has to arrive whole.
    fn message_wait() -> Pin<Box<tokio::time::Sleep>> {
        Box::pin(tokio::time::sleep(MESSAGE_ARRIVAL_WAIT))
    }

    fn poll_send(&mut self, cx: &mut Context<'_>) -> Poll<PumpEnd> {
        let Some(inner) = self.inner.as_mut() else {
            return Poll::Ready(PumpEnd::Sent);
        };
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
            // Waiting for the caller now: a half-sent message has its time.
            if let Some(by) = self.message_by.as_mut()
                && by.as_mut().poll(cx).is_ready()
            {
                return Poll::Ready(PumpEnd::Failed(RequestFailed::MessageStalled));
            }
            match ready!(inner.poll_data(cx)) {
                Some(Ok(data)) => {
                    let _ = inner.flow_control().release_capacity(data.len());
                    self.bytes += data.len() as u64;
                    if self.limiter.feed(&data).is_err() {
                        return Poll::Ready(PumpEnd::Failed(RequestFailed::TooLarge));
                    }
                    if !self.limiter.mid_message() {
                        self.message_by = None;
                    } else if self.message_by.is_none() {
                        self.message_by = Some(RequestPump::message_wait());
                    }
                    if !data.is_empty() {
                        // A claim on the window, not the frame's size: h2
                        // raises it to what is buffered when it is sent.
                        self.engine.reserve_capacity(1);
                    }
                    self.held = Some((data, inner.is_end_stream()));
                }
                Some(Err(_)) => {
                    return Poll::Ready(PumpEnd::Failed(RequestFailed::CallerGone));
                }
                // The request's DATA is over: trailers, or its end.
                None => {
                    let sent = match ready!(inner.poll_trailers(cx)) {
                        Ok(Some(trailers)) => send_trailers(&mut self.engine, trailers),
                        Ok(None) => self.engine.send_data(Bytes::new(), true),
                        Err(_) => {
                            return Poll::Ready(PumpEnd::Failed(RequestFailed::CallerGone));
                        }
                    };
                    return Poll::Ready(match sent {
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
        if let Some(body) = self.inner.take()
            && !body.is_end_stream()
        {
            linger(&self.plane, body);
        }
    }
}

/// Reads and drops the rest of a request whose call has ended (answered
/// early: a message over the limit, the engine's status before the request
/// was over, a deadline), until the caller ends it, for a short while.
///
/// Dropping the caller's stream while it still sends makes h2 reset it, and
/// the caller's frames already on their way then count against h2's budget
/// of such resets: past 1,024 on one connection, h2 sends GOAWAY
/// ENHANCE_YOUR_CALM, and every other call of that caller dies with it (a
/// gateway multiplexing its users on one connection would be cut by one).
/// A request that goes on past [`EARLY_END_LINGER`] or the message limit is dropped
/// then (reset).
fn linger(plane: &Plane, body: RecvStream) {
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        runtime.spawn(drain(body, drain_limit(plane), EARLY_END_LINGER));
    }
}

/// The engine's answer on its way to the caller, once its headers went out,
/// and the rest of the caller's request still going into the engine stream.
struct Relay {
    /// `None` once the call is over (the engine stream is dropped, i.e. reset).
    engine: Option<RecvStream>,
    /// The engine's answer read while the caller had no window for it, its
    /// window not yet given back to the engine: so it is at most one engine
    /// stream window (ENGINE_STREAM_WINDOW). Reading it out of h2 at once,
    /// rather than leaving it there, matters: h2 charges every small DATA
    /// frame it holds unread against a budget of its engine connection, and
    /// a few hundred callers that never open their window, each with a
    /// window's worth of tokens held there, spent it; h2 then failed the
    /// engine connection (`too_many_data_frames`) and every call on it.
    held: BytesMut,
    /// The engine's DATA has ended; its trailers are next.
    data_done: bool,
    /// The request while it is still being sent; dropped with `engine` at the end.
    pump: Option<RequestPump>,
    caller: SendStream<Bytes>,
    /// The largest trailers passed on to the caller.
    header_limit: u32,
    limiter: MessageLimiter,
    ends: Endings,
    guard: InFlight,
}

impl Relay {
    /// Relays until the call is over. The cut, the deadline and the request
    /// are looked at once per poll, not per frame: whatever changes them
    /// wakes the call.
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if self.engine.is_none() {
            return Poll::Ready(());
        }
        if let Some(ending) = self.ends.poll(cx) {
            let (outcome, code, message) = ending.status();
            return self.end_with(outcome, code, message);
        }
        match drive_request(&mut self.pump, cx) {
            Ok(()) => {}
            Err(RequestFailed::TooLarge) => return self.end_too_large(),
            Err(RequestFailed::MessageStalled) => {
                let message = message_stalled();
                return self.end_with(
                    CallOutcome::DeadlineExceeded,
                    Code::DeadlineExceeded,
                    &message,
                );
            }
            Err(RequestFailed::CallerGone) => {
                return self.end_with(
                    CallOutcome::CancelledByCaller,
                    Code::Cancelled,
                    CALLER_GONE_MESSAGE,
                );
            }
        }
        loop {
            // What waits for the caller's window goes first.
            let waiting_for_window = !self.held.is_empty()
                && match poll_window(&mut self.caller, cx) {
                    Poll::Ready(Ok(())) => {
                        let held = self.take_held();
                        if self.pass_on(held).is_err() {
                            return Poll::Ready(());
                        }
                        continue;
                    }
                    Poll::Ready(Err(())) => return Poll::Ready(()),
                    Poll::Pending => true,
                };
            let Some(engine) = self.engine.as_mut() else {
                return Poll::Ready(());
            };
            if !self.data_done {
                match engine.poll_data(cx) {
                    Poll::Ready(Some(Ok(data))) => {
                        if self.limiter.feed(&data).is_err() {
                            return self.end_too_large();
                        }
                        if !waiting_for_window && self.caller.capacity() > 0 {
                            if self.pass_on(data).is_err() {
                                return Poll::Ready(());
                            }
                        } else {
                            // Held, its window kept from the engine until it
                            // goes out: the engine sends at the caller's pace.
                            // (The next round asks for the caller's window.)
                            self.hold(&data);
                        }
                        continue;
                    }
                    Poll::Ready(Some(Err(e))) => return self.end_engine_failed(&e),
                    Poll::Ready(None) => self.data_done = true,
                    Poll::Pending => return self.wait_for_engine(cx),
                }
            }
            if waiting_for_window {
                // The answer is all read; the rest of it waits for the
                // caller's window before the trailers can follow.
                return self.wait_for_engine(cx);
            }
            return match engine.poll_trailers(cx) {
                Poll::Ready(Ok(Some(trailers))) => self.end_with_trailers(trailers),
                Poll::Ready(Ok(None)) => {
                    // Ended without trailers (a trailers-only answer never gets
                    // here): no status at all, which the caller reads as an error.
                    self.drop_engine_stream();
                    self.guard.call.set_outcome(CallOutcome::EngineStatus);
                    let _ = self.caller.send_data(Bytes::new(), true);
                    Poll::Ready(())
                }
                Poll::Ready(Err(e)) => self.end_engine_failed(&e),
                Poll::Pending => self.wait_for_engine(cx),
            };
        }
    }

    /// Holds `data` of the answer for the caller, counted in
    /// `llm_sidecar_answer_bytes_held`. The buffer grows by doubling but
    /// never past a stream window unless it must: that is all the engine can
    /// have sent unreleased, and thousands of stalled calls each holding
    /// twice that (a growing buffer's spare room) cost twice the memory.
    fn hold(&mut self, data: &[u8]) {
        let needed = self.held.len() + data.len();
        if self.held.capacity() < needed {
            let room = needed
                .next_power_of_two()
                .min(ENGINE_STREAM_WINDOW as usize)
                .max(needed);
            let mut grown = BytesMut::with_capacity(room);
            grown.extend_from_slice(&self.held);
            self.held = grown;
        }
        self.held.extend_from_slice(data);
        self.held_gauge()
            .fetch_add(data.len() as u64, Ordering::Relaxed);
    }

    /// All that is held, to go on to the caller now.
    fn take_held(&mut self) -> Bytes {
        let held = std::mem::take(&mut self.held).freeze();
        self.held_gauge()
            .fetch_sub(held.len() as u64, Ordering::Relaxed);
        held
    }

    fn held_gauge(&self) -> &std::sync::atomic::AtomicU64 {
        &self.guard.call.plane().counters.answer_bytes_held
    }

    /// Sends `data` of the engine's answer on to the caller and gives its
    /// window back to the engine: the engine may send as much again, its
    /// window being what the caller has not taken yet. `Err`: the caller's
    /// stream is gone.
    fn pass_on(&mut self, data: Bytes) -> Result<(), ()> {
        if let Some(engine) = self.engine.as_mut() {
            let _ = engine.flow_control().release_capacity(data.len());
        }
        if self.guard.bytes == 0 && !data.is_empty() {
            self.guard.call.first_message_sent();
        }
        self.guard.bytes += data.len() as u64;
        self.caller.send_data(data, false).map_err(|_| ())
    }

    /// Waits for the engine, and for the caller's reset: a caller who gives
    /// up ends the call now (the engine stream is reset when it is dropped).
    fn wait_for_engine(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        self.caller.poll_reset(cx).map(|_| ())
    }

    /// Ends the call with a status in the trailers, dropping the engine stream.
    fn end_with(&mut self, outcome: CallOutcome, code: Code, message: &str) -> Poll<()> {
        self.drop_engine_stream();
        self.guard.call.set_outcome(outcome);
        let _ = send_trailers(&mut self.caller, status_trailers(code, message));
        Poll::Ready(())
    }

    /// Drops both halves of the engine stream: the call is over (a reset, if
    /// the stream was not).
    fn drop_engine_stream(&mut self) {
        self.engine = None;
        self.pump = None;
    }

    /// Ends the call because a message, either way, was over the limit.
    fn end_too_large(&mut self) -> Poll<()> {
        let message = too_large_message(self.limiter.limit());
        self.end_with(CallOutcome::TooLarge, Code::ResourceExhausted, &message)
    }

    /// Ends the call because the engine stream broke mid-call: retryable elsewhere.
    fn end_engine_failed(&mut self, e: &h2::Error) -> Poll<()> {
        let message = format!("engine stream failed: {}", crate::report::error_chain(e));
        self.end_with(CallOutcome::EngineFailed, Code::Unavailable, &message)
    }

    /// Passes on the engine's trailers, which end the call.
    fn end_with_trailers(&mut self, trailers: http::HeaderMap) -> Poll<()> {
        if header_list_size(&trailers) > self.header_limit as usize {
            let message = too_large_headers_message(self.header_limit);
            return self.end_with(CallOutcome::TooLarge, Code::ResourceExhausted, &message);
        }
        self.guard
            .call
            .set_outcome(CallOutcome::of_engine_status(trailers.get("grpc-status")));
        self.drop_engine_stream();
        let _ = send_trailers(&mut self.caller, trailers);
        Poll::Ready(())
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.take_held();
    }
}

/// A caller's request as an HTTP body, for the services answered here.
struct RequestBody {
    inner: RecvStream,
    data_done: bool,
}

impl RequestBody {
    fn new(inner: RecvStream) -> Self {
        RequestBody {
            inner,
            data_done: false,
        }
    }
}

impl HttpBody for RequestBody {
    type Data = Bytes;
    type Error = h2::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, h2::Error>>> {
        let this = &mut *self;
        if !this.data_done {
            match ready!(this.inner.poll_data(cx)) {
                Some(Ok(data)) => {
                    let _ = this.inner.flow_control().release_capacity(data.len());
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Some(Err(e)) => return Poll::Ready(Some(Err(e))),
                None => this.data_done = true,
            }
        }
        Poll::Ready(
            ready!(this.inner.poll_trailers(cx))
                .transpose()
                .map(|t| t.map(Frame::trailers)),
        )
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }
}

/// Sends a response made here (the sidecar's own health) to the caller: its
/// headers, then its body frame by frame as the caller's window allows.
async fn send_body(mut respond: SendResponse<Bytes>, response: http::Response<Body>) {
    let (parts, mut body) = response.into_parts();
    let end_of_stream = body.is_end_stream();
    let Ok(mut caller) =
        respond.send_response(http::Response::from_parts(parts, ()), end_of_stream)
    else {
        return;
    };
    if end_of_stream {
        return;
    }
    poll_fn(|cx| {
        loop {
            if ready!(poll_window(&mut caller, cx)).is_err() {
                return Poll::Ready(());
            }
            let frame = match Pin::new(&mut body).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => frame,
                Poll::Ready(Some(Err(_))) => {
                    caller.send_reset(h2::Reason::INTERNAL_ERROR);
                    return Poll::Ready(());
                }
                Poll::Ready(None) => {
                    let _ = caller.send_data(Bytes::new(), true);
                    return Poll::Ready(());
                }
                // A caller who gives up ends the answer now.
                Poll::Pending => return caller.poll_reset(cx).map(|_| ()),
            };
            match frame.into_data() {
                Ok(data) => {
                    let end = body.is_end_stream();
                    if caller.send_data(data, end).is_err() || end {
                        return Poll::Ready(());
                    }
                }
                Err(frame) => {
                    if let Ok(trailers) = frame.into_trailers() {
                        let _ = send_trailers(&mut caller, trailers);
                        return Poll::Ready(());
                    }
                }
            }
        }
    })
    .await;
}
