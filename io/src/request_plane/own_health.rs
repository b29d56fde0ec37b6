//! The sidecar's own `grpc.health.v1` on the request port: SERVING exactly while
//! the lifecycle is Serving (invariant 8), for `""` and for the engine service's
//! name, so health-checking routers see the worker leave before calls fail.

use std::pin::Pin;
use std::sync::{Arc, OnceLock};

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
    /// The engine API's service name, once the engine's kind is known.
    engine_service: Arc<OnceLock<&'static str>>,
}

impl OwnHealth {
    pub(crate) fn new() -> Self {
        OwnHealth {
            status: watch::channel(ServingStatus::NotServing as i32).0,
            engine_service: Arc::default(),
        }
    }

    /// Answers for the engine API's service name too, from now on.
    pub(crate) fn name_engine_service(&self, service: &'static str) {
        let _ = self.engine_service.set(service);
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
        service.is_empty() || self.engine_service.get() == Some(&service)
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
