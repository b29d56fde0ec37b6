//! The discovery worker: runs the core's `Register` and `Withdraw` actions one
//! at a time, in order, each bounded, and answers each with exactly one event
//! (the core's book of discovery writes relies on it).

use std::sync::Arc;
use std::time::Duration;

use llm_sidecar_core::{DiscoveryEvent, Event, HumanDuration};
use tokio::sync::mpsc;

use super::{Discovery, DiscoveryError, Record};
use crate::report::error_chain;

/// One discovery write the core asked for.
pub(crate) enum DiscoveryOp {
    Register(Box<Record>),
    Withdraw,
}

/// Runs writes from `ops` until the channel closes. `lost` is handed to the
/// backend for "the store dropped the record"; `written` hears where each
/// successful registration lives, for `/state`.
pub(crate) async fn run<D: Discovery>(
    discovery: Arc<D>,
    mut ops: mpsc::UnboundedReceiver<DiscoveryOp>,
    events: mpsc::Sender<Event>,
    lost: mpsc::UnboundedSender<String>,
    bound: Duration,
    written: impl Fn(String) + Send,
) {
    let timeout_error = || DiscoveryError::Timeout(HumanDuration(bound).to_string()).to_string();
    while let Some(op) = ops.recv().await {
        let event = match op {
            DiscoveryOp::Register(record) => {
                match tokio::time::timeout(bound, discovery.register(&record, lost.clone())).await {
                    Ok(Ok(())) => {
                        let location = discovery.location(&record);
                        tracing::info!(record = %location, key = %record.key(), "record written to discovery");
                        written(location);
                        Event::Discovery(DiscoveryEvent::Registered)
                    }
                    Ok(Err(e)) => Event::Discovery(DiscoveryEvent::RegistrationFailed {
                        error: error_chain(&e),
                    }),
                    Err(_) => Event::Discovery(DiscoveryEvent::RegistrationFailed {
                        error: timeout_error(),
                    }),
                }
            }
            DiscoveryOp::Withdraw => {
                match tokio::time::timeout(bound, discovery.withdraw()).await {
                    Ok(Ok(())) => Event::Discovery(DiscoveryEvent::Withdrawn),
                    Ok(Err(e)) => Event::Discovery(DiscoveryEvent::WithdrawFailed {
                        error: error_chain(&e),
                    }),
                    Err(_) => Event::Discovery(DiscoveryEvent::WithdrawFailed {
                        error: timeout_error(),
                    }),
                }
            }
        };
        if events.send(event).await.is_err() {
            return;
        }
    }
}
