//! A real etcd per test: its own free loopback ports and data directory,
//! stopped (and restartable on the same data) from the test, read over gRPC.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use llm_sidecar_etcd_api::etcdserverpb::kv_client::KvClient;
use llm_sidecar_etcd_api::etcdserverpb::lease_client::LeaseClient;
use llm_sidecar_etcd_api::etcdserverpb::{
    DeleteRangeRequest, LeaseTimeToLiveRequest, RangeRequest,
};
use tonic::transport::Channel;

use crate::certs::Certs;
use crate::free_addr;
use crate::proc::{HANG, Proc, wait_until};

pub struct Etcd {
    pub client: SocketAddr,
    peer: SocketAddr,
    data: PathBuf,
    dir: PathBuf,
    proc: Option<Proc>,
    starts: u32,
    rt: tokio::runtime::Runtime,
    /// Certificates when etcd serves clients over TLS and requires client certificates.
    tls: Option<PathBuf>,
}

/// A key's value and the lease it is attached to.
pub struct Entry {
    pub value: Vec<u8>,
    pub lease: i64,
}

impl Etcd {
    /// An etcd that is not running yet, on ports reserved now.
    pub fn new(dir: &Path) -> Self {
        assert!(
            std::process::Command::new("etcd")
                .arg("--version")
                .output()
                .is_ok(),
            "etcd is not installed: run `bash scripts/test.sh` (it installs Debian's etcd-server) \
             or `apt-get install etcd-server`"
        );
        Etcd {
            client: free_addr(),
            peer: free_addr(),
            data: dir.join("etcd-data"),
            dir: dir.to_path_buf(),
            proc: None,
            starts: 0,
            tls: None,
            rt: tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime"),
        }
    }

    /// An etcd serving clients over TLS (the server certificate of `certs`)
    /// and requiring client certificates from `certs`' CA.
    pub fn started_tls(dir: &Path, certs: &Certs) -> Self {
        let mut e = Etcd::new(dir);
        e.tls = Some(certs.dir.clone());
        e.start();
        e
    }

    pub fn started(dir: &Path) -> Self {
        let mut e = Etcd::new(dir);
        e.start();
        e
    }

    fn client_url(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://{}", self.client)
    }

    pub fn endpoint(&self) -> String {
        format!("etcd://{}", self.client)
    }

    /// Starts (or restarts, on the same data directory) and waits until it answers.
    pub fn start(&mut self) {
        self.starts += 1;
        let url = |a: SocketAddr| format!("http://{a}");
        let mut args: Vec<String> = [
            "--name",
            "t",
            "--data-dir",
            &self.data.display().to_string(),
            "--listen-client-urls",
            &self.client_url(),
            "--advertise-client-urls",
            &self.client_url(),
            "--listen-peer-urls",
            &url(self.peer),
            "--initial-advertise-peer-urls",
            &url(self.peer),
            "--initial-cluster",
            &format!("t={}", url(self.peer)),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        if let Some(certs) = &self.tls {
            let f = |name: &str| certs.join(name).display().to_string();
            args.extend([
                "--cert-file".to_string(),
                f("server.pem"),
                "--key-file".into(),
                f("server.key"),
                "--trusted-ca-file".into(),
                f("ca.pem"),
                "--client-cert-auth".into(),
            ]);
        }
        let log = self.dir.join(format!("etcd-{}.log", self.starts));
        self.proc = Some(Proc::spawn_program("etcd", &args, log));
        wait_until(HANG, "etcd to answer", || self.try_keys().is_ok());
    }

    /// Sends a signal to the running etcd (STOP/CONT: an outage without a restart).
    pub fn signal(&self, sig: &str) {
        self.proc.as_ref().expect("etcd running").signal(sig);
    }

    /// Stops etcd (SIGTERM, then waits for it).
    pub fn stop(&mut self) {
        if let Some(mut p) = self.proc.take() {
            if p.running() {
                p.signal("TERM");
            }
            wait_until(HANG, "etcd to stop", || !p.running());
        }
    }

    fn channel(&self) -> Result<Channel, String> {
        let mut endpoint = tonic::transport::Endpoint::from_shared(self.client_url())
            .map_err(|e| e.to_string())?
            .connect_timeout(Duration::from_secs(2))
            .timeout(Duration::from_secs(5));
        if let Some(certs) = &self.tls {
            let read = |name: &str| std::fs::read(certs.join(name)).expect("cert file");
            use tonic::transport::{Certificate, ClientTlsConfig, Identity};
            let tls = ClientTlsConfig::new()
                .ca_certificate(Certificate::from_pem(read("ca.pem")))
                .identity(Identity::from_pem(read("client.pem"), read("client.key")))
                .domain_name("127.0.0.1");
            endpoint = endpoint.tls_config(tls).map_err(|e| e.to_string())?;
        }
        self.rt
            .block_on(endpoint.connect())
            .map_err(|e| e.to_string())
    }

    fn try_keys(&self) -> Result<Vec<String>, String> {
        let mut kv = KvClient::new(self.channel()?);
        let range = RangeRequest {
            key: b"v1/".to_vec(),
            range_end: b"v10".to_vec(),
            limit: 0,
        };
        let r = self
            .rt
            .block_on(kv.range(range))
            .map_err(|e| e.to_string())?
            .into_inner();
        Ok(r.kvs
            .iter()
            .map(|kv| String::from_utf8_lossy(&kv.key).into_owned())
            .collect())
    }

    /// Every key under `v1/`.
    pub fn keys(&self) -> Vec<String> {
        self.try_keys().expect("etcd answers")
    }

    /// A key's value and lease, if the key exists.
    pub fn get(&self, key: &str) -> Option<Entry> {
        let mut kv = KvClient::new(self.channel().expect("etcd answers"));
        let range = RangeRequest {
            key: key.as_bytes().to_vec(),
            range_end: vec![],
            limit: 0,
        };
        let r = self
            .rt
            .block_on(kv.range(range))
            .expect("range")
            .into_inner();
        r.kvs.into_iter().next().map(|kv| Entry {
            value: kv.value,
            lease: kv.lease,
        })
    }

    /// Deletes a key, as an operator (or another process) might.
    pub fn delete(&self, key: &str) {
        let mut kv = KvClient::new(self.channel().expect("etcd answers"));
        let delete = DeleteRangeRequest {
            key: key.as_bytes().to_vec(),
            range_end: vec![],
        };
        self.rt.block_on(kv.delete_range(delete)).expect("delete");
    }

    /// (remaining TTL, granted TTL) of a lease; remaining is -1 once it is gone.
    pub fn lease_ttl(&self, lease: i64) -> (i64, i64) {
        let mut leases = LeaseClient::new(self.channel().expect("etcd answers"));
        let r = self
            .rt
            .block_on(leases.lease_time_to_live(LeaseTimeToLiveRequest {
                id: lease,
                keys: false,
            }))
            .expect("lease time to live")
            .into_inner();
        (r.ttl, r.granted_ttl)
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.stop();
    }
}
