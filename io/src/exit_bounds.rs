//! How long each step of the exit may take, once the core has decided to exit.
//!
//! The core's drain deadline bounds the calls; these bound what follows it, so
//! that a caller who never lets go cannot hold the process up. They nest: a
//! connection's linger fits inside its GOAWAY flush, and every connection's
//! flush fits inside the wait for all of them.

use std::time::Duration;

/// A closing connection keeps reading (and discarding) what its caller still
/// sends for at most this long, so the caller reads its last answers before the
/// close instead of a TCP reset. Go's HTTP/2 server gives a caller the same
/// second after its final GOAWAY.
pub(crate) const CLOSE_LINGER: Duration = Duration::from_secs(1);

/// After GOAWAY, a connection's last frames (the trailers of calls cut at the
/// drain deadline) get this long to reach the caller, the linger included:
/// enough for a few frames on any live connection, short beside a pod's grace.
pub(crate) const GOAWAY_FLUSH: Duration = Duration::from_secs(2);

/// All request-plane connections together get this long to close before the
/// process exits anyway: one flush plus a second for the runtime to schedule
/// every connection task when there are thousands.
pub(crate) const CONNECTIONS_CLOSE: Duration = Duration::from_secs(3);

const _: () = assert!(CLOSE_LINGER.as_millis() < GOAWAY_FLUSH.as_millis());
const _: () = assert!(GOAWAY_FLUSH.as_millis() < CONNECTIONS_CLOSE.as_millis());
