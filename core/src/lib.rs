//! The lifecycle of an llm-sidecar worker as a pure, sans-IO state machine.
//!
//! [`Lifecycle`] takes events (each with the time it happened) and emits
//! [`Action`]s. It never touches a socket, a clock, a thread or an async
//! runtime, so the same code runs under tokio in production and faster than
//! real time under the property tests, the exhaustive explorer and the fuzzer.
//!
//! # Calling it
//!
//! - `handle_*` feeds one input: [`Lifecycle::handle_event`], [`Lifecycle::handle_timeout`].
//! - `poll_*` drains outputs: [`Lifecycle::poll_action`] until `None`, then
//!   [`Lifecycle::poll_timeout`] for the one deadline to sleep until.
//! - plain getters ([`Lifecycle::phase`], [`Lifecycle::admission`], …) read.
//!
//! The one rule: after every `handle_*`, drain the actions before feeding the
//! next input. Actions are ordered; perform them in order.
//!
//! Deadlines that are due are handled before the input itself, so a late
//! timer cannot let an input slip past a deadline, and a timer that fires
//! early does nothing.
//!
//! See `docs/ARCHITECTURE.md` for the states, the invariants and the diagram,
//! and `docs/CONTRACT.md` for what the lifecycle promises.

#![warn(missing_docs, unreachable_pub)]
// A wildcard arm could swallow an event or a state added later without a word;
// every match on the core's own enums names every variant. (A state that
// ignores all of one source's news names the source, `Event::Engine(_)`: a
// new source is then still a compile error everywhere.)
#![deny(clippy::wildcard_enum_match_arm)]
// The core reads no clock: `core/clippy.toml` lists the clock reads it may not make.
#![deny(clippy::disallowed_methods)]

mod action;
mod codes;
mod config;
mod event;
pub mod gate;
mod lifecycle;
pub mod liveness;
mod loss;
mod machine;
mod sync;
mod time;

pub use action::{Action, Admission, ExitReason, Health, Level};
pub use config::{Config, OnEngineLoss};
pub use event::{ConnectionEnd, DiscoveryEvent, EngineEvent, Event, LivenessObservation};
pub use lifecycle::{Lifecycle, Phase};
pub use loss::LossReason;
pub use machine::NOT_REGISTERED;
pub use time::{HumanDuration, Time};
