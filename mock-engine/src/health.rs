//! grpc.health.v1 as the spec (and grpcio) has it: Watch on an unknown service
//! sends SERVICE_UNKNOWN and keeps the stream open; only changes are sent.
//! For vLLM and SGLang as the smg servicers have it: one message, then the end.
//! The control endpoint can make Watch hold back its first message, answer an
//! unknown service with NOT_FOUND (as tonic-health does), end cleanly, fail,
//! or end without trailers ([`TrailerSwitch`]).

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};

use tokio_stream::Stream;
use tonic::body::Body;
use tonic::codegen::{BoxFuture, Bytes, Service, http};
use tonic::server::NamedService;
use tonic::{Request, Response, Status};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};

use crate::{EngineKind, State, WatchControl};

pub(crate) struct Health {
    pub(crate) state: Arc<State>,
}

type WatchStream = Pin<Box<dyn Stream<Item = Result<HealthCheckResponse, Status>> + Send>>;

#[tonic::async_trait]
impl tonic_health::pb::health_server::Health for Health {
    async fn check(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<HealthCheckResponse>, Status> {
        let service = request.into_inner().service;
        match self.state.status_of(&service) {
            Some(status) => Ok(Response::new(HealthCheckResponse { status })),
            None => Err(Status::not_found(format!("unknown service {service:?}"))),
        }
    }

    type WatchStream = WatchStream;

    async fn watch(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<WatchStream>, Status> {
        let service = request.into_inner().service;
        let state = self.state.clone();
        // vLLM's native server runs tonic-health, which fails a Watch on an
        // unregistered name NOT_FOUND.
        let tonic_health = state.config.kind == EngineKind::VllmNative;
        if (state.config.watch_unknown_not_found || tonic_health)
            && state.status_of(&service).is_none()
        {
            return Err(Status::not_found(format!(
                "service {service:?} not registered"
            )));
        }
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        let mut changed = state.changed.subscribe();
        let mut control = state.watch_control.subscribe();
        tokio::spawn(async move {
            state.counters.watch_streams.fetch_add(1, Ordering::Relaxed);
            let current = |s: &State| {
                s.status_of(&service)
                    .unwrap_or(ServingStatus::ServiceUnknown as i32)
            };
            let mut hold = state.hold_watch.subscribe();
            tokio::select! {
                () = tx.closed() => return,
                held = hold.wait_for(|held| !held) => if held.is_err() { return },
            }
            let mut last = current(&state);
            if tx
                .send(Ok(HealthCheckResponse { status: last }))
                .await
                .is_err()
            {
                return;
            }
            // The smg servicers (vLLM, SGLang) answer one message and end the
            // stream; SGLang fails an unknown service NOT_FOUND after it.
            match state.config.kind {
                EngineKind::Trtllm | EngineKind::OpenEngine | EngineKind::VllmNative => {}
                // (SGLang's native server has no grpc.health.v1 at all.)
                EngineKind::Vllm | EngineKind::SglangNative => return,
                EngineKind::Sglang => {
                    if last == ServingStatus::ServiceUnknown as i32 {
                        let _ = tx
                            .send(Err(Status::not_found(format!(
                                "service {service:?} not registered"
                            ))))
                            .await;
                    }
                    return;
                }
            }
            loop {
                tokio::select! {
                    () = tx.closed() => return,
                    c = changed.changed() => {
                        if c.is_err() || state.stopping.load(Ordering::Acquire) { return; }
                        let now = current(&state);
                        if now != last {
                            last = now;
                            if tx.send(Ok(HealthCheckResponse { status: now })).await.is_err() {
                                return;
                            }
                        }
                    }
                    msg = control.recv() => match msg {
                        Ok(WatchControl::End) => return,
                        Ok(WatchControl::Fail { code, message }) => {
                            let _ = tx.send(Err(Status::new(tonic::Code::from_i32(code), message))).await;
                            return;
                        }
                        Err(_) => return,
                    },
                }
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }
}

/// Wraps the health service so that, once the control endpoint asked for it
/// (`/watch/end?trailers=false`), a response stream that ends does so without
/// its trailers: HTTP/2 END_STREAM on a DATA frame, no `grpc-status`.
#[derive(Clone)]
pub(crate) struct TrailerSwitch<S> {
    inner: S,
    state: Arc<State>,
}

impl<S> TrailerSwitch<S> {
    pub(crate) fn new(inner: S, state: Arc<State>) -> Self {
        TrailerSwitch { inner, state }
    }
}

impl<S: NamedService> NamedService for TrailerSwitch<S> {
    const NAME: &'static str = S::NAME;
}

impl<S> Service<http::Request<Body>> for TrailerSwitch<S>
where
    S: Service<http::Request<Body>, Response = http::Response<Body>, Error = Infallible>,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Infallible>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let response = self.inner.call(request);
        let state = self.state.clone();
        Box::pin(async move {
            let response = response.await?;
            Ok(response.map(|inner| Body::new(MaybeTrailers { inner, state })))
        })
    }
}

/// A response body that drops its trailers when the switch is on.
struct MaybeTrailers {
    inner: Body,
    state: Arc<State>,
}

impl http_body::Body for MaybeTrailers {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Status>>> {
        match Pin::new(&mut self.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame)))
                if frame.is_trailers()
                    && self.state.end_without_trailers.load(Ordering::Acquire) =>
            {
                Poll::Ready(None)
            }
            other => other,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }
}
