//! The sidecar's own `grpc.health.v1` on the request port: SERVING exactly while
//! the lifecycle is Serving (invariant 8), for `""` and for the engine service's
//! name, so health-checking routers see the worker leave before calls fail.

use std::pin::Pin;

use tokio::sync::watch;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_server::{Health, HealthServer};
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};

/// The sidecar's health service; `set` changes what every client sees.
#[derive(Clone)]
pub(crate) struct OwnHealth {
    status: watch::Sender<i32>,
    engine_service: &'static str,
}

impl OwnHealth {
    pub(crate) fn new(engine_service: &'static str) -> Self {
        OwnHealth {
            status: watch::channel(ServingStatus::NotServing as i32).0,
            engine_service,
        }
    }

    pub(crate) fn set(&self, serving: bool) {
        let status = if serving {
            ServingStatus::Serving
        } else {
            ServingStatus::NotServing
        } as i32;
        self.status
            .send_if_modified(|s| std::mem::replace(s, status) != status);
    }

    pub(crate) fn server(&self) -> HealthServer<OwnHealth> {
        HealthServer::new(self.clone())
    }

    fn known(&self, service: &str) -> bool {
        service.is_empty() || service == self.engine_service
    }
}

type WatchStream = Pin<Box<dyn Stream<Item = Result<HealthCheckResponse, Status>> + Send>>;

#[tonic::async_trait]
impl Health for OwnHealth {
    async fn check(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<HealthCheckResponse>, Status> {
        let service = request.into_inner().service;
        if !self.known(&service) {
            return Err(Status::not_found(format!("unknown service {service:?}")));
        }
        Ok(Response::new(HealthCheckResponse {
            status: *self.status.borrow(),
        }))
    }

    type WatchStream = WatchStream;

    async fn watch(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<WatchStream>, Status> {
        let service = request.into_inner().service;
        let known = self.known(&service);
        let mut rx = self.status.subscribe();
        let (tx, out) = tokio::sync::mpsc::channel(4);
        tokio::spawn(async move {
            if !known {
                let _ = tx
                    .send(Ok(HealthCheckResponse {
                        status: ServingStatus::ServiceUnknown as i32,
                    }))
                    .await;
                tx.closed().await;
                return;
            }
            loop {
                let status = *rx.borrow_and_update();
                if tx.send(Ok(HealthCheckResponse { status })).await.is_err() {
                    return;
                }
                tokio::select! {
                    () = tx.closed() => return,
                    changed = rx.changed() => if changed.is_err() { return },
                }
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(out),
        )))
    }
}
