//! Flag text to typed values: durations, addresses, key segments, and the one
//! error type every bad flag becomes.
//!
//! A leaf: it imports nothing else of the IO layer, so every module that checks
//! a value (configuration, discovery URIs, TLS files) can use it without import
//! circles.

use std::time::Duration;

/// A bad flag or setting. The process exits 2 and contacts nothing.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    /// A duration that does not parse.
    #[error("{flag}: {message}")]
    Duration {
        /// The flag.
        flag: &'static str,
        /// What is wrong.
        message: String,
    },
    /// A duration outside its allowed range.
    #[error("{flag} = {value}: {message}")]
    OutOfRange {
        /// The flag.
        flag: &'static str,
        /// The value as given.
        value: String,
        /// The rule it breaks.
        message: String,
    },
    /// An address that is not `host:port`.
    #[error("{flag} = {value:?}: {message}")]
    Address {
        /// The flag.
        flag: &'static str,
        /// The value as given.
        value: String,
        /// What is wrong.
        message: String,
    },
    /// A TLS file that cannot be read or used.
    #[error("{flag} = {path}: {message}")]
    Tls {
        /// The flag.
        flag: &'static str,
        /// The file as given.
        path: String,
        /// What is wrong.
        message: String,
    },
    /// A discovery URI that is not `file:<dir>` or `etcd://host:port[,...]`.
    #[error("--discovery = {value:?}: {message}")]
    Discovery {
        /// The value as given.
        value: String,
        /// What is wrong.
        message: String,
    },
    /// A name that cannot be part of a discovery key.
    #[error("{flag} = {value:?}: {message}")]
    Name {
        /// The flag.
        flag: &'static str,
        /// The value as given.
        value: String,
        /// What is wrong.
        message: String,
    },
}

/// The longest duration any flag takes: about 31 years. Longer is a typo.
const LONGEST: Duration = Duration::from_secs(1_000_000_000);

/// Parses a duration as `humantime` reads it: number-unit pairs such as
/// `300ms`, `5s`, `1.5s`, `2m`, `1h30m`, `250us`, `2h 15min`, `1day`. A bare
/// number is refused: the unit must be explicit.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let s = text.trim();
    if s.is_empty() {
        return Err("empty duration; write it like 300ms, 5s or 2m".into());
    }
    let d = humantime::parse_duration(s)
        .map_err(|e| format!("{text:?} is not a duration ({e}); write it like 300ms, 5s or 2m"))?;
    if d > LONGEST {
        return Err(format!("{text:?} is too long"));
    }
    Ok(d)
}

/// Checks that `value` is `host:port` (`[v6]:port` for IPv6) without resolving it.
pub fn parse_host_port(flag: &'static str, value: &str) -> Result<String, ConfigError> {
    let err = |message: &str| ConfigError::Address {
        flag,
        value: value.to_string(),
        message: message.to_string(),
    };
    let (host, port) = value
        .rsplit_once(':')
        .ok_or_else(|| err("expected host:port"))?;
    if host.is_empty() {
        return Err(err("the host is empty"));
    }
    if host.contains(':') && !(host.starts_with('[') && host.ends_with(']')) {
        return Err(err("write IPv6 addresses in brackets, like [::1]:50051"));
    }
    if host
        .chars()
        .any(|c| !c.is_ascii_graphic() || "/\\?#@\"'<>`".contains(c))
    {
        return Err(err(
            "the host may hold only letters, digits and . - _ : [ ] (no spaces, control \
             characters or URL punctuation)",
        ));
    }
    match port.parse::<u16>() {
        Ok(0) | Err(_) => Err(err("the port must be a number from 1 to 65535")),
        Ok(_) => Ok(value.to_string()),
    }
}

/// Checks a namespace, component or endpoint: it becomes one segment of the
/// discovery key, so it must be non-empty and free of `/`.
pub fn parse_key_segment(flag: &'static str, value: &str) -> Result<String, ConfigError> {
    let ok = !value.is_empty()
        && value.len() <= 128
        && value
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        && value != "."
        && value != "..";
    if ok {
        Ok(value.to_string())
    } else {
        Err(ConfigError::Name {
            flag,
            value: value.to_string(),
            message: "use 1 to 128 of A-Z a-z 0-9 - _ . (it becomes part of the discovery key)"
                .into(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_like_operators_write_them() {
        let ok = [
            ("300ms", Duration::from_millis(300)),
            ("5s", Duration::from_secs(5)),
            ("1.5s", Duration::from_millis(1500)),
            ("2m", Duration::from_secs(120)),
            ("1h30m", Duration::from_secs(5400)),
            ("250us", Duration::from_micros(250)),
            ("0s", Duration::ZERO),
            ("2h 15min", Duration::from_secs(8100)),
            ("1day", Duration::from_secs(86_400)),
        ];
        for (text, want) in ok {
            assert_eq!(parse_duration(text), Ok(want), "{text}");
        }
        for bad in [
            "", "5", "s", "5x", "-1s", "1..5s", "1e9h", "5 s s", "100years",
        ] {
            assert!(parse_duration(bad).is_err(), "{bad:?} should be refused");
        }
    }

    #[test]
    fn host_port_is_checked_without_resolving() {
        assert!(parse_host_port("--x", "127.0.0.1:50051").is_ok());
        assert!(parse_host_port("--x", "engine.local:1").is_ok());
        assert!(parse_host_port("--x", "[::1]:50051").is_ok());
        for bad in [
            "127.0.0.1",
            ":50051",
            "host:0",
            "host:70000",
            "::1:50051",
            "a b:1",
            "evil\n:1",
            "e\u{1b}[2J:1",
            "h\u{e9}:1",
            "a/b:1",
        ] {
            assert!(
                parse_host_port("--x", bad).is_err(),
                "{bad:?} should be refused"
            );
        }
    }

    #[test]
    fn key_segments_refuse_slashes_and_dots() {
        assert!(parse_key_segment("--namespace", "dynamo").is_ok());
        for bad in ["", "a/b", "..", "sp ace"] {
            assert!(parse_key_segment("--namespace", bad).is_err(), "{bad:?}");
        }
    }
}
