//! What the test suites of llm-sidecar share: the process suite
//! (`bin/tests/process`), the in-process suite (`io/tests/in_process`) and
//! the Dynamo worker's suite behind Dynamo's frontend (`dynamo/tests/frontend`).
//! A dev-dependency only: nothing in a product binary depends on it.

pub mod certs;
pub mod etcd;
pub mod proc;
pub mod raw_h2;
pub mod trtllm;

/// A loopback address with a port nobody listens on right now.
pub fn free_addr() -> std::net::SocketAddr {
    llm_sidecar_loadgen::local::free_loopback_addr().expect("a free loopback port")
}
