//! An engine stream whose answer has not begun: reset only once the engine
//! has taken it.
//!
//! Why: an HTTP/2 server counts the streams its peer resets before the
//! server's own code took them from its accept queue, and cuts the whole
//! connection past a small number of them (h2, the server under tonic and
//! hyper, sends GOAWAY ENHANCE_YOUR_CALM "too_many_resets" past 20: its guard
//! against rapid reset). Every caller's call on that engine connection then
//! fails. A caller that resets its calls a moment after sending them (or
//! many callers giving up at once, or a caller connection dropped with
//! hundreds of calls on it) makes the sidecar reset engine streams at that
//! rate; whenever the engine falls behind taking them (a pause of its event
//! loop, a loaded node) the resets reach it before it took the streams.
//!
//! So a call that ends before the engine's answer headers came does not
//! reset its engine stream then: the stream is kept (its request is not sent
//! on) until those headers come, which proves the engine took it, and only
//! then dropped (reset), or after [`UNANSWERED_RESET_WAIT`] if they never
//! come. The call's place among its caller address's engine streams and its
//! engine connection's streams is held meanwhile, so a caller resetting its
//! calls can keep no more of them waiting than it may have open.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use h2::RecvStream;
use h2::client::ResponseFuture;

use super::engine_pool::Lease;

/// How long a stream given up before its answer began waits for the engine's
/// headers before it is reset anyway. An engine that has not answered by
/// then has long taken the stream from its accept queue (unless it is
/// stalled, which its keepalive tells); what waiting costs is that the
/// engine goes on with a request nobody wants, this long at most.
pub(crate) const UNANSWERED_RESET_WAIT: Duration = Duration::from_secs(1);

/// What `/metrics` shows of the streams kept until the engine takes them.
#[derive(Debug, Default)]
pub(crate) struct UnansweredCounts {
    /// Engine streams given up before their answer began, not reset yet.
    pub(crate) waiting: AtomicU64,
    /// Of those, reset after [`UNANSWERED_RESET_WAIT`] with no answer.
    pub(crate) reset_after_wait: AtomicU64,
}

/// The engine's answer headers, or why they did not come.
pub(crate) type Head = Result<http::Response<RecvStream>, h2::Error>;

/// The engine's answer to a call, before its headers came, with the call's
/// hold on its engine connection. Dropped before the headers came, it keeps
/// the engine stream until they do (see the module's doc).
pub(crate) struct UnansweredStream {
    /// `None` once the answer's headers (or its failure) came.
    answer: Option<ResponseFuture>,
    lease: Option<Lease>,
    counts: Arc<UnansweredCounts>,
}

impl UnansweredStream {
    pub(crate) fn new(
        answer: ResponseFuture,
        lease: Option<Lease>,
        counts: Arc<UnansweredCounts>,
    ) -> Self {
        UnansweredStream {
            answer: Some(answer),
            lease,
            counts,
        }
    }

    /// The answer's headers, once they came; the lease goes back to the
    /// call with them.
    pub(crate) fn poll_answer(&mut self, cx: &mut Context<'_>) -> Poll<(Head, Option<Lease>)> {
        let Some(answer) = self.answer.as_mut() else {
            return Poll::Pending;
        };
        let head = std::task::ready!(Pin::new(answer).poll(cx));
        self.answer = None;
        Poll::Ready((head, self.lease.take()))
    }
}

impl Drop for UnansweredStream {
    fn drop(&mut self) {
        let Some(answer) = self.answer.take() else {
            return;
        };
        let lease = self.lease.take();
        let counts = self.counts.clone();
        // Without a runtime (the process is ending) the stream is reset now.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            counts.waiting.fetch_add(1, Ordering::Relaxed);
            runtime.spawn(async move {
                // Headers, a failure or the wait's end: the stream (reset if it
                // is still open) and the lease go when this ends.
                if tokio::time::timeout(UNANSWERED_RESET_WAIT, answer)
                    .await
                    .is_err()
                {
                    counts.reset_after_wait.fetch_add(1, Ordering::Relaxed);
                }
                drop(lease);
                counts.waiting.fetch_sub(1, Ordering::Relaxed);
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use std::future::poll_fn;
    use tokio::sync::mpsc;

    /// An h2 client and server over memory: the client's sender, and the
    /// server's side of each stream as it is taken from the accept queue.
    async fn pair() -> (
        h2::client::SendRequest<Bytes>,
        mpsc::UnboundedReceiver<h2::server::SendResponse<Bytes>>,
    ) {
        let (client_io, server_io) = tokio::io::duplex(1 << 16);
        let server = tokio::spawn(async move {
            let mut conn = h2::server::handshake(server_io)
                .await
                .expect("server handshake");
            let (taken, streams) = mpsc::unbounded_channel();
            tokio::spawn(async move {
                while let Some(Ok((_request, respond))) = conn.accept().await {
                    let _ = taken.send(respond);
                }
            });
            streams
        });
        let (sender, conn) = h2::client::handshake(client_io)
            .await
            .expect("client handshake");
        tokio::spawn(conn);
        (sender, server.await.expect("server task"))
    }

    /// Sends a call and gives it up at once, before any answer.
    async fn given_up_at_once(
        sender: &mut h2::client::SendRequest<Bytes>,
        counts: &Arc<UnansweredCounts>,
    ) {
        let request = http::Request::post("http://engine/svc/Method")
            .body(())
            .unwrap();
        let mut sender = sender.clone().ready().await.expect("ready");
        let (answer, _request_body) = sender.send_request(request, true).expect("sent");
        drop(UnansweredStream::new(answer, None, counts.clone()));
    }

    /// The counts (waiting, reset after the wait) once the stream's task had
    /// time to end.
    async fn settled(counts: &UnansweredCounts) -> (u64, u64) {
        tokio::time::sleep(Duration::from_millis(100)).await;
        (
            counts.waiting.load(Ordering::Relaxed),
            counts.reset_after_wait.load(Ordering::Relaxed),
        )
    }

    /// The reset the engine's side of a stream gets within `limit`, if any.
    async fn reset_within(
        limit: Duration,
        mut poll_reset: impl FnMut(&mut Context<'_>) -> Poll<Result<h2::Reason, h2::Error>>,
    ) -> Option<h2::Reason> {
        tokio::time::timeout(limit, poll_fn(|cx| poll_reset(cx)))
            .await
            .ok()
            .map(|reset| reset.expect("a reset"))
    }

    #[tokio::test]
    async fn a_stream_given_up_before_its_answer_is_reset_once_the_engine_answered() {
        let (mut sender, mut taken) = pair().await;
        let counts = Arc::new(UnansweredCounts::default());
        given_up_at_once(&mut sender, &counts).await;
        let mut respond = taken.recv().await.expect("the engine took the stream");
        assert_eq!(counts.waiting.load(Ordering::Relaxed), 1);
        let early = reset_within(Duration::from_millis(300), |cx| respond.poll_reset(cx)).await;
        assert_eq!(early, None, "no reset before the engine answered");
        let mut answered = respond
            .send_response(http::Response::new(()), false)
            .expect("headers sent");
        let reset = reset_within(Duration::from_secs(10), |cx| answered.poll_reset(cx)).await;
        assert_eq!(reset, Some(h2::Reason::CANCEL), "reset once answered");
        assert_eq!(settled(&counts).await, (0, 0));
    }

    #[tokio::test]
    async fn a_stream_never_answered_is_reset_after_the_wait() {
        let (mut sender, mut taken) = pair().await;
        let counts = Arc::new(UnansweredCounts::default());
        let given_up = tokio::time::Instant::now();
        given_up_at_once(&mut sender, &counts).await;
        let mut respond = taken.recv().await.expect("the engine took the stream");
        let reset = reset_within(Duration::from_secs(10), |cx| respond.poll_reset(cx)).await;
        assert_eq!(reset, Some(h2::Reason::CANCEL), "reset after the wait");
        assert!(given_up.elapsed() >= UNANSWERED_RESET_WAIT);
        assert_eq!(settled(&counts).await, (0, 1));
    }
}
