//! A forwarded call up to the engine's answer headers: the engine stream
//! opened once the request has begun, the request on its way into it, the
//! headers passed on to the caller (or the status that ends the call
//! instead).

use std::future::{Future, poll_fn};
use std::net::IpAddr;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use h2::RecvStream;
use h2::server::SendResponse;
use tonic::Code;

use super::pump::{RequestFailed, RequestPump, drive_request, message_stalled};
use super::refusal::linger;
use super::relay::Relay;
use super::{CALLER_GONE_MESSAGE, Ending, Endings, InFlight, send_status};
use crate::request_plane::Plane;
use crate::request_plane::admitted::Admitted;
use crate::request_plane::engine_pool::Lease;
use crate::request_plane::framing::{
    MessageLimiter, grpc_timeout, header_list_size, too_large_headers_message, too_large_message,
};
use crate::request_plane::outcome::CallOutcome;
use crate::request_plane::unanswered_stream::UnansweredStream;

/// How long a forwarded call's request may take to begin (its first DATA
/// after its HEADERS): a half-open call is answered then, and never holds an
/// engine stream meanwhile.
pub(super) const REQUEST_START_WAIT: Duration = Duration::from_secs(10);

/// Why a call ended before the engine's answer headers were passed on.
pub(super) enum Unanswered {
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
pub(super) async fn answer(
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
pub(super) async fn engine_answer(
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
        match begun(&mut body, &mut limiter, ends, respond).await {
            Ok(first) => first,
            Err(why) => {
                linger(plane, body);
                return Err(why);
            }
        }
    };
    let opened = open_engine_stream(plane, lease, address, request, end_of_stream, ends, respond);
    let (answer, engine_stream) = match opened.await {
        Ok(opened) => opened,
        Err(why) => {
            if !end_of_stream {
                linger(plane, body);
            }
            return Err(why);
        }
    };
    let mut pump =
        (!end_of_stream).then(|| RequestPump::start(plane, body, first, limiter, engine_stream));
    let head = answer_head(plane, lease, answer, &mut pump, ends, respond).await?;
    Ok((head, pump))
}

/// The request's first DATA (`None`: it ended without one), counted against
/// the message limit, once it came (`request_start`).
async fn begun(
    body: &mut RecvStream,
    limiter: &mut MessageLimiter,
    ends: &mut Endings,
    respond: &mut SendResponse<Bytes>,
) -> Result<Option<Bytes>, Unanswered> {
    let first = request_start(body, ends, respond).await?;
    if let Some(data) = &first
        && limiter.feed(data).is_err()
    {
        return Err(Unanswered::Request(RequestFailed::TooLarge));
    }
    Ok(first)
}

/// An engine stream first (at once, or in turn with other caller addresses
/// when they run short), then an engine connection: the least busy among
/// the calls that have one, so a call waiting here counts on no connection.
/// The request's HEADERS go out on it; the lease is kept in `lease`.
async fn open_engine_stream(
    plane: &Arc<Plane>,
    lease: &mut Option<Lease>,
    address: IpAddr,
    request: http::Request<()>,
    end_of_stream: bool,
    ends: &mut Endings,
    respond: &mut SendResponse<Bytes>,
) -> Result<(h2::client::ResponseFuture, h2::SendStream<Bytes>), Unanswered> {
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
}

/// The answer's headers, while the request goes out. Given up before they
/// come, the engine stream is reset only once the engine has taken it
/// (`unanswered_stream`): the lease goes with it till then, and comes back
/// to `lease` with the headers.
async fn answer_head(
    plane: &Plane,
    lease: &mut Option<Lease>,
    answer: h2::client::ResponseFuture,
    pump: &mut Option<RequestPump>,
    ends: &mut Endings,
    respond: &mut SendResponse<Bytes>,
) -> Result<http::Response<RecvStream>, Unanswered> {
    let mut awaiting =
        UnansweredStream::new(answer, lease.take(), plane.counters.unanswered.clone());
    poll_fn(|cx| {
        if let Some(ending) = ends.poll(cx) {
            return Poll::Ready(Err(Unanswered::Ended(ending)));
        }
        if let Err(failed) = drive_request(pump, cx) {
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
    .await
}

/// Ends a call that got no answer headers from the engine: its outcome, and
/// the status the caller reads (none for a caller gone: dropping the call
/// resets the engine stream, and the outcome is the caller's cancel).
pub(super) fn unanswered(
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

/// Waits for the request to begin: its first DATA (returned, its window
/// given back), or its end without any (`None`), for at most
/// [`REQUEST_START_WAIT`]. A well-behaved caller sends its HEADERS and first
/// DATA together, so this is ready at its first poll.
pub(super) async fn request_start(
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
