//! TLS: the request plane's server side (rustls, optional client-certificate
//! verification) and the etcd client side. Every file is read and parsed when
//! the flags are checked, so a bad certificate exits 2 before anything is
//! contacted, like any other bad flag.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};

use crate::parse::ConfigError;

/// Files for TLS on the request plane.
#[derive(Debug, Clone)]
pub struct ServerTlsFiles {
    /// Certificate chain (PEM), leaf first.
    pub cert: PathBuf,
    /// Private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// CA bundle (PEM) that client certificates must chain to; `None`: no client certificates.
    pub client_ca: Option<PathBuf>,
}

/// The request plane's TLS, checked: an acceptor ready for connections.
#[derive(Clone)]
pub struct ServerTls {
    /// The rustls acceptor (ALPN `h2` only: the request plane speaks HTTP/2).
    pub acceptor: tokio_rustls::TlsAcceptor,
    /// Client certificates are required and verified.
    pub mutual: bool,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print key material: only what kind of TLS this is.
        f.debug_struct("ServerTls")
            .field("mutual", &self.mutual)
            .finish_non_exhaustive()
    }
}

fn tls_error(flag: &'static str, path: &Path, message: impl std::fmt::Display) -> ConfigError {
    ConfigError::Tls {
        flag,
        path: path.display().to_string(),
        message: message.to_string(),
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// PEM files are certificates and keys: kilobytes. A larger one is not one.
const MAX_PEM_BYTES: u64 = 1 << 20;

/// Reads a PEM file whole: a regular file (not a FIFO that would block, nor a
/// device that never ends) of at most 1 MiB.
pub fn read_pem(flag: &'static str, path: &Path) -> Result<Vec<u8>, ConfigError> {
    use std::io::Read;
    let meta =
        std::fs::metadata(path).map_err(|e| tls_error(flag, path, format!("cannot read: {e}")))?;
    if !meta.is_file() {
        return Err(tls_error(flag, path, "not a regular file"));
    }
    if meta.len() > MAX_PEM_BYTES {
        return Err(tls_error(flag, path, "larger than 1 MiB; not a PEM file"));
    }
    let mut bytes = Vec::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(MAX_PEM_BYTES).read_to_end(&mut bytes))
        .map_err(|e| tls_error(flag, path, format!("cannot read: {e}")))?;
    Ok(bytes)
}

/// Every certificate in a PEM file; at least one.
fn certificates(
    flag: &'static str,
    path: &Path,
) -> Result<Vec<CertificateDer<'static>>, ConfigError> {
    let pem = read_pem(flag, path)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| tls_error(flag, path, format!("not a PEM certificate file: {e}")))?;
    if certs.is_empty() {
        return Err(tls_error(flag, path, "no CERTIFICATE block in the file"));
    }
    Ok(certs)
}

fn private_key(flag: &'static str, path: &Path) -> Result<PrivateKeyDer<'static>, ConfigError> {
    let pem = read_pem(flag, path)?;
    PrivateKeyDer::from_pem_slice(&pem)
        .map_err(|e| tls_error(flag, path, format!("no usable private key: {e}")))
}

fn roots(flag: &'static str, path: &Path) -> Result<rustls::RootCertStore, ConfigError> {
    let mut store = rustls::RootCertStore::empty();
    for cert in certificates(flag, path)? {
        store
            .add(cert)
            .map_err(|e| tls_error(flag, path, format!("not a usable CA certificate: {e}")))?;
    }
    Ok(store)
}

impl ServerTlsFiles {
    /// Reads and checks the files; builds the acceptor.
    pub fn load(&self) -> Result<ServerTls, ConfigError> {
        let chain = certificates("--tls-cert", &self.cert)?;
        let key = private_key("--tls-key", &self.key)?;
        let builder = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| tls_error("--tls-cert", &self.cert, e))?;
        let builder = match &self.client_ca {
            Some(ca) => {
                let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                    Arc::new(roots("--tls-client-ca", ca)?),
                    provider(),
                )
                .build()
                .map_err(|e| tls_error("--tls-client-ca", ca, e))?;
                builder.with_client_cert_verifier(verifier)
            }
            None => builder.with_no_client_auth(),
        };
        let mut config = builder.with_single_cert(chain, key).map_err(|e| {
            tls_error(
                "--tls-key",
                &self.key,
                format!("does not match the certificate: {e}"),
            )
        })?;
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(ServerTls {
            acceptor: tokio_rustls::TlsAcceptor::from(Arc::new(config)),
            mutual: self.client_ca.is_some(),
        })
    }
}

/// TLS towards etcd: the CA that signed etcd's certificate and, for etcd's
/// `--client-cert-auth`, our client certificate and key. PEM bytes, checked.
#[derive(Clone)]
pub struct EtcdTls {
    pub(crate) ca: Vec<u8>,
    pub(crate) identity: Option<(Vec<u8>, Vec<u8>)>,
}

impl std::fmt::Debug for EtcdTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdTls")
            .field("client_certificate", &self.identity.is_some())
            .finish_non_exhaustive()
    }
}

impl EtcdTls {
    /// Reads and checks `ca` and the optional client `cert`/`key` pair.
    pub fn load(
        ca: &Path,
        cert: Option<&Path>,
        key: Option<&Path>,
    ) -> Result<EtcdTls, ConfigError> {
        roots("--etcd-ca", ca)?;
        let identity = match (cert, key) {
            (Some(cert), Some(key)) => {
                certificates("--etcd-cert", cert)?;
                private_key("--etcd-key", key)?;
                Some((read_pem("--etcd-cert", cert)?, read_pem("--etcd-key", key)?))
            }
            (None, None) => None,
            (Some(cert), None) => {
                return Err(tls_error("--etcd-cert", cert, "needs --etcd-key too"));
            }
            (None, Some(key)) => return Err(tls_error("--etcd-key", key, "needs --etcd-cert too")),
        };
        Ok(EtcdTls {
            ca: read_pem("--etcd-ca", ca)?,
            identity,
        })
    }

    /// The tonic client configuration for one etcd endpoint.
    pub(crate) fn client_config(&self, host: &str) -> tonic::transport::ClientTlsConfig {
        let mut config = tonic::transport::ClientTlsConfig::new()
            .ca_certificate(tonic::transport::Certificate::from_pem(&self.ca))
            .domain_name(host.to_string());
        if let Some((cert, key)) = &self.identity {
            config = config.identity(tonic::transport::Identity::from_pem(cert, key));
        }
        config
    }
}
