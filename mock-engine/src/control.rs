//! The mock's HTTP control endpoint (GET, query parameters):
//!
//! | path | effect |
//! |---|---|
//! | `/liveness?status=N[&service=S]` | set a health service's raw status (registers it); the default service is the kind's liveness one (`liveness`, or the engine's gRPC service for vLLM and SGLang) |
//! | `/unregister?service=S` | remove a health service (Watch then sees SERVICE_UNKNOWN) |
//! | `/stall` | SGLang's stall: the scheduler produced nothing with requests pending, so its service turns NOT_SERVING (SGLang after 30 s; the mock at once) |
//! | `/getload?mode=ok\|stall\|unavailable\|unimplemented` | how GetLoad (OpenEngine) and GetLoads (vLLM, SGLang) answer: unavailable is TensorRT-LLM's stale KV snapshot, unimplemented a servicer older than the RPC |
//! | `/load?used_kv_blocks=N&running=N&queued=N` | the load OpenEngine's GetLoad reports (each parameter optional; blocks of 8,192, 32 tokens each) |
//! | `/watch/end[?trailers=false]` | end every open Watch stream with OK (or with no trailers at all) |
//! | `/watch/hold?on=true\|false` | hold back (or release) the first message of Watch streams |
//! | `/watch/fail?code=N&message=M` | fail every open Watch stream with that status |
//! | `/healthcheck?mode=ok\|stall\|text&text=T` | how HealthCheck answers |
//! | `/identity?version=V` | change the version GetServerInfo reports |
//! | `/fault?action=cut\|exit\|malformed\|replay&at=N[&code=C&message=M]` | the next Generate's message `at` (tokens count from 0; the number of tokens asked for is the final message) is replaced: `cut` fails the stream with status C (13) and message M, `exit` ends the mock process (exit 137, as a kill), `malformed` sends a message no client can read (OpenEngine: no event); `replay` sends the last token again after the final message; `max_prompt=P`: only a Generate whose prompt has at most P tokens takes it |
//! | `/kv-events?publish=on\|off` | the OpenEngine KV event publisher sends nothing (neither events nor heartbeats) while off, as one that died while the engine serves |
//! | `/stop?grace_ms=N` | graceful stop: NOT_SERVING, cancel calls after the grace, exit |
//! | `/stats` | counters as JSON |

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use llm_sidecar_io::admin::http::{Handler, Request, Response};

use crate::{
    Fault, FaultAction, HealthCheckMode, LoadMode, NOT_SERVING, State, WatchControl,
    liveness_service, lock,
};

pub(crate) fn handler(state: Arc<State>) -> Handler {
    Arc::new(move |req: &Request| route(&state, req))
}

fn route(state: &State, req: &Request) -> Response {
    match req.path.as_str() {
        "/liveness" => {
            let service = req
                .param("service")
                .unwrap_or(liveness_service(state.config.kind));
            match req.param("status").map(str::parse::<i32>) {
                Some(Ok(status)) => {
                    state.set_status(service, status);
                    Response::text(200, format!("{service} = {status}\n"))
                }
                _ => Response::text(400, "status must be an integer\n"),
            }
        }
        "/unregister" => {
            let service = req
                .param("service")
                .unwrap_or(liveness_service(state.config.kind));
            state.unregister(service);
            Response::text(200, format!("{service} unregistered\n"))
        }
        "/stall" => {
            let service = liveness_service(state.config.kind);
            state.set_status(service, NOT_SERVING);
            Response::text(200, format!("scheduler stalled: {service} NOT_SERVING\n"))
        }
        "/getload" => {
            let mode = match req.param("mode") {
                Some("ok") | None => LoadMode::Ok,
                Some("stall") => LoadMode::Stall,
                Some("unavailable") => LoadMode::Unavailable,
                Some("unimplemented") => LoadMode::Unimplemented,
                Some(other) => return Response::text(400, format!("unknown mode {other:?}\n")),
            };
            *lock(&state.load_mode) = mode;
            Response::text(200, format!("load = {mode:?}\n"))
        }
        "/load" => {
            let mut kv = *lock(&state.kv);
            for (name, slot) in [("running", &mut kv.running), ("queued", &mut kv.queued)] {
                match req.param(name).map(str::parse::<u32>) {
                    None => {}
                    Some(Ok(v)) => *slot = v,
                    Some(Err(_)) => return Response::text(400, format!("{name}: a count\n")),
                }
            }
            match req.param("used_kv_blocks").map(str::parse::<u64>) {
                None => {}
                Some(Ok(v)) if v <= crate::TOTAL_KV_BLOCKS => kv.used_blocks = v,
                Some(_) => {
                    return Response::text(
                        400,
                        format!("used_kv_blocks: 0 to {}\n", crate::TOTAL_KV_BLOCKS),
                    );
                }
            }
            *lock(&state.kv) = kv;
            Response::text(200, format!("{kv:?}\n"))
        }
        "/watch/end" => {
            let without_trailers = req.param("trailers") == Some("false");
            state
                .end_without_trailers
                .store(without_trailers, Ordering::Release);
            let _ = state.watch_control.send(WatchControl::End);
            Response::text(200, "watch streams ended\n")
        }
        "/pause" => match req.param("on") {
            Some(on @ ("true" | "false")) => {
                state.paused.store(on == "true", Ordering::Release);
                state.changed.send_modify(|v| *v += 1);
                Response::text(200, format!("paused = {on}\n"))
            }
            _ => Response::text(400, "on must be true or false\n"),
        },
        "/watch/hold" => match req.param("on") {
            Some(on @ ("true" | "false")) => {
                let hold = on == "true";
                state.hold_watch.send_replace(hold);
                Response::text(200, format!("hold = {hold}\n"))
            }
            _ => Response::text(400, "on must be true or false\n"),
        },
        "/watch/fail" => {
            let code = req.param("code").and_then(|c| c.parse().ok()).unwrap_or(14);
            let message = req
                .param("message")
                .unwrap_or("failed by the control endpoint")
                .to_string();
            let _ = state
                .watch_control
                .send(WatchControl::Fail { code, message });
            Response::text(200, "watch streams failed\n")
        }
        "/healthcheck" => {
            let mode = match req.param("mode") {
                Some("ok") | None => HealthCheckMode::Ok,
                Some("stall") => HealthCheckMode::Stall,
                Some("text") => {
                    HealthCheckMode::Text(req.param("text").unwrap_or("NOT OK").to_string())
                }
                Some(other) => return Response::text(400, format!("unknown mode {other:?}\n")),
            };
            *lock(&state.health_check) = mode;
            Response::text(200, "ok\n")
        }
        "/identity" => match req.param("version") {
            Some(v) => {
                *lock(&state.version) = v.to_string();
                Response::text(200, format!("version = {v}\n"))
            }
            None => Response::text(400, "version is required\n"),
        },
        "/fault" => match fault(req) {
            Ok(f) => {
                let said = format!("next Generate: {f:?}\n");
                *lock(&state.fault) = Some(f);
                Response::text(200, said)
            }
            Err(e) => Response::text(400, format!("{e}\n")),
        },
        "/kv-events" => match (&state.kv_events, req.param("publish")) {
            (None, _) => Response::text(404, "this engine publishes no KV events\n"),
            (Some(events), Some(publish @ ("on" | "off"))) => {
                events.set_silent(publish == "off");
                Response::text(200, format!("KV events and heartbeats: {publish}\n"))
            }
            (Some(events), None) => {
                if let Some(ms) = req.param("flood_ms").and_then(|m| m.parse().ok()) {
                    events.flood(Duration::from_millis(ms));
                    Response::text(200, format!("flooding KV events for {ms} ms\n"))
                } else if let Some(blocks) = req.param("store_unheld").and_then(|b| b.parse().ok())
                {
                    events.store_unheld(blocks);
                    Response::text(200, format!("one event storing {blocks} blocks\n"))
                } else {
                    Response::text(400, "publish=on|off, flood_ms=N or store_unheld=N\n")
                }
            }
            (Some(_), _) => Response::text(400, "publish: on or off\n"),
        },
        "/server-info" => match server_info(req) {
            Ok(reported) => {
                let said = format!("GetServerInfo now reports {reported:?}\n");
                *lock(&state.server_info) = reported;
                Response::text(200, said)
            }
            Err(e) => Response::text(400, format!("{e}\n")),
        },
        "/stop" => {
            let grace = req
                .param("grace_ms")
                .and_then(|g| g.parse().ok())
                .unwrap_or(0);
            let _ = state
                .stop_requested
                .send(Some(Duration::from_millis(grace)));
            Response::text(200, "stopping\n")
        }
        "/stats" => {
            let c = &state.counters;
            let json = serde_json::json!({
                "generate_started": c.generate_started.load(Ordering::Relaxed),
                "generate_completed": c.generate_completed.load(Ordering::Relaxed),
                "generate_cancelled": c.generate_cancelled.load(Ordering::Relaxed),
                "aborts": c.aborts.load(Ordering::Relaxed),
                "health_checks": c.health_checks.load(Ordering::Relaxed),
                "load_calls": c.load_calls.load(Ordering::Relaxed),
                "info_calls": c.info_calls.load(Ordering::Relaxed),
                "watch_streams": c.watch_streams.load(Ordering::Relaxed),
                "connections": c.connections.load(Ordering::Relaxed),
                // The id its kind's API names the process by.
                "instance_id": if state.config.kind == crate::EngineKind::SglangNative {
                    state.start_unix_nanos.to_string()
                } else {
                    state.instance_id.clone()
                },
                "seen_ids": *lock(&state.seen_ids),
                "cancelled_ids": *lock(&state.cancelled_ids),
                "asked": *lock(&state.asked),
                "aborted_ids": *lock(&state.aborted_ids),
                "kv_events": state.kv_events.as_ref().map(|e| serde_json::json!({
                    "address": e.addr.to_string(),
                    "publishing": !e.is_silent(),
                    "messages": e.published.load(Ordering::Relaxed),
                    "events": e.events.load(Ordering::Relaxed),
                    "blocks_held": e.blocks_held(),
                })),
            });
            Response::json(200, json.to_string() + "\n")
        }
        _ => Response::text(404, "unknown control path\n"),
    }
}

/// The fault `/fault` asks for.
/// `/server-info?kv_block_size=&total_kv_blocks=&data_parallel_size=&data_parallel_start_rank=`:
/// what GetServerInfo reports from now on (each value not given: the mock's own).
fn server_info(req: &Request) -> Result<crate::ReportedInfo, String> {
    fn number<T: std::str::FromStr>(req: &Request, name: &str, default: T) -> Result<T, String> {
        match req.param(name).map(str::parse::<T>) {
            None => Ok(default),
            Some(Ok(v)) => Ok(v),
            Some(Err(_)) => Err(format!("{name}: an unsigned number")),
        }
    }
    let mine = crate::ReportedInfo::default();
    Ok(crate::ReportedInfo {
        kv_block_size: number(req, "kv_block_size", mine.kv_block_size)?,
        total_kv_blocks: number(req, "total_kv_blocks", mine.total_kv_blocks)?,
        data_parallel_size: number(req, "data_parallel_size", mine.data_parallel_size)?,
        data_parallel_start_rank: number(
            req,
            "data_parallel_start_rank",
            mine.data_parallel_start_rank,
        )?,
    })
}

fn fault(req: &Request) -> Result<Fault, String> {
    let at = match req.param("at").map(str::parse::<u32>) {
        None => 0,
        Some(Ok(at)) => at,
        Some(Err(_)) => return Err("at: a message number".into()),
    };
    let action = match req.param("action") {
        Some("cut") => FaultAction::Cut {
            code: match req.param("code").map(str::parse::<i32>) {
                None => 13,
                Some(Ok(code)) if (1..=16).contains(&code) => code,
                Some(_) => return Err("code: a gRPC status code, 1 to 16".into()),
            },
            message: req
                .param("message")
                .unwrap_or("mock fault: the stream was cut")
                .to_string(),
        },
        Some("exit") => FaultAction::Exit,
        Some("malformed") => FaultAction::Malformed,
        Some("replay") => FaultAction::Replay,
        other => {
            return Err(format!(
                "action: cut, exit, malformed or replay (got {other:?})"
            ));
        }
    };
    let max_prompt = match req.param("max_prompt").map(str::parse::<usize>) {
        None => None,
        Some(Ok(n)) => Some(n),
        Some(Err(_)) => return Err("max_prompt: a token count".into()),
    };
    Ok(Fault {
        at,
        action,
        max_prompt,
    })
}
