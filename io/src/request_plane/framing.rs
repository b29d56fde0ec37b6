//! gRPC over HTTP/2 as the request plane reads it, as pure functions: the
//! `grpc-timeout` header and the 5-byte prefix of every message. Nothing here
//! touches a socket or a clock.

use std::time::Duration;

/// Every gRPC message starts with a prefix: 1 flag byte (compressed or not)
/// and the message length as 4 big-endian bytes.
pub(crate) const PREFIX_LEN: usize = 5;

/// The longest `grpc-timeout` value the gRPC spec allows: 8 digits and a unit.
const TIMEOUT_MAX_LEN: usize = 9;

/// Parses `grpc-timeout` (`<digits><unit>`, unit H M S m u n); `None` if absent
/// or malformed (a malformed timeout is ignored, as gRPC servers do).
pub(crate) fn grpc_timeout(headers: &http::HeaderMap) -> Option<Duration> {
    let v = headers.get("grpc-timeout")?.to_str().ok()?;
    if v.len() < 2 || v.len() > TIMEOUT_MAX_LEN {
        return None;
    }
    let (digits, unit) = v.split_at(v.len() - 1);
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.saturating_mul(3600)),
        "M" => Duration::from_secs(n.saturating_mul(60)),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// The status message of a call that carried a message over the limit.
pub(crate) fn too_large_message(limit: u32) -> String {
    format!("message larger than the sidecar's limit of {limit} bytes")
}

/// The status message of a call whose engine answer carried headers (or
/// trailers) over the limit.
pub(crate) fn too_large_headers_message(limit: u32) -> String {
    format!("engine response headers larger than the sidecar's limit of {limit} bytes")
}

/// A header list's size as HTTP/2 counts it against SETTINGS_MAX_HEADER_LIST_SIZE
/// (RFC 9113 §6.5.2): name and value, plus 32 bytes per field.
pub(crate) fn header_list_size(headers: &http::HeaderMap) -> usize {
    headers
        .iter()
        .map(|(name, value)| name.as_str().len() + value.len() + 32)
        .sum()
}

/// Reads gRPC message prefixes across chunks and refuses a message longer than
/// the limit; the payload is never copied.
#[derive(Debug)]
pub(crate) struct MessageLimiter {
    limit: u32,
    prefix: [u8; PREFIX_LEN],
    prefix_len: usize,
    payload_left: u64,
}

impl MessageLimiter {
    pub(crate) fn new(limit: u32) -> Self {
        MessageLimiter {
            limit,
            prefix: [0; PREFIX_LEN],
            prefix_len: 0,
            payload_left: 0,
        }
    }

    /// The largest message let through, in bytes.
    pub(crate) fn limit(&self) -> u32 {
        self.limit
    }

    /// A message has begun and not all of it was fed yet.
    pub(crate) fn mid_message(&self) -> bool {
        self.prefix_len > 0 || self.payload_left > 0
    }

    /// Feeds one chunk; `Err(len)` if a message declares more than the limit.
    pub(crate) fn feed(&mut self, mut chunk: &[u8]) -> Result<(), u32> {
        while !chunk.is_empty() {
            if self.payload_left > 0 {
                let take = (chunk.len() as u64).min(self.payload_left);
                self.payload_left -= take;
                chunk = &chunk[take as usize..];
                continue;
            }
            let take = (PREFIX_LEN - self.prefix_len).min(chunk.len());
            self.prefix[self.prefix_len..self.prefix_len + take].copy_from_slice(&chunk[..take]);
            self.prefix_len += take;
            chunk = &chunk[take..];
            if self.prefix_len == PREFIX_LEN {
                let [_flag, a, b, c, d] = self.prefix;
                let len = u32::from_be_bytes([a, b, c, d]);
                if len > self.limit {
                    return Err(len);
                }
                self.payload_left = u64::from(len);
                self.prefix_len = 0;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_is_begun_until_its_last_byte_is_fed() {
        let mut limiter = MessageLimiter::new(1024);
        assert!(!limiter.mid_message());
        limiter.feed(&[0, 0, 0]).unwrap();
        assert!(limiter.mid_message(), "half a prefix");
        limiter.feed(&[0, 3, b'a']).unwrap();
        assert!(limiter.mid_message(), "2 of 3 payload bytes to come");
        limiter.feed(&[b'b', b'c', 0, 0, 0, 0, 0]).unwrap();
        assert!(
            !limiter.mid_message(),
            "that one and an empty one, complete"
        );
    }

    #[test]
    fn grpc_timeouts_parse() {
        let mut h = http::HeaderMap::new();
        for (v, want) in [
            ("5S", Duration::from_secs(5)),
            ("250m", Duration::from_millis(250)),
            ("1H", Duration::from_secs(3600)),
        ] {
            h.insert("grpc-timeout", v.parse().unwrap());
            assert_eq!(grpc_timeout(&h), Some(want));
        }
        for bad in ["", "S", "5", "5x", "1234567890S"] {
            h.insert("grpc-timeout", bad.parse().unwrap());
            assert_eq!(grpc_timeout(&h), None, "{bad:?}");
        }
    }

    #[test]
    fn limiter_reads_prefixes_across_chunks() {
        let mut l = MessageLimiter::new(10);
        let msg = |n: u32| {
            let mut v = vec![0u8];
            v.extend_from_slice(&n.to_be_bytes());
            v.extend(std::iter::repeat_n(7u8, n as usize));
            v
        };
        let mut stream = msg(10);
        stream.extend(msg(3));
        for chunk in stream.chunks(3) {
            assert_eq!(l.feed(chunk), Ok(()));
        }
        let big = msg(11);
        assert_eq!(l.feed(&big[..2]), Ok(()));
        assert_eq!(l.feed(&big[2..]), Err(11));
    }
}
