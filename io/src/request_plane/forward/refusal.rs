//! What a call that is not forwarded whole still sends: read and dropped
//! for a bounded while, so that answering it early never resets a stream
//! the caller is still writing (h2 counts such resets per connection).

use std::future::poll_fn;
use std::time::Duration;

use h2::RecvStream;

use crate::request_plane::Plane;
use crate::request_plane::framing::PREFIX_LEN;

/// How long a refused call's request may take to arrive before it is answered.
pub(super) const REFUSED_BODY_WAIT: Duration = Duration::from_millis(250);

/// How long the rest of an early-ended call's request is read and dropped
/// before its stream is let go (see [`linger`]).
pub(super) const EARLY_END_LINGER: Duration = Duration::from_secs(2);

/// Reads a refused call's request to its end before it is answered.
///
/// Answering while the caller is still sending makes HTTP/2 reset the stream,
/// and h2 counts those resets: past 1,024 on one connection it sends GOAWAY
/// ENHANCE_YOUR_CALM, which would kill the calls still draining on that
/// connection (a router retrying into a draining worker reaches that in
/// seconds). A request that does not end within a short wait, or grows past
/// the message limit, is answered anyway.
pub(super) async fn refuse(plane: &Plane, body: RecvStream) {
    drain(body, drain_limit(plane), REFUSED_BODY_WAIT).await;
}

/// What is read of a request being dropped: one message at the limit.
pub(super) fn drain_limit(plane: &Plane) -> u64 {
    u64::from(plane.limits.max_message_bytes) + PREFIX_LEN as u64
}

/// Reads and drops a request's DATA (giving its window back) until it ends,
/// passes `limit` bytes, or `wait` runs out.
pub(super) async fn drain(mut body: RecvStream, limit: u64, wait: Duration) {
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
pub(super) fn linger(plane: &Plane, body: RecvStream) {
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        runtime.spawn(drain(body, drain_limit(plane), EARLY_END_LINGER));
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;
    use crate::request_plane::forward::pair;

    /// The request of a call answered early is read to its end, its window
    /// given back as it goes: a caller sending more than one stream window
    /// (64 KiB) is never stalled, and the drain ends with the request, long
    /// before its wait (the clock is paused: it moves only when everything
    /// waits, so a stalled drain would end exactly at its wait).
    #[tokio::test(start_paused = true)]
    async fn a_request_is_read_to_its_end_with_its_window_given_back() {
        let pair::Stream {
            mut caller,
            request,
            respond: _respond,
            ..
        } = pair::open().await;
        let wait = Duration::from_secs(5);
        let started = tokio::time::Instant::now();
        // The caller sends 12 frames of 16 KiB, three windows' worth, then
        // ends its request; it stalls for good if the window never comes back.
        tokio::spawn(async move {
            let frame = Bytes::from(vec![7u8; 16 << 10]);
            for _ in 0..12 {
                caller.reserve_capacity(frame.len());
                while caller.capacity() < frame.len() {
                    match std::future::poll_fn(|cx| caller.poll_capacity(cx)).await {
                        Some(Ok(_)) => {}
                        _ => return,
                    }
                }
                if caller.send_data(frame.clone(), false).is_err() {
                    return;
                }
            }
            let _ = caller.send_data(Bytes::new(), true);
        });
        drain(request.into_body(), u64::MAX, wait).await;
        assert!(
            started.elapsed() < wait,
            "ended with the request, not at the wait: {:?}",
            started.elapsed()
        );
    }

    /// A request that never ends is read until the wait, then let go.
    #[tokio::test(start_paused = true)]
    async fn a_request_that_never_ends_is_let_go_at_the_wait() {
        let pair::Stream {
            mut caller,
            request,
            respond: _respond,
            ..
        } = pair::open().await;
        caller
            .send_data(Bytes::from_static(b"half"), false)
            .expect("sent");
        let wait = Duration::from_secs(5);
        let started = tokio::time::Instant::now();
        drain(request.into_body(), u64::MAX, wait).await;
        assert_eq!(started.elapsed(), wait);
    }
}
