//! What the test suites of llm-sidecar share: the process suite
//! (`bin/tests/process`) and the in-process suite (`io/tests/in_process`)
//! alike. A dev-dependency only: nothing in a product binary depends on it.

pub mod raw_h2;
