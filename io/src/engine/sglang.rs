//! SGLang through `sglang.grpc.scheduler.SglangScheduler`: `GetModelInfo`
//! describes the model, `GetServerInfo` the version and `start_time` (whole
//! seconds), which is the identity; `GetLoads` answering at all is the
//! fresh-load signal. A servicer older than `GetServerInfo` is registered
//! without a version, and its connection (followed for every SGLang engine)
//! is its only identity.
//!
//! The lengths ([`lengths`]): smg's Python servicer (0.14.1) reports the KV
//! pool's size as `GetModelInfo.max_context_length`; the model's own context
//! length is on the API only as `server_args.context_length`, when the
//! operator set it. The pool goes to the record as what it is
//! (`kv_cache_tokens`).

use std::time::{Duration, SystemTime};

use llm_sidecar_engine_api::sglang::arg_value::Kind;
use llm_sidecar_engine_api::sglang::sglang_scheduler_client::SglangSchedulerClient;
use llm_sidecar_engine_api::sglang::{
    GetLoadsRequest, GetModelInfoRequest, GetModelInfoResponse, GetServerInfoRequest,
    GetServerInfoResponse,
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
    let (max_input, max_seq, kv_cache) = lengths(&model, server.as_ref());
    let name = if model.served_model_name.is_empty() {
        model.model_path
    } else {
        model.served_model_name
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
            max_input_len: max_input,
            max_seq_len: max_seq,
            kv_cache_tokens: kv_cache,
        },
    })
}

/// The longest input, the longest sequence, and the KV pool (tokens).
///
/// The sequence: `server_args.context_length` where the operator set it.
/// Else, where `max_context_length` is the KV pool (the Python servicer: it
/// equals `GetServerInfo.max_total_num_tokens`), the longest sequence SGLang
/// takes: it sets `max_req_input_len` to `min(context_len - 1, pool - 1) - 5`
/// (SGLang 0.5.23 `tp_worker.py`), so `max_req_input_len + 6`, at most the
/// pool. Else (smg's Rust servicer) `max_context_length`, the model's own.
fn lengths(
    model: &GetModelInfoResponse,
    server: Option<&GetServerInfoResponse>,
) -> (i64, i64, Option<i64>) {
    let max_input = if model.max_req_input_len > 0 {
        model.max_req_input_len
    } else {
        model.max_context_length
    };
    let pool = server
        .map(|s| i64::from(s.max_total_num_tokens))
        .filter(|n| *n > 0);
    let set_by_operator = server
        .and_then(|s| s.server_args.as_ref())
        .and_then(|args| args.fields.get("context_length"))
        .and_then(|value| match value.kind {
            Some(Kind::NumberValue(n)) if n >= 1.0 && n <= i64::MAX as f64 => Some(n as i64),
            _ => None,
        });
    let reported = i64::from(model.max_context_length);
    let max_seq = match (set_by_operator, pool) {
        (Some(context), _) => context,
        (None, Some(pool)) if reported == pool && model.max_req_input_len > 0 => {
            (i64::from(model.max_req_input_len) + 6).min(pool)
        }
        (None, _) => reported,
    };
    (i64::from(max_input), max_seq, pool)
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

#[cfg(test)]
mod tests {
    use llm_sidecar_engine_api::sglang::{ArgValue, Args};

    use super::*;

    fn model(max_context_length: i32, max_req_input_len: i32) -> GetModelInfoResponse {
        GetModelInfoResponse {
            max_context_length,
            max_req_input_len,
            ..Default::default()
        }
    }

    fn server(pool: i32, context_length: Option<f64>) -> GetServerInfoResponse {
        let value = ArgValue {
            kind: Some(context_length.map_or(Kind::NullValue(0), Kind::NumberValue)),
        };
        GetServerInfoResponse {
            server_args: Some(Args {
                fields: [("context_length".to_string(), value)].into(),
            }),
            max_total_num_tokens: pool,
            ..Default::default()
        }
    }

    #[test]
    fn the_kv_pool_is_recorded_as_the_pool_not_as_the_models_length() {
        // smg's Python servicer: max_context_length is the pool; a model of
        // 8192 tokens gives max_req_input_len 8186.
        assert_eq!(
            lengths(&model(65_536, 8_186), Some(&server(65_536, None))),
            (8_186, 8_192, Some(65_536))
        );
        // The operator's --context-length, where set, is the model's length.
        assert_eq!(
            lengths(&model(65_536, 8_186), Some(&server(65_536, Some(8_192.0)))),
            (8_186, 8_192, Some(65_536))
        );
        // A pool smaller than the context: the longest sequence it takes.
        assert_eq!(
            lengths(&model(4_000, 3_994), Some(&server(4_000, None))),
            (3_994, 4_000, Some(4_000))
        );
        // smg's Rust servicer: max_context_length is the model's own.
        assert_eq!(
            lengths(&model(32_768, 32_762), Some(&server(65_536, None))),
            (32_762, 32_768, Some(65_536))
        );
        // No GetServerInfo (an older servicer): what the model info says.
        assert_eq!(lengths(&model(8_192, 0), None), (8_192, 8_192, None));
    }
}
