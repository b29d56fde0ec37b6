//! The engine APIs besides `trtllm.TrtllmService` (which is `service.rs`):
//! each translates its requests and messages; the tokens, the call account
//! and the test hooks are `generate.rs`'s.

pub(crate) mod openengine;
pub(crate) mod sglang;
pub(crate) mod vllm;
