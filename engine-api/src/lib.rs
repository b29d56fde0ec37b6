//! Generated gRPC types for the engine APIs llm-sidecar talks to.
//!
//! Only the messages the sidecar reads at start-up and in its probe (and that
//! the mock engine serves) are defined; the request plane never decodes
//! messages, it forwards bytes.

/// TensorRT-LLM's `trtllm.TrtllmService` (subset).
pub mod trtllm {
    #![allow(missing_docs, clippy::all, clippy::pedantic)]
    tonic::include_proto!("trtllm");
}
