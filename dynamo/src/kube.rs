//! Dynamo's `kubernetes` discovery backend, as far as this worker must know it
//! beyond what Dynamo's runtime does itself.
//!
//! Dynamo's runtime writes this worker's records into one
//! `DynamoWorkerMetadata` object named after the pod (or the pod and the
//! container) and watches everyone's objects. Two things it does not give
//! this worker, which the lifecycle needs:
//!
//! - **Identity checked before anything is contacted.** Dynamo 1.6.1 reads
//!   `POD_NAME`, `POD_UID` and `POD_NAMESPACE` (files under `/etc/podinfo/`
//!   first) only when its runtime starts, and `CONTAINER_NAME` in container
//!   mode; [`PodIdentity::from_env`] reads them the same way up front, so a
//!   missing one exits 2 with its name.
//! - **A read of this worker's own records.** In this backend a list shows
//!   only instances of Ready pods: confirming a registration by listing
//!   waits on the pod's readiness, and confirming a withdrawal by listing
//!   passes as soon as the pod turns not ready, while its object still holds
//!   the records. [`OwnObject::records`] reads the object by name instead.
//!
//! The API server is reached as Dynamo reaches it (kube's `Client::try_default`:
//! `KUBECONFIG`, else the in-cluster service account).

use std::path::Path;

use dynamo_runtime::discovery::DiscoveryMetadata;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams};

/// Where Kubernetes' downward API volume puts the pod's fields, read before
/// the environment (as Dynamo 1.6.1 reads them).
const PODINFO: &str = "/etc/podinfo";

/// A container of this name registers as its pod (Dynamo's rule), so a
/// container-mode frontend finds pod-mode workers.
const MAIN_CONTAINER: &str = "main";

/// Where a missing pod field comes from.
const FROM_DOWNWARD_API: &str = "Dynamo's kubernetes discovery needs it (nor is it under \
     /etc/podinfo/); set it from the downward API (fieldRef metadata.name, metadata.uid, \
     metadata.namespace), as Dynamo's operator does";

/// The longest object name Kubernetes takes (a DNS subdomain).
const MAX_NAME: usize = 253;

/// What went wrong with the pod identity: each names the variable.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    /// A variable the backend needs is not set (nor its podinfo file).
    #[error("{0} is not set: {1}")]
    Missing(&'static str, &'static str),
    /// A variable holds something Kubernetes would refuse.
    #[error("{name}={value:?}: {why}")]
    Malformed {
        /// The variable.
        name: &'static str,
        /// Its value.
        value: String,
        /// What is wrong with it.
        why: &'static str,
    },
}

/// Pod or container discovery (`DYN_KUBE_DISCOVERY_MODE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// One identity per pod (the default).
    Pod,
    /// One identity per container (engine failover pods).
    Container,
}

/// Who this worker is to Kubernetes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodIdentity {
    /// The pod's namespace: where the object lives and what is watched.
    pub namespace: String,
    /// The pod's name.
    pub pod: String,
    /// The pod's uid: the object's owner, and what the frontend matches
    /// against the endpoint's pod.
    pub uid: String,
    /// Pod or container mode.
    pub mode: Mode,
    /// The `DynamoWorkerMetadata` object's name.
    pub object: String,
}

impl PodIdentity {
    /// Reads the identity as Dynamo 1.6.1 does, from `/etc/podinfo/` and the
    /// environment; anything missing or malformed is an error naming it.
    pub fn from_env() -> Result<Self, IdentityError> {
        Self::read(Path::new(PODINFO), &|name| std::env::var(name).ok())
    }

    fn read(podinfo: &Path, env: &dyn Fn(&str) -> Option<String>) -> Result<Self, IdentityError> {
        let field = |var: &'static str, file: &'static str| {
            std::fs::read_to_string(podinfo.join(file))
                .ok()
                .map(|v| v.trim().to_string())
                .filter(|v| !v.is_empty())
                .or_else(|| env(var))
        };
        let pod = field("POD_NAME", "pod_name")
            .ok_or(IdentityError::Missing("POD_NAME", FROM_DOWNWARD_API))?;
        check_name("POD_NAME", &pod)?;
        let uid = field("POD_UID", "pod_uid")
            .ok_or(IdentityError::Missing("POD_UID", FROM_DOWNWARD_API))?;
        if uid.is_empty()
            || uid.len() > 128
            || uid.chars().any(|c| c.is_whitespace() || c.is_control())
        {
            return Err(IdentityError::Malformed {
                name: "POD_UID",
                value: uid,
                why: "not a pod uid",
            });
        }
        // Dynamo's default, when the variable and the file are both absent.
        let namespace = field("POD_NAMESPACE", "pod_namespace").unwrap_or_else(|| "default".into());
        check_label("POD_NAMESPACE", &namespace)?;
        let mode = match env("DYN_KUBE_DISCOVERY_MODE").as_deref() {
            None | Some("pod") => Mode::Pod,
            Some("container") => Mode::Container,
            Some(other) => {
                return Err(IdentityError::Malformed {
                    name: "DYN_KUBE_DISCOVERY_MODE",
                    value: other.to_string(),
                    why: "use pod or container",
                });
            }
        };
        let object = match mode {
            Mode::Pod => pod.clone(),
            Mode::Container => {
                let container = env("CONTAINER_NAME").filter(|c| !c.is_empty()).ok_or(
                    IdentityError::Missing(
                        "CONTAINER_NAME",
                        "DYN_KUBE_DISCOVERY_MODE=container names each container's records after it",
                    ),
                )?;
                check_label("CONTAINER_NAME", &container)?;
                if container == MAIN_CONTAINER {
                    pod.clone()
                } else {
                    format!("{pod}-{container}")
                }
            }
        };
        check_name("POD_NAME (with CONTAINER_NAME)", &object)?;
        Ok(PodIdentity {
            namespace,
            pod,
            uid,
            mode,
            object,
        })
    }
}

/// A DNS subdomain, as Kubernetes takes for object names.
fn check_name(name: &'static str, value: &str) -> Result<(), IdentityError> {
    let ok = !value.is_empty()
        && value.len() <= MAX_NAME
        && value.split('.').all(|part| is_label(part, usize::MAX));
    if ok {
        Ok(())
    } else {
        Err(IdentityError::Malformed {
            name,
            value: value.to_string(),
            why: "not a Kubernetes object name (lower-case letters, digits, '-' and '.', at most 253)",
        })
    }
}

/// A DNS label (namespaces, container names).
fn check_label(name: &'static str, value: &str) -> Result<(), IdentityError> {
    if is_label(value, 63) {
        Ok(())
    } else {
        Err(IdentityError::Malformed {
            name,
            value: value.to_string(),
            why: "not a DNS label (lower-case letters, digits and '-', at most 63)",
        })
    }
}

fn is_label(value: &str, max: usize) -> bool {
    !value.is_empty()
        && value.len() <= max
        && value
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && !value.starts_with('-')
        && !value.ends_with('-')
}

/// Why the API server did not serve this worker's calls.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// No client could be built (no `KUBECONFIG`, not in a cluster).
    #[error("no Kubernetes client: {0}")]
    Config(String),
    /// The API server did not answer.
    #[error("the Kubernetes API server is unreachable: {0}")]
    Unreachable(String),
    /// 403: the pod's ServiceAccount may not do this.
    #[error(
        "the Kubernetes API server forbids it (RBAC: the ServiceAccount needs get/list/watch/create/update/patch/delete on dynamoworkermetadatas.nvidia.com): {0}"
    )]
    Forbidden(String),
    /// 404 on the collection: the CRD is not installed.
    #[error(
        "the DynamoWorkerMetadata CRD (dynamoworkermetadatas.nvidia.com) is not installed: {0}"
    )]
    NoCrd(String),
    /// Anything else the server answered.
    #[error("the Kubernetes API server answered {code}: {message}")]
    Other {
        /// The HTTP status.
        code: u16,
        /// Its message.
        message: String,
    },
    /// The object does not hold what Dynamo writes.
    #[error("DynamoWorkerMetadata {0} is malformed: {1}")]
    Malformed(String, String),
}

impl From<kube::Error> for ApiError {
    fn from(e: kube::Error) -> Self {
        match e {
            kube::Error::Api(s) if s.code == 403 => ApiError::Forbidden(s.message),
            kube::Error::Api(s) if s.code == 404 => ApiError::NoCrd(s.message),
            kube::Error::Api(s) => ApiError::Other {
                code: s.code,
                message: s.message,
            },
            other => ApiError::Unreachable(other.to_string()),
        }
    }
}

/// This worker's `DynamoWorkerMetadata` object, read and removed by name.
#[derive(Clone)]
pub struct OwnObject {
    api: Api<DynamicObject>,
    identity: PodIdentity,
}

impl OwnObject {
    /// A client for `identity`'s object, as Dynamo builds its own
    /// (`KUBECONFIG`, else in-cluster); contacts nothing.
    pub async fn new(identity: PodIdentity) -> Result<Self, ApiError> {
        let client = kube::Client::try_default()
            .await
            .map_err(|e| ApiError::Config(e.to_string()))?;
        let gvk = GroupVersionKind::gvk("nvidia.com", "v1alpha1", "DynamoWorkerMetadata");
        let resource = ApiResource::from_gvk_with_plural(&gvk, "dynamoworkermetadatas");
        let api = Api::namespaced_with(client, &identity.namespace, &resource);
        Ok(OwnObject { api, identity })
    }

    /// Who this worker is.
    pub fn identity(&self) -> &PodIdentity {
        &self.identity
    }

    /// The call Dynamo's own connection check makes: a metadata-only list of
    /// at most one object. Says whether the API server is there, lets this
    /// ServiceAccount list, and knows the CRD.
    pub async fn check(&self) -> Result<(), ApiError> {
        self.api
            .list_metadata(&ListParams::default().limit(1))
            .await?;
        Ok(())
    }

    /// Removes an object left by an earlier incarnation of this container
    /// (container mode: the pod outlives it). Dynamo's runtime does the same
    /// at its start, and panics if it fails; done here first, a failure is
    /// retried like any unreachable API server.
    pub async fn remove_stale(&self) -> Result<(), ApiError> {
        match self
            .api
            .delete(&self.identity.object, &DeleteParams::default())
            .await
        {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// What this worker's object holds now: `None` when there is no object,
    /// or only one another pod owns (an earlier pod of the same name: its
    /// records are not this worker's).
    pub async fn records(&self) -> Result<Option<DiscoveryMetadata>, ApiError> {
        let Some(object) = self.api.get_opt(&self.identity.object).await? else {
            return Ok(None);
        };
        let ours = object
            .metadata
            .owner_references
            .as_deref()
            .unwrap_or_default()
            .iter()
            .any(|o| o.uid == self.identity.uid);
        if !ours {
            return Ok(None);
        }
        let data = object
            .data
            .pointer("/spec/data")
            .cloned()
            .unwrap_or(serde_json::Value::Null);
        if data.is_null() {
            return Ok(Some(DiscoveryMetadata::new()));
        }
        serde_json::from_value(data)
            .map(Some)
            .map_err(|e| ApiError::Malformed(self.identity.object.clone(), e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn read(vars: &[(&str, &str)]) -> Result<PodIdentity, IdentityError> {
        let vars: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        PodIdentity::read(Path::new("/nonexistent/podinfo"), &|k| vars.get(k).cloned())
    }

    #[test]
    fn a_pod_is_named_after_its_pod_and_defaults_to_the_default_namespace() {
        let id = read(&[("POD_NAME", "worker-0"), ("POD_UID", "1234-abcd")]).unwrap();
        assert_eq!(id.object, "worker-0");
        assert_eq!(id.namespace, "default");
        assert_eq!(id.mode, Mode::Pod);
    }

    #[test]
    fn a_container_is_named_after_pod_and_container_except_main() {
        let base = [
            ("POD_NAME", "w"),
            ("POD_UID", "u"),
            ("DYN_KUBE_DISCOVERY_MODE", "container"),
        ];
        let mut engine = base.to_vec();
        engine.push(("CONTAINER_NAME", "engine-1"));
        assert_eq!(read(&engine).unwrap().object, "w-engine-1");
        let mut main = base.to_vec();
        main.push(("CONTAINER_NAME", "main"));
        assert_eq!(read(&main).unwrap().object, "w");
    }

    #[test]
    fn each_missing_or_malformed_variable_is_named() {
        let cases: &[(&[(&str, &str)], &str)] = &[
            (&[("POD_UID", "u")], "POD_NAME"),
            (&[("POD_NAME", "w")], "POD_UID"),
            (&[("POD_NAME", "Worker_0"), ("POD_UID", "u")], "POD_NAME"),
            (
                &[
                    ("POD_NAME", "w"),
                    ("POD_UID", "u"),
                    ("POD_NAMESPACE", "a.b"),
                ],
                "POD_NAMESPACE",
            ),
            (
                &[
                    ("POD_NAME", "w"),
                    ("POD_UID", "u"),
                    ("DYN_KUBE_DISCOVERY_MODE", "node"),
                ],
                "DYN_KUBE_DISCOVERY_MODE",
            ),
            (
                &[
                    ("POD_NAME", "w"),
                    ("POD_UID", "u"),
                    ("DYN_KUBE_DISCOVERY_MODE", "container"),
                ],
                "CONTAINER_NAME",
            ),
            (
                &[
                    ("POD_NAME", "w"),
                    ("POD_UID", "u"),
                    ("DYN_KUBE_DISCOVERY_MODE", "container"),
                    ("CONTAINER_NAME", "-x"),
                ],
                "CONTAINER_NAME",
            ),
        ];
        for (vars, named) in cases {
            let e = read(vars).expect_err("refused").to_string();
            assert!(e.starts_with(named), "{vars:?}: {e}");
        }
    }
}
