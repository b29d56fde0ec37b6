//! Time as the core sees it: a monotonic instant handed in by the caller.
//!
//! The core never reads a clock. The IO layer picks an origin (its own start-up
//! `Instant`) and passes `Time::from(origin.elapsed())` with every input, so the
//! same machine runs in real time under tokio and faster than real time in the
//! property tests, the explorer and the fuzzer.

use std::fmt;
use std::ops::{Add, Sub};
use std::time::Duration;

/// A point on the caller's monotonic clock, measured from an arbitrary origin.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Time(Duration);

impl Time {
    /// The origin of the caller's clock.
    pub const ZERO: Time = Time(Duration::ZERO);

    /// The point `since_origin` after the origin.
    pub const fn from_duration(since_origin: Duration) -> Self {
        Time(since_origin)
    }

    /// The point `millis` milliseconds after the origin.
    pub const fn from_millis(millis: u64) -> Self {
        Time(Duration::from_millis(millis))
    }

    /// How far this point is from the origin.
    pub const fn since_origin(self) -> Duration {
        self.0
    }

    /// Time elapsed from `earlier` to `self`, zero if `earlier` is later.
    pub fn saturating_since(self, earlier: Time) -> Duration {
        self.0.saturating_sub(earlier.0)
    }
}

impl Add<Duration> for Time {
    type Output = Time;
    /// Saturates instead of overflowing: a deadline "at the end of time" is
    /// simply never reached.
    fn add(self, rhs: Duration) -> Time {
        Time(self.0.saturating_add(rhs))
    }
}

impl Sub<Time> for Time {
    type Output = Duration;
    fn sub(self, rhs: Time) -> Duration {
        self.saturating_since(rhs)
    }
}

impl From<Duration> for Time {
    fn from(d: Duration) -> Self {
        Time(d)
    }
}

/// Formats a duration the way operators write flags: `300ms`, `5s`, `1.5s`, `2m`, `1h30m`.
pub struct HumanDuration(pub Duration);

impl fmt::Display for HumanDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let d = self.0;
        let ms = d.as_millis();
        if ms == 0 && d.as_nanos() > 0 {
            return write!(f, "{}us", d.as_micros());
        }
        if ms < 1_000 {
            return write!(f, "{ms}ms");
        }
        if ms < 60_000 {
            if ms.is_multiple_of(1_000) {
                return write!(f, "{}s", ms / 1_000);
            }
            // One decimal is as precise as an operator needs for a window in seconds.
            return write!(f, "{:.1}s", d.as_secs_f64());
        }
        let secs = d.as_secs();
        let (h, m, s) = (secs / 3600, (secs % 3600) / 60, secs % 60);
        let mut out = String::new();
        if h > 0 {
            out.push_str(&format!("{h}h"));
        }
        if m > 0 {
            out.push_str(&format!("{m}m"));
        }
        if s > 0 {
            out.push_str(&format!("{s}s"));
        }
        f.write_str(&out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn human_durations_read_like_flags() {
        let cases = [
            (Duration::from_millis(300), "300ms"),
            (Duration::from_secs(5), "5s"),
            (Duration::from_millis(1500), "1.5s"),
            (Duration::from_secs(120), "2m"),
            (Duration::from_secs(5400), "1h30m"),
            (Duration::from_secs(30 * 60), "30m"),
            (Duration::ZERO, "0ms"),
        ];
        for (d, want) in cases {
            assert_eq!(HumanDuration(d).to_string(), want);
        }
    }

    #[test]
    fn time_arithmetic_saturates() {
        let far = Time::from_duration(Duration::MAX);
        assert_eq!(far + Duration::from_secs(1), far);
        assert_eq!(Time::ZERO - far, Duration::ZERO);
    }
}
