//! HTTP/2 frame headers, read as bytes pass by (RFC 9113 §4.1): 9 bytes of
//! length, type, flags and stream id before every frame. Nothing is copied or
//! changed; a payload is skipped unless the reader asks for it.
//!
//! Used on both sides of the proxy: to watch what a caller sends (flood
//! budget, handshake) and to read the engine's SETTINGS (its stream limit).

/// The client connection preface: `PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n`.
pub(crate) const CLIENT_PREFACE_LEN: usize = 24;

/// Frame types this crate tells apart by name (the rest count as control
/// frames).
pub(crate) mod kind {
    pub(crate) const DATA: u8 = 0x0;
    pub(crate) const HEADERS: u8 = 0x1;
    pub(crate) const SETTINGS: u8 = 0x4;
    pub(crate) const GOAWAY: u8 = 0x7;
    pub(crate) const CONTINUATION: u8 = 0x9;
}

/// Flags this crate cares about.
pub(crate) mod flag {
    /// DATA, HEADERS: the last frame of the stream.
    pub(crate) const END_STREAM: u8 = 0x1;
    /// SETTINGS, PING: an acknowledgement.
    pub(crate) const ACK: u8 = 0x1;
}

/// SETTINGS_MAX_CONCURRENT_STREAMS.
pub(crate) const SETTINGS_MAX_CONCURRENT_STREAMS: u16 = 0x3;

/// GOAWAY's error code for a peer that generates excessive load.
pub(crate) const ENHANCE_YOUR_CALM: u32 = 0xb;

/// One frame's header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FrameHead {
    pub(crate) len: u32,
    pub(crate) kind: u8,
    pub(crate) flags: u8,
    pub(crate) stream: u32,
}

/// A GOAWAY frame: no stream above `last_stream` was or will be processed.
pub(crate) fn goaway(last_stream: u32, code: u32) -> [u8; 17] {
    let mut frame = [0u8; 17];
    frame[..3].copy_from_slice(&8u32.to_be_bytes()[1..]);
    frame[3] = kind::GOAWAY;
    frame[9..13].copy_from_slice(&(last_stream & 0x7fff_ffff).to_be_bytes());
    frame[13..].copy_from_slice(&code.to_be_bytes());
    frame
}

/// Walks frame headers across chunks of a byte stream.
#[derive(Debug)]
pub(crate) struct FrameReader {
    /// Bytes of the client preface still to skip (0 on the server's side).
    preface_left: usize,
    head: [u8; 9],
    head_len: usize,
    /// Payload bytes of the current frame not seen yet.
    payload_left: u32,
    /// The current frame's payload goes to `on_payload`.
    wanted: bool,
}

impl FrameReader {
    /// A reader for what a client sends: the preface, then frames.
    pub(crate) fn client_side() -> Self {
        FrameReader {
            preface_left: CLIENT_PREFACE_LEN,
            ..FrameReader::server_side()
        }
    }

    /// A reader for what a server sends: frames from the first byte.
    pub(crate) fn server_side() -> Self {
        FrameReader {
            preface_left: 0,
            head: [0; 9],
            head_len: 0,
            payload_left: 0,
            wanted: false,
        }
    }

    /// Between two frames (and past the preface): a frame may start here.
    pub(crate) fn at_boundary(&self) -> bool {
        self.preface_left == 0 && self.head_len == 0 && self.payload_left == 0
    }

    /// The preface has been read whole.
    pub(crate) fn past_preface(&self) -> bool {
        self.preface_left == 0
    }

    /// Feeds one chunk. `on_head` hears every frame header; `on_payload`
    /// hears the payload bytes of the frames `on_head` asked for (by
    /// returning true), in order, possibly split across calls.
    pub(crate) fn feed(
        &mut self,
        mut chunk: &[u8],
        mut on_head: impl FnMut(FrameHead) -> bool,
        mut on_payload: impl FnMut(&[u8]),
    ) {
        while !chunk.is_empty() {
            if self.preface_left > 0 {
                let skip = self.preface_left.min(chunk.len());
                self.preface_left -= skip;
                chunk = &chunk[skip..];
                continue;
            }
            if self.payload_left > 0 {
                let take = (self.payload_left as usize).min(chunk.len());
                if self.wanted {
                    on_payload(&chunk[..take]);
                }
                self.payload_left -= take as u32;
                chunk = &chunk[take..];
                continue;
            }
            let take = (9 - self.head_len).min(chunk.len());
            self.head[self.head_len..self.head_len + take].copy_from_slice(&chunk[..take]);
            self.head_len += take;
            chunk = &chunk[take..];
            if self.head_len == 9 {
                self.head_len = 0;
                let h = self.head;
                let head = FrameHead {
                    len: u32::from_be_bytes([0, h[0], h[1], h[2]]),
                    kind: h[3],
                    flags: h[4],
                    stream: u32::from_be_bytes([h[5], h[6], h[7], h[8]]) & 0x7fff_ffff,
                };
                self.payload_left = head.len;
                self.wanted = on_head(head);
            }
        }
    }
}

/// Collects a SETTINGS payload (6-byte entries) and reads one setting out of it.
#[derive(Debug, Default)]
pub(crate) struct SettingsPayload {
    bytes: Vec<u8>,
}

impl SettingsPayload {
    /// A SETTINGS frame holds at most a few entries; more is not kept.
    const MAX: usize = 6 * 64;

    pub(crate) fn push(&mut self, part: &[u8]) {
        let room = Self::MAX.saturating_sub(self.bytes.len());
        self.bytes.extend_from_slice(&part[..part.len().min(room)]);
    }

    /// The last value given for `id`, if any.
    pub(crate) fn value(&self, id: u16) -> Option<u32> {
        self.bytes
            .chunks_exact(6)
            .rev()
            .find(|e| u16::from_be_bytes([e[0], e[1]]) == id)
            .map(|e| u32::from_be_bytes([e[2], e[3], e[4], e[5]]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let mut f = (payload.len() as u32).to_be_bytes()[1..].to_vec();
        f.push(kind);
        f.push(flags);
        f.extend(stream.to_be_bytes());
        f.extend(payload);
        f
    }

    #[test]
    fn headers_are_read_across_any_split_and_settings_are_picked_out() {
        let mut bytes = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        let mut settings = Vec::new();
        settings.extend(SETTINGS_MAX_CONCURRENT_STREAMS.to_be_bytes());
        settings.extend(100u32.to_be_bytes());
        bytes.extend(frame(kind::SETTINGS, 0, 0, &settings));
        bytes.extend(frame(0x6, 0, 0, b"12345678"));
        bytes.extend(frame(kind::DATA, flag::END_STREAM, 3, b"hello"));
        for split in 1..bytes.len() {
            let mut reader = FrameReader::client_side();
            let mut heads = Vec::new();
            let mut payload = SettingsPayload::default();
            for chunk in bytes.chunks(split) {
                reader.feed(
                    chunk,
                    |h| {
                        heads.push(h);
                        h.kind == kind::SETTINGS
                    },
                    |p| payload.push(p),
                );
            }
            let kinds: Vec<u8> = heads.iter().map(|h| h.kind).collect();
            assert_eq!(
                kinds,
                vec![kind::SETTINGS, 0x6, kind::DATA],
                "split {split}"
            );
            assert_eq!(heads[2].stream, 3);
            assert_eq!(payload.value(SETTINGS_MAX_CONCURRENT_STREAMS), Some(100));
            assert!(reader.at_boundary());
        }
    }

    #[test]
    fn a_goaway_frame_reads_back() {
        let g = goaway(7, ENHANCE_YOUR_CALM);
        let mut reader = FrameReader::server_side();
        let mut seen = None;
        reader.feed(
            &g,
            |h| {
                seen = Some(h);
                false
            },
            |_| {},
        );
        assert_eq!(
            seen,
            Some(FrameHead {
                len: 8,
                kind: kind::GOAWAY,
                flags: 0,
                stream: 0
            })
        );
        assert_eq!(&g[9..13], &7u32.to_be_bytes());
        assert_eq!(&g[13..], &ENHANCE_YOUR_CALM.to_be_bytes());
    }
}
