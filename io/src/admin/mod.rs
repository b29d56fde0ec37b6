//! The admin port: a minimal HTTP/1.1 server ([`http`], also the mock
//! engine's control port), its routes ([`routes`]: `/live`, `/ready`,
//! `/state`, `/metrics`), what they show ([`status`], written by the driver)
//! and the Prometheus rendering ([`metrics`]).

pub mod http;
mod metrics;
pub(crate) mod routes;
pub(crate) mod status;
