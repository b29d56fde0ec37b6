//! etcd discovery: the record under its key with a lease, kept alive at TTL/3.
//!
//! - `register` grants a fresh lease (never reusing an old one), puts the key
//!   with it, and starts the keepalive; a re-registration revokes the lease it
//!   replaces once the new one holds the key.
//! - The keepalive reports the registration lost when etcd answers TTL 0 (the
//!   lease expired) or when no keepalive has succeeded for a whole TTL (after
//!   such an outage the lease cannot be trusted); the core then registers again.
//!   An outage is logged once, not per attempt.
//! - After every successful keepalive the key itself is looked up: a key
//!   deleted by someone else while the lease lives is reported lost too, so the
//!   core writes it again.
//! - `withdraw` stops the keepalive, deletes the key and revokes the lease.
//! - A killed sidecar's record expires with its lease.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use llm_sidecar_etcd_api::etcdserverpb::kv_client::KvClient;
use llm_sidecar_etcd_api::etcdserverpb::lease_client::LeaseClient;
use llm_sidecar_etcd_api::etcdserverpb::{
    DeleteRangeRequest, LeaseGrantRequest, LeaseKeepAliveRequest, LeaseRevokeRequest, PutRequest,
    RangeRequest,
};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tonic::transport::{Channel, Endpoint};

use super::{
    CallStatus, Cause, Discovery, DiscoveryError, ListRecords, Listed, ListedRecord, Record,
};

/// The key prefix every record lives under.
const PREFIX: &str = "v1/instances/";

/// etcd-backed discovery.
pub struct EtcdDiscovery {
    endpoints: Vec<String>,
    ttl: Duration,
    channel: Channel,
    active: Mutex<Option<Active>>,
}

/// The registration in force.
struct Active {
    key: String,
    lease: i64,
    keepalive: CancellationToken,
}

fn etcd_err(key: &str, status: tonic::Status) -> DiscoveryError {
    DiscoveryError::Etcd {
        key: key.to_string(),
        source: CallStatus(status),
    }
}

/// The range end that selects every key starting with `prefix`.
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

impl EtcdDiscovery {
    /// Discovery on the etcd cluster at `endpoints` (`host:port`), with leases of
    /// `ttl`. `bound` limits each request. Connects lazily, balancing over the
    /// endpoints and reconnecting by itself.
    pub fn new(
        endpoints: Vec<String>,
        ttl: Duration,
        bound: Duration,
        tls: Option<&crate::tls::EtcdTls>,
    ) -> Result<Self, DiscoveryError> {
        let mut list = Vec::with_capacity(endpoints.len());
        let scheme = if tls.is_some() { "https" } else { "http" };
        for e in &endpoints {
            let unusable = |err: Cause| DiscoveryError::Endpoint {
                endpoint: e.clone(),
                source: err,
            };
            let mut endpoint = Endpoint::from_shared(format!("{scheme}://{e}"))
                .map_err(|err| unusable(err.into()))?
                .connect_timeout(bound)
                .timeout(bound)
                .tcp_nodelay(true);
            if let Some(tls) = tls {
                // The certificate must name the host as written in --discovery.
                let host = e.rsplit_once(':').map_or(e.as_str(), |(h, _)| h);
                let host = host.trim_start_matches('[').trim_end_matches(']');
                endpoint = endpoint
                    .tls_config(tls.client_config(host))
                    .map_err(|err| unusable(err.into()))?;
            }
            list.push(endpoint);
        }
        Ok(EtcdDiscovery {
            endpoints,
            ttl,
            channel: Channel::balance_list(list.into_iter()),
            active: Mutex::new(None),
        })
    }

    fn active(&self) -> std::sync::MutexGuard<'_, Option<Active>> {
        self.active.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn kv(&self) -> KvClient<Channel> {
        KvClient::new(self.channel.clone())
    }

    fn lease(&self) -> LeaseClient<Channel> {
        LeaseClient::new(self.channel.clone())
    }
}

/// One keepalive round: the lease's remaining TTL (0: expired or unknown).
async fn keep_alive_once(
    lease_client: &mut LeaseClient<Channel>,
    lease: i64,
) -> Result<i64, tonic::Status> {
    let request = tokio_stream::iter([LeaseKeepAliveRequest { id: lease }]);
    let mut responses = lease_client.lease_keep_alive(request).await?.into_inner();
    Ok(responses.message().await?.map_or(0, |r| r.ttl))
}

/// Whether `key` is in etcd now; `None` if etcd did not answer.
async fn key_present(kv: &mut KvClient<Channel>, key: &str) -> Option<bool> {
    let range = RangeRequest {
        key: key.as_bytes().to_vec(),
        range_end: Vec::new(),
        limit: 1,
    };
    let found = kv.range(range).await.ok()?.into_inner();
    Some(!found.kvs.is_empty())
}

/// Keeps `lease` alive every TTL/3 until cancelled or lost, and checks that
/// `key` is still there after every successful keepalive.
async fn keep_alive(
    mut client: LeaseClient<Channel>,
    mut kv: KvClient<Channel>,
    key: String,
    lease: i64,
    ttl: Duration,
    lost: mpsc::UnboundedSender<String>,
    cancel: CancellationToken,
) {
    let every = (ttl / 3).max(Duration::from_millis(200));
    let mut last_ok = Instant::now();
    let mut outage = false;
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(every) => {}
        }
        let attempt = keep_alive_once(&mut client, lease);
        let outcome = tokio::select! {
            () = cancel.cancelled() => return,
            outcome = tokio::time::timeout(every, attempt) => outcome,
        };
        match outcome {
            Ok(Ok(remaining)) if remaining > 0 => {
                last_ok = Instant::now();
                if outage {
                    outage = false;
                    tracing::info!(
                        lease = format!("{lease:x}"),
                        "etcd reachable again; the lease held"
                    );
                }
                let present = tokio::select! {
                    () = cancel.cancelled() => return,
                    present = tokio::time::timeout(every, key_present(&mut kv, &key)) => present,
                };
                if present == Ok(Some(false)) {
                    tracing::warn!(%key, "the record's key was deleted by someone else");
                    let _ = lost.send("its key was deleted".to_string());
                    return;
                }
                continue;
            }
            Ok(Ok(_)) => {
                tracing::warn!(
                    lease = format!("{lease:x}"),
                    "etcd says the lease expired; the record is gone"
                );
                let _ = lost.send("its lease expired".to_string());
                return;
            }
            Ok(Err(e)) => {
                if !outage {
                    outage = true;
                    tracing::warn!(
                        "etcd unreachable ({:?}: {}); still serving, retrying the lease keepalive every {}; \
                         the record expires if this lasts {}",
                        e.code(),
                        e.message(),
                        llm_sidecar_core::HumanDuration(every),
                        llm_sidecar_core::HumanDuration(ttl)
                    );
                }
            }
            Err(_) => {
                if !outage {
                    outage = true;
                    tracing::warn!(
                        "etcd did not answer the lease keepalive within {}; still serving, retrying",
                        llm_sidecar_core::HumanDuration(every)
                    );
                }
            }
        }
        if last_ok.elapsed() >= ttl {
            tracing::warn!(
                lease = format!("{lease:x}"),
                "no lease keepalive succeeded for {}; the lease cannot be trusted",
                llm_sidecar_core::HumanDuration(ttl)
            );
            let _ = lost.send("no lease keepalive succeeded for a whole TTL".to_string());
            return;
        }
    }
}

impl Discovery for EtcdDiscovery {
    async fn register(
        &self,
        record: &Record,
        lost: mpsc::UnboundedSender<String>,
    ) -> Result<(), DiscoveryError> {
        let (mut kv, mut leases) = (self.kv(), self.lease());
        let key = record.key();
        let value = serde_json::to_vec(record).unwrap_or_default();
        let ttl_secs = i64::try_from(self.ttl.as_secs().max(1)).unwrap_or(i64::MAX);
        let granted = leases
            .lease_grant(LeaseGrantRequest {
                ttl: ttl_secs,
                id: 0,
            })
            .await
            .map_err(|e| etcd_err(&key, e))?
            .into_inner();
        if !granted.error.is_empty() {
            return Err(etcd_err(&key, tonic::Status::unavailable(granted.error)));
        }
        let lease = granted.id;
        let put = PutRequest {
            key: key.clone().into_bytes(),
            value,
            lease,
        };
        if let Err(e) = kv.put(put).await {
            let _ = leases.lease_revoke(LeaseRevokeRequest { id: lease }).await;
            return Err(etcd_err(&key, e));
        }
        let keepalive = CancellationToken::new();
        tokio::spawn(keep_alive(
            leases.clone(),
            kv.clone(),
            key.clone(),
            lease,
            self.ttl,
            lost,
            keepalive.clone(),
        ));
        let previous = self.active().replace(Active {
            key,
            lease,
            keepalive,
        });
        if let Some(old) = previous {
            old.keepalive.cancel();
            // The key now belongs to the new lease; the old one would only linger.
            let _ = leases
                .lease_revoke(LeaseRevokeRequest { id: old.lease })
                .await;
        }
        Ok(())
    }

    async fn withdraw(&self) -> Result<(), DiscoveryError> {
        let Some((key, lease)) = self.active().as_ref().map(|a| {
            a.keepalive.cancel();
            (a.key.clone(), a.lease)
        }) else {
            return Ok(());
        };
        let delete = DeleteRangeRequest {
            key: key.clone().into_bytes(),
            range_end: Vec::new(),
        };
        self.kv()
            .delete_range(delete)
            .await
            .map_err(|e| etcd_err(&key, e))?;
        match self
            .lease()
            .lease_revoke(LeaseRevokeRequest { id: lease })
            .await
        {
            Ok(_) => {}
            // Already expired: nothing left to revoke.
            Err(e) if e.message().contains("not found") => {}
            Err(e) => return Err(etcd_err(&key, e)),
        }
        self.active().take();
        Ok(())
    }

    fn location(&self, record: &Record) -> String {
        format!("etcd://{}/{}", self.endpoints.join(","), record.key())
    }
}

impl ListRecords for EtcdDiscovery {
    async fn list(&self) -> Result<Vec<ListedRecord>, DiscoveryError> {
        let range = RangeRequest {
            key: PREFIX.as_bytes().to_vec(),
            range_end: prefix_end(PREFIX.as_bytes()),
            limit: 0,
        };
        let response = self
            .kv()
            .range(range)
            .await
            .map_err(|e| etcd_err(PREFIX, e))?
            .into_inner();
        let mut out: Vec<ListedRecord> = response
            .kvs
            .iter()
            .map(|kv| ListedRecord {
                key: String::from_utf8_lossy(&kv.key).into_owned(),
                content: Listed::parse(&kv.value),
            })
            .collect();
        out.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_ends_select_the_prefix() {
        assert_eq!(prefix_end(b"v1/instances/"), b"v1/instances0".to_vec());
        assert_eq!(prefix_end(&[b'a', 0xff]), vec![b'b']);
        assert_eq!(prefix_end(&[0xff]), vec![0]);
    }
}
