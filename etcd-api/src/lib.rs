//! Generated gRPC clients for the part of etcd v3 that llm-sidecar's discovery
//! uses: `etcdserverpb.KV` (Range, Put, DeleteRange) and `etcdserverpb.Lease`.

#![warn(missing_docs, unreachable_pub)]

/// `etcdserverpb` (subset).
pub mod etcdserverpb {
    #![allow(missing_docs, clippy::all, clippy::pedantic)]
    tonic::include_proto!("etcdserverpb");
}
