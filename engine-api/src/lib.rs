//! Generated gRPC types for the engine APIs llm-sidecar talks to.
//!
//! Only the messages the sidecar reads at start-up and in its monitors (and
//! that the mock engine serves) are defined; the request plane never decodes
//! messages, it forwards bytes.

#![warn(missing_docs, unreachable_pub)]

/// The well-known types the APIs use (OpenEngine's `extra` is a
/// `google.protobuf.Struct`), so users need no dependency of their own.
pub use prost_types;

/// TensorRT-LLM's `trtllm.TrtllmService` (subset), the API the SMG gateway speaks.
pub mod trtllm {
    #![allow(missing_docs, clippy::all, clippy::pedantic)]
    tonic::include_proto!("trtllm");
}

/// TensorRT-LLM's OpenEngine server, `openengine.v1.Inference` and
/// `openengine.v1.Control` (subset, TensorRT-LLM's pinned schema revision).
pub mod openengine {
    #![allow(missing_docs, clippy::all, clippy::pedantic)]
    tonic::include_proto!("openengine.v1");
}

/// vLLM's `vllm.grpc.engine.VllmEngine` (subset).
pub mod vllm {
    #![allow(missing_docs, clippy::all, clippy::pedantic)]
    tonic::include_proto!("vllm.grpc.engine");
}

/// SGLang's `sglang.grpc.scheduler.SglangScheduler` (subset).
pub mod sglang {
    #![allow(missing_docs, clippy::all, clippy::pedantic)]
    tonic::include_proto!("sglang.grpc.scheduler");
}

/// vLLM's native gRPC server, `vllm.Inference` and `vllm.Control` (subset).
pub mod vllm_native {
    #![allow(missing_docs, clippy::all, clippy::pedantic)]
    tonic::include_proto!("vllm");
}

/// SGLang's native gRPC server, `sglang.runtime.v1.SglangService` (subset).
pub mod sglang_runtime {
    #![allow(missing_docs, clippy::all, clippy::pedantic)]
    tonic::include_proto!("sglang.runtime.v1");
}
