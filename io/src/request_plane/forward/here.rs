//! What the sidecar answers itself: its own `grpc.health.v1`, bounded per
//! connection and in all, its request read as an HTTP body and its answer
//! sent at the caller's window.

use std::future::poll_fn;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Bytes;
use h2::RecvStream;
use h2::server::SendResponse;
use http_body::{Body as HttpBody, Frame};
use tonic::Code;
use tonic::body::Body;
use tonic::codegen::Service;

use super::relay::poll_window;
use super::{send_status, send_trailers};
use crate::request_plane::Plane;
use crate::request_plane::frame_watch::OpenCall;

/// Own-health streams one caller connection may hold: a router watches a
/// worker with one, a load balancer's checks come one at a time.
pub(super) const OWN_HEALTH_PER_CONNECTION: usize = 16;

/// Own-health streams the sidecar holds at once, every connection together:
/// a few kilobytes each, so a few megabytes at most.
pub(super) const OWN_HEALTH_STREAMS: u64 = 1024;

/// How long an own-health call's request message may take to arrive: a
/// stream opened and never sent its request (half-open) is answered then,
/// rather than held for ever.
pub(super) const OWN_HEALTH_REQUEST_WAIT: Duration = Duration::from_secs(5);

/// One own-health stream, counted on its connection and in the sidecar's
/// total while it is open.
pub(super) struct OwnHealthStream<'a> {
    pub(super) plane: &'a Plane,
    pub(super) _slot: crate::request_plane::frame_watch::OwnHealthSlot,
}

impl<'a> OwnHealthStream<'a> {
    /// A place for one more own-health stream, if its connection and the
    /// sidecar have room.
    pub(super) fn take(plane: &'a Plane, open: &OpenCall) -> Option<Self> {
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
pub(super) async fn own_health(
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

/// A caller's request as an HTTP body, for the services answered here.
pub(super) struct RequestBody {
    pub(super) inner: RecvStream,
    pub(super) data_done: bool,
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
pub(super) async fn send_body(mut respond: SendResponse<Bytes>, response: http::Response<Body>) {
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
