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
//!
//! By direction: [`answer`](mod@answer) opens the engine stream and passes the answer's
//! headers on, [`pump`] moves the caller's request into the engine stream,
//! [`relay`] moves the engine's answer to the caller; [`here`] answers what
//! the sidecar answers itself (its own health), and [`refusal`] reads and
//! drops what a call that is not forwarded whole still sends.

mod answer;
mod here;
mod pump;
mod refusal;
mod relay;

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use h2::server::SendResponse;
use h2::{RecvStream, SendStream};
use tokio_util::sync::WaitForCancellationFutureOwned;
use tonic::Code;

use super::Plane;
use super::admitted::Admitted;
use super::calls::Call;
use super::engine_pool::Lease;
use super::frame_watch::OpenCall;
use super::outcome::{CUT_MESSAGE, CallOutcome};
use answer::answer;
use here::{OwnHealthStream, own_health};
use refusal::refuse;
use relay::Relay;

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

/// One HTTP/2 stream between two h2 endpoints over an in-memory pipe, for
/// the frame-level tests of each direction: the caller's side (its request
/// body's sender and its answer) and the sidecar's (the request as the
/// caller connection hands it over, and its respond handle). Both
/// connections are driven by tasks of their own.
#[cfg(test)]
pub(super) mod pair {
    use bytes::Bytes;
    use h2::server::SendResponse;
    use h2::{RecvStream, SendStream};

    pub(crate) struct Stream {
        /// The caller's request body.
        pub(crate) caller: SendStream<Bytes>,
        /// The caller's wait for the answer's headers.
        pub(crate) answer: h2::client::ResponseFuture,
        /// The request as the sidecar reads it.
        pub(crate) request: http::Request<RecvStream>,
        /// The sidecar's side of the answer.
        pub(crate) respond: SendResponse<Bytes>,
    }

    /// A request plane in front of an engine nobody listens for (a call
    /// forwarded to it fails "engine unavailable"), admission as `open`
    /// says, the flags' default limits.
    pub(crate) fn plane(open: bool) -> std::sync::Arc<crate::request_plane::Plane> {
        use crate::request_plane::{EnginePool, Limits, OwnHealth, Plane};
        let settings = crate::Timings::default().engine_channel();
        let pool = EnginePool::new("127.0.0.1:1", settings, Default::default(), Some(1))
            .expect("an address");
        let limits = Limits {
            engine_connections: Some(1),
            ..Limits::DEFAULT
        };
        let plane = Plane::new(pool, &OwnHealth::new(), limits);
        if open {
            plane.gate.open();
        }
        std::sync::Arc::new(plane)
    }

    /// One call of `stream` run by `plane` as its connection runs it.
    pub(crate) fn run(
        plane: &std::sync::Arc<crate::request_plane::Plane>,
        request: http::Request<RecvStream>,
        respond: SendResponse<Bytes>,
    ) -> tokio::task::JoinHandle<()> {
        let address = std::net::IpAddr::from([127, 0, 0, 1]);
        let open = crate::request_plane::frame_watch::Watched::new(address).call_opened();
        tokio::spawn(super::call(plane.clone(), request, respond, open))
    }

    /// A POST to `/svc/method`, its HEADERS sent and its body left open.
    pub(crate) async fn open() -> Stream {
        open_to("/svc/method").await
    }

    /// A POST to `path`, its HEADERS sent and its body left open.
    pub(crate) async fn open_to(path: &str) -> Stream {
        let (caller_io, sidecar_io) = tokio::io::duplex(1 << 20);
        let (accepted_tx, accepted_rx) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            let mut connection = h2::server::handshake(sidecar_io).await.expect("handshake");
            let first = connection.accept().await.expect("a stream").expect("ok");
            let _ = accepted_tx.send(first);
            // Drives the connection until the caller goes.
            while connection.accept().await.is_some() {}
        });
        let (client, connection) = h2::client::handshake(caller_io).await.expect("handshake");
        tokio::spawn(connection);
        let mut client = client.ready().await.expect("ready");
        let request = http::Request::post(format!("http://sidecar{path}"))
            .header("content-type", "application/grpc")
            .body(())
            .expect("a request");
        let (answer, caller) = client.send_request(request, false).expect("sent");
        let (request, respond) = accepted_rx.await.expect("accepted");
        Stream {
            caller,
            answer,
            request,
            respond,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_post_to_a_service_and_method_is_a_grpc_call() {
        let request = |method: &str, path: &str| {
            http::Request::builder()
                .method(method)
                .uri(format!("http://sidecar{path}"))
                .body(())
                .expect("a request")
        };
        assert_eq!(malformed(&request("POST", "/svc/method")), None);
        for (method, path, says) in [
            ("GET", "/svc/method", ":method GET"),
            ("POST", "/", "names no /<service>/<method>"),
            ("POST", "/svc/", "names no /<service>/<method>"),
            ("POST", "//method", "names no /<service>/<method>"),
        ] {
            let why = malformed(&request(method, path)).expect("malformed");
            assert!(why.contains(says), "{method} {path}: {why}");
        }
    }

    #[test]
    fn the_cut_and_the_deadline_end_a_call_with_their_own_status() {
        assert_eq!(
            Ending::Cut.status(),
            (CallOutcome::CutAtDeadline, Code::Unavailable, CUT_MESSAGE)
        );
        assert_eq!(
            Ending::DeadlineExceeded.status(),
            (
                CallOutcome::DeadlineExceeded,
                Code::DeadlineExceeded,
                DEADLINE_MESSAGE
            )
        );
    }

    /// The caller's view of a call answered with a status alone, as a gRPC
    /// client reads it.
    async fn status_of(answer: h2::client::ResponseFuture) -> (Code, String) {
        // Only against a hang: the clock is paused in some of these tests,
        // and then this passes at once when nothing else can happen.
        let head = tokio::time::timeout(std::time::Duration::from_secs(600), answer)
            .await
            .expect("an answer before the hang guard")
            .expect("an answer");
        let status = tonic::Status::from_header_map(head.headers()).expect("a status");
        (status.code(), status.message().to_string())
    }

    /// While admission is closed a call is answered UNAVAILABLE "draining",
    /// once its request was read to its end, and never reaches the engine
    /// (this one has none: forwarded, it would fail "engine unavailable").
    #[tokio::test]
    async fn a_call_while_admission_is_closed_is_refused_draining_and_never_forwarded() {
        let plane = pair::plane(false);
        let pair::Stream {
            mut caller,
            answer,
            request,
            respond,
        } = pair::open().await;
        let call = pair::run(&plane, request, respond);
        caller
            .send_data(Bytes::from_static(b"\0\0\0\0\0"), true)
            .expect("sent");
        assert_eq!(
            status_of(answer).await,
            (Code::Unavailable, "draining".to_string())
        );
        call.await.expect("the call");
        let counters = &plane.counters;
        assert_eq!(counters.ended(CallOutcome::Refused), 1);
        assert_eq!(counters.admitted.load(Ordering::Relaxed), 0);
    }

    /// A forwarded call whose request never begins (HEADERS, then nothing)
    /// is answered DEADLINE_EXCEEDED at the start wait, exactly (the clock
    /// is paused), having never asked for an engine stream: with one, it
    /// would have failed "engine unavailable" at once.
    #[tokio::test(start_paused = true)]
    async fn a_request_that_never_begins_is_answered_at_its_start_wait_without_the_engine() {
        let plane = pair::plane(true);
        let (code, message, after) = silent_call(&plane, "/svc/method").await;
        assert_eq!(code, Code::DeadlineExceeded, "{message}");
        assert!(
            message.contains("first message did not arrive"),
            "{message}"
        );
        assert_eq!(after, answer::REQUEST_START_WAIT);
        assert_eq!(plane.counters.ended(CallOutcome::EngineUnreachable), 0);
        assert_eq!(plane.counters.ended(CallOutcome::DeadlineExceeded), 1);
    }

    /// The sidecar's own health: a request that never arrives (half-open)
    /// is answered DEADLINE_EXCEEDED at its wait, not held.
    #[tokio::test(start_paused = true)]
    async fn an_own_health_request_that_never_comes_is_answered_at_its_wait() {
        let plane = pair::plane(true);
        let (code, message, after) = silent_call(&plane, "/grpc.health.v1.Health/Check").await;
        assert_eq!(code, Code::DeadlineExceeded, "{message}");
        assert_eq!(after, here::OWN_HEALTH_REQUEST_WAIT);
    }

    /// A call to `path` whose caller sends its HEADERS and then nothing,
    /// run to its end: the status it got and when (the clock's time).
    async fn silent_call(plane: &Arc<Plane>, path: &str) -> (Code, String, std::time::Duration) {
        let pair::Stream {
            caller: _caller,
            answer,
            request,
            respond,
        } = pair::open_to(path).await;
        let started = tokio::time::Instant::now();
        let call = pair::run(plane, request, respond);
        let (code, message) = status_of(answer).await;
        let after = started.elapsed();
        call.await.expect("the call");
        (code, message, after)
    }

    /// A status sent as trailers carries the code and the message as gRPC
    /// reads them.
    #[test]
    fn a_status_in_trailers_reads_as_grpc_status_and_message() {
        let trailers = status_trailers(Code::Unavailable, "draining");
        assert_eq!(trailers["grpc-status"], "14");
        assert_eq!(trailers["grpc-message"], "draining");
        let headers = status_headers(Code::Unavailable, "draining");
        assert_eq!(headers.headers()["grpc-status"], "14");
        assert_eq!(headers.headers()["content-type"], "application/grpc");
    }
}
