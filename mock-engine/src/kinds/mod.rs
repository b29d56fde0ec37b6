//! The six engine APIs, one file each: each translates its requests and
//! messages; the tokens, the call account and the test hooks are
//! `generate.rs`'s.

pub(crate) mod openengine;
pub(crate) mod sglang;
pub(crate) mod sglang_native;
pub(crate) mod trtllm;
pub(crate) mod vllm;
pub(crate) mod vllm_native;
