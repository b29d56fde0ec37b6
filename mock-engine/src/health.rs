//! grpc.health.v1 as the spec (and grpcio) has it: Watch on an unknown service
//! sends SERVICE_UNKNOWN and keeps the stream open; only changes are sent.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use tokio_stream::Stream;
use tonic::{Request, Response, Status};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};

use crate::{State, WatchControl};

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
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        let mut changed = state.changed.subscribe();
        let mut control = state.watch_control.subscribe();
        tokio::spawn(async move {
            state.counters.watch_streams.fetch_add(1, Ordering::Relaxed);
            let current = |s: &State| {
                s.status_of(&service)
                    .unwrap_or(ServingStatus::ServiceUnknown as i32)
            };
            let mut last = current(&state);
            if tx
                .send(Ok(HealthCheckResponse { status: last }))
                .await
                .is_err()
            {
                return;
            }
            loop {
                tokio::select! {
                    () = tx.closed() => return,
                    c = changed.changed() => {
                        if c.is_err() { return; }
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
