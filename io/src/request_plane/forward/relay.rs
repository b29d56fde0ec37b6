//! Engine to caller: the answer moved to the caller frame by frame at the
//! caller's window, held (within one engine stream window) while the caller
//! has none, and the call ended by the engine's trailers, the cut, the
//! deadline, a limit, or either side going away.

use std::sync::atomic::Ordering;
use std::task::{Context, Poll, ready};

use bytes::{Bytes, BytesMut};
use h2::{RecvStream, SendStream};
use tonic::Code;

use super::pump::{RequestFailed, RequestPump, drive_request, message_stalled};
use super::{CALLER_GONE_MESSAGE, Endings, InFlight, send_trailers, status_trailers};
use crate::engine::ENGINE_STREAM_WINDOW;
use crate::request_plane::framing::{
    MessageLimiter, header_list_size, too_large_headers_message, too_large_message,
};
use crate::request_plane::outcome::CallOutcome;

/// `Ready` once the caller's stream has window for more data: the engine's
/// answer is read only as fast as the caller takes it, so what the sidecar
/// holds for a slow caller is bounded by that caller's window. `Err`: the
/// caller's stream is gone (reset, or its connection failed).
pub(super) fn poll_window(
    caller: &mut SendStream<Bytes>,
    cx: &mut Context<'_>,
) -> Poll<Result<(), ()>> {
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

/// The engine's answer on its way to the caller, once its headers went out,
/// and the rest of the caller's request still going into the engine stream.
pub(super) struct Relay {
    /// `None` once the call is over (the engine stream is dropped, i.e. reset).
    pub(super) engine: Option<RecvStream>,
    /// The engine's answer read while the caller had no window for it, its
    /// window not yet given back to the engine: so it is at most one engine
    /// stream window (ENGINE_STREAM_WINDOW). Reading it out of h2 at once,
    /// rather than leaving it there, matters: h2 charges every small DATA
    /// frame it holds unread against a budget of its engine connection, and
    /// a few hundred callers that never open their window, each with a
    /// window's worth of tokens held there, spent it; h2 then failed the
    /// engine connection (`too_many_data_frames`) and every call on it.
    pub(super) held: BytesMut,
    /// The engine's DATA has ended; its trailers are next.
    pub(super) data_done: bool,
    /// The request while it is still being sent; dropped with `engine` at the end.
    pub(super) pump: Option<RequestPump>,
    pub(super) caller: SendStream<Bytes>,
    /// The largest trailers passed on to the caller.
    pub(super) header_limit: u32,
    pub(super) limiter: MessageLimiter,
    pub(super) ends: Endings,
    pub(super) guard: InFlight,
}

impl Relay {
    /// Relays until the call is over. The cut, the deadline and the request
    /// are looked at once per poll, not per frame: whatever changes them
    /// wakes the call.
    pub(super) fn poll(&mut self, cx: &mut Context<'_>) -> Poll<()> {
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

#[cfg(test)]
mod tests {
    use std::future::poll_fn;

    use super::*;
    use crate::request_plane::forward::pair;

    /// A frame of the answer, as an engine's message might come.
    const FRAME: usize = 16 << 10;

    /// The answer goes to the caller only as fast as it opens its window,
    /// as the relay sends it (a frame whenever `poll_window` is ready): with
    /// the window spent it waits, the caller reading (and giving window
    /// back) makes it ready, and the caller resetting its stream makes it an
    /// error.
    #[tokio::test]
    async fn the_answer_waits_for_the_callers_window_and_sees_its_reset() {
        let pair::Stream {
            answer,
            mut respond,
            mut caller,
            ..
        } = pair::open().await;
        let mut sending = respond
            .send_response(http::Response::new(()), false)
            .expect("headers");
        let mut answer = answer.await.expect("the caller's answer").into_body();
        let window = 65_535;
        let sent = spend_window(&mut sending).await;
        assert!(
            (window..window + FRAME).contains(&sent),
            "the caller's window and no more than one frame beyond it: {sent}"
        );
        // The caller reads what came and gives its window back.
        let mut read = 0;
        while read < window {
            let data = answer.data().await.expect("a frame").expect("data");
            read += data.len();
            answer
                .flow_control()
                .release_capacity(data.len())
                .expect("released");
        }
        poll_fn(|cx| poll_window(&mut sending, cx))
            .await
            .expect("window again");
        spend_window(&mut sending).await;
        // The caller resets its stream: the answer's side sees it.
        caller.send_reset(h2::Reason::CANCEL);
        let gone = poll_fn(|cx| poll_window(&mut sending, cx)).await;
        assert_eq!(gone, Err(()), "the caller's reset ends the wait");
    }

    /// Sends a frame whenever `poll_window` is ready, letting the
    /// connection write between frames, until it waits; returns the bytes
    /// sent.
    async fn spend_window(sending: &mut SendStream<Bytes>) -> usize {
        let mut sent = 0;
        loop {
            for _ in 0..8 {
                tokio::task::yield_now().await;
            }
            match poll_fn(|cx| Poll::Ready(poll_window(sending, cx))).await {
                Poll::Ready(Ok(())) => {
                    sending
                        .send_data(Bytes::from(vec![1u8; FRAME]), false)
                        .expect("sent");
                    sent += FRAME;
                }
                Poll::Pending => return sent,
                Poll::Ready(Err(())) => panic!("the caller is there (after {sent} bytes)"),
            }
        }
    }
}
