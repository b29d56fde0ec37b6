//! The numbers gRPC puts on the wire that the core reads (status codes, the
//! health service's serving status) and their names for log lines.
//!
//! A leaf: liveness interprets these numbers and loss reasons name them, and
//! both take them from here (neither imports the other for them).

/// `grpc.health.v1.HealthCheckResponse.ServingStatus` values, as raw numbers.
pub mod serving_status {
    /// UNKNOWN
    pub const UNKNOWN: i32 = 0;
    /// SERVING
    pub const SERVING: i32 = 1;
    /// NOT_SERVING
    pub const NOT_SERVING: i32 = 2;
    /// SERVICE_UNKNOWN (used only by Watch)
    pub const SERVICE_UNKNOWN: i32 = 3;
}

/// gRPC status codes the interpretation cares about.
pub mod grpc_code {
    /// NOT_FOUND: tonic-health's answer for an unregistered service.
    pub const NOT_FOUND: i32 = 5;
    /// UNIMPLEMENTED: the engine has no grpc.health.v1 service at all.
    pub const UNIMPLEMENTED: i32 = 12;
}

/// The canonical upper-case name of a gRPC status code (`UNAVAILABLE`), or its number.
pub fn grpc_code_name(code: i32) -> String {
    const NAMES: [&str; 17] = [
        "OK",
        "CANCELLED",
        "UNKNOWN",
        "INVALID_ARGUMENT",
        "DEADLINE_EXCEEDED",
        "NOT_FOUND",
        "ALREADY_EXISTS",
        "PERMISSION_DENIED",
        "RESOURCE_EXHAUSTED",
        "FAILED_PRECONDITION",
        "ABORTED",
        "OUT_OF_RANGE",
        "UNIMPLEMENTED",
        "INTERNAL",
        "UNAVAILABLE",
        "DATA_LOSS",
        "UNAUTHENTICATED",
    ];
    usize::try_from(code)
        .ok()
        .and_then(|i| NAMES.get(i))
        .map_or_else(|| format!("code {code}"), |s| (*s).to_string())
}

/// The name of a raw ServingStatus value, or the value itself when outside the enum.
pub fn serving_status_name(raw: i32) -> String {
    match raw {
        serving_status::UNKNOWN => "UNKNOWN".into(),
        serving_status::SERVING => "SERVING".into(),
        serving_status::NOT_SERVING => "NOT_SERVING".into(),
        serving_status::SERVICE_UNKNOWN => "SERVICE_UNKNOWN".into(),
        other => other.to_string(),
    }
}

/// The name of an HTTP/2 error code (RFC 9113 section 7: `NO_ERROR`,
/// `ENHANCE_YOUR_CALM`, ...), or its number.
pub(crate) fn http2_error_name(code: u32) -> String {
    const NAMES: [&str; 14] = [
        "NO_ERROR",
        "PROTOCOL_ERROR",
        "INTERNAL_ERROR",
        "FLOW_CONTROL_ERROR",
        "SETTINGS_TIMEOUT",
        "STREAM_CLOSED",
        "FRAME_SIZE_ERROR",
        "REFUSED_STREAM",
        "CANCEL",
        "COMPRESSION_ERROR",
        "CONNECT_ERROR",
        "ENHANCE_YOUR_CALM",
        "INADEQUATE_SECURITY",
        "HTTP_1_1_REQUIRED",
    ];
    usize::try_from(code)
        .ok()
        .and_then(|i| NAMES.get(i))
        .map_or_else(|| code.to_string(), |name| (*name).to_string())
}
