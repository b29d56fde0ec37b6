//! SGLang through `sglang.grpc.scheduler.SglangScheduler`: `GetModelInfo`
//! describes the model, `GetServerInfo` the version and `start_time` (whole
//! seconds), which is the identity; `GetLoads` answering at all is the
//! fresh-load signal. A servicer older than `GetServerInfo` is registered
//! without a version, and its connection (followed for every SGLang engine)
//! is its only identity.

use std::time::{Duration, SystemTime};

use llm_sidecar_engine_api::sglang::sglang_scheduler_client::SglangSchedulerClient;
use llm_sidecar_engine_api::sglang::{
    GetLoadsRequest, GetModelInfoRequest, GetServerInfoRequest, GetServerInfoResponse,
};
use tonic::transport::Channel;

use super::{EngineError, EngineInfo, EngineKind, Probed, UNKNOWN_VERSION, bounded, optional};
use crate::discovery::ModelRecord;

/// The identity: when the engine process started, as it says.
fn started(server: &GetServerInfoResponse) -> String {
    let at = server
        .start_time
        .as_ref()
        .map_or(SystemTime::UNIX_EPOCH, |t| {
            let secs = u64::try_from(t.seconds).unwrap_or(0);
            let nanos = u32::try_from(t.nanos).unwrap_or(0);
            SystemTime::UNIX_EPOCH + Duration::new(secs, nanos.min(999_999_999))
        });
    format!("started {}", humantime::format_rfc3339_millis(at))
}

pub(super) async fn read_info(
    channel: &Channel,
    bound: Duration,
) -> Result<EngineInfo, EngineError> {
    let mut client = SglangSchedulerClient::new(channel.clone());
    let model = bounded(
        "GetModelInfo",
        bound,
        client.get_model_info(GetModelInfoRequest {}),
    )
    .await?;
    let mut unserved = Vec::new();
    let server = optional(
        bounded(
            "GetServerInfo",
            bound,
            client.get_server_info(GetServerInfoRequest {}),
        )
        .await,
        &mut unserved,
    )?;
    let name = if model.served_model_name.is_empty() {
        model.model_path
    } else {
        model.served_model_name
    };
    let max_input = if model.max_req_input_len > 0 {
        model.max_req_input_len
    } else {
        model.max_context_length
    };
    Ok(EngineInfo {
        kind: EngineKind::Sglang,
        display_name: EngineKind::Sglang.profile().display_name.to_string(),
        identity: server
            .as_ref()
            .map_or_else(|| format!("sglang model={name}"), started),
        version: server.map_or_else(|| UNKNOWN_VERSION.to_string(), |s| s.sglang_version),
        instance_id: None,
        unserved,
        model: ModelRecord {
            name,
            max_input_len: i64::from(max_input),
            max_seq_len: i64::from(model.max_context_length),
        },
    })
}

/// `GetLoads` answering is fresh; `start_time` is who answers.
pub(super) async fn probe(channel: &Channel, bound: Duration) -> Probed {
    let mut client = SglangSchedulerClient::new(channel.clone());
    let fresh = bounded(
        "GetLoads",
        bound,
        client.get_loads(GetLoadsRequest {
            dp_rank: None,
            include: vec!["core".to_string()],
        }),
    )
    .await
    .map(|_| ());
    let identity = bounded(
        "GetServerInfo",
        bound,
        client.get_server_info(GetServerInfoRequest {}),
    )
    .await
    .ok()
    .map(|server| started(&server));
    Probed { fresh, identity }
}
