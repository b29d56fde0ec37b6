//! Caller to engine: the request moved into the engine stream frame by
//! frame, at the engine's window, with a half-sent message timed.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Bytes;
use h2::{RecvStream, SendStream};

use super::answer::REQUEST_START_WAIT;
use super::refusal::linger;
use super::send_trailers;
use crate::request_plane::Plane;
use crate::request_plane::framing::MessageLimiter;

/// How long a request message, once begun, may take to arrive whole: a call
/// whose message stalls half-sent holds its engine stream (the engine waits
/// for the rest) no longer than this, and is answered DEADLINE_EXCEEDED. A
/// caller may wait as long as it likes between messages.
pub(super) const MESSAGE_ARRIVAL_WAIT: Duration = REQUEST_START_WAIT;

/// The status message of a call whose request message stalled half-sent.
pub(super) fn message_stalled() -> String {
    format!(
        "a request message did not arrive whole within {} of its first bytes",
        llm_sidecar_core::HumanDuration(MESSAGE_ARRIVAL_WAIT)
    )
}

/// The caller's request on its way into the engine stream, frame by frame:
/// each DATA frame is read from the caller only once the previous one went out,
/// and sent once the engine stream has window for it, so a caller can never
/// make the sidecar hold more than one frame of its request.
pub(super) struct RequestPump {
    /// The caller's request; `None` only once dropped (see `Drop`).
    pub(super) inner: Option<RecvStream>,
    pub(super) engine: SendStream<Bytes>,
    /// A DATA frame read and waiting for window, and whether it ends the request.
    pub(super) held: Option<(Bytes, bool)>,
    pub(super) limiter: MessageLimiter,
    /// Armed while a message is half-sent: it must arrive whole by then.
    /// Never made for a caller whose messages come whole in their frames.
    pub(super) message_by: Option<Pin<Box<tokio::time::Sleep>>>,
    pub(super) plane: Arc<Plane>,
    /// Bytes forwarded, added to the shared counter once, when the pump is dropped:
    /// a shared atomic per frame would bounce its cache line between cores.
    pub(super) bytes: u64,
}

/// How a request stopped going into the engine stream.
pub(super) enum PumpEnd {
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
pub(super) enum RequestFailed {
    /// A message over the limit.
    TooLarge,
    /// The caller's request failed (a reset).
    CallerGone,
    /// A message began and did not arrive whole within [`MESSAGE_ARRIVAL_WAIT`].
    MessageStalled,
}

/// Moves what is left of the request, if anything, into the engine stream,
/// while the answer's headers are awaited and then during the relay. The
/// pump is dropped once it ended; only a failure on the caller's side is
/// returned (an engine stream gone is the response side's to report).
pub(super) fn drive_request(
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
    /// The pump of a request that has begun: `first`, its first DATA (already
    /// fed to `limiter`), goes out first; the rest of `body` after it.
    pub(super) fn start(
        plane: &Arc<Plane>,
        body: RecvStream,
        first: Option<Bytes>,
        limiter: MessageLimiter,
        mut engine: SendStream<Bytes>,
    ) -> RequestPump {
        let ended = body.is_end_stream();
        if first.as_ref().is_some_and(|data| !data.is_empty()) {
            // A claim on the window for it, as the pump makes for every frame.
            engine.reserve_capacity(1);
        }
        RequestPump {
            bytes: first.as_ref().map_or(0, |data| data.len() as u64),
            held: first.map(|data| (data, ended)),
            inner: Some(body),
            engine,
            message_by: limiter.mid_message().then(RequestPump::message_wait),
            limiter,
            plane: plane.clone(),
        }
    }

    /// The time a message begun now has to arrive whole.
    pub(super) fn message_wait() -> Pin<Box<tokio::time::Sleep>> {
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
