//! The admin server's routes: `/live`, `/ready` (also `/health`, the path
//! Dynamo's operator and many Kubernetes charts probe), `/state`, `/metrics`.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::http::{Handler, Request, Response};
use super::metrics;
use super::status::Shared;
use crate::request_plane::Plane;

/// The admin handler: reads the driver's published status and the request
/// plane's counters; changes nothing.
pub(crate) fn handler(status: Shared, plane: Arc<Plane>) -> Handler {
    Arc::new(move |req: &Request| {
        if req.method != "GET" && req.method != "HEAD" {
            return Response::text(405, "only GET\n");
        }
        match req.path.as_str() {
            // The process: 200 until it exits, whatever the engine does.
            "/live" => status.read(|s| {
                if s.live {
                    Response::text(200, "live\n")
                } else {
                    Response::text(503, "exiting\n")
                }
            }),
            // The worker: 200 only while Serving.
            "/ready" | "/health" => status.read(|s| {
                if s.state == "Serving" {
                    Response::text(200, "ready\n")
                } else {
                    Response::text(503, format!("not ready: {}\n", s.state))
                }
            }),
            "/state" => Response::json(200, status.read(|s| s.state_json())),
            "/metrics" => {
                let format = metrics::Format::from_accept(&req.accept);
                let snapshot = status.read(|s| {
                    let connections = (
                        plane.connections_open.load(Ordering::Relaxed),
                        plane.connections_refused.load(Ordering::Relaxed),
                    );
                    metrics::Snapshot::take(s, &plane.counters, plane.gate.in_flight(), connections)
                });
                Response {
                    status: 200,
                    content_type: format.content_type(),
                    body: snapshot.render(format),
                }
            }
            _ => Response::text(
                404,
                "not found; try /live, /ready, /health, /state or /metrics\n",
            ),
        }
    })
}
