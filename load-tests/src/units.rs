//! Byte sizes and durations as people write and read them.

use std::fmt;
use std::time::Duration;

/// A number of bytes, parsed from `64MiB`, `1GiB`, `500MB`, `4k` or `1048576`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ByteSize(pub u64);

/// Parses a byte size: a whole number followed by an optional unit. Binary units (KiB, MiB, GiB,
/// also K, M, G) are powers of 1024, decimal ones (kB, MB, GB) powers of 1000.
pub(crate) fn parse_byte_size(text: &str) -> Result<ByteSize, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (digits, unit) = text.split_at(split);
    let number: u64 = digits
        .parse()
        .map_err(|_| format!("`{text}` does not start with a whole number"))?;
    let multiplier: u64 = match unit.trim() {
        "" | "B" | "b" => 1,
        "K" | "k" | "KiB" | "kiB" => 1 << 10,
        "M" | "m" | "MiB" => 1 << 20,
        "G" | "g" | "GiB" => 1 << 30,
        "kB" | "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        other => {
            return Err(format!(
                "unknown unit `{other}` (use B, KiB, MiB, GiB, kB, MB or GB)"
            ))
        }
    };
    number
        .checked_mul(multiplier)
        .map(ByteSize)
        .ok_or_else(|| format!("`{text}` is too large"))
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [(u64, &str); 3] = [(1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")];
        for (size, unit) in UNITS {
            if self.0 >= size {
                let value = self.0 as f64 / size as f64;
                return if self.0 % size == 0 {
                    write!(f, "{}{unit}", self.0 / size)
                } else {
                    write!(f, "{value:.1}{unit}")
                };
            }
        }
        write!(f, "{}B", self.0)
    }
}

/// Throughput in decimal megabytes per second, the unit the field notes use.
/// Lowercase hex, two digits per byte (digests in reports).
pub(crate) fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    bytes
        .iter()
        .fold(String::with_capacity(bytes.len() * 2), |mut out, b| {
            let _ = write!(out, "{b:02x}");
            out
        })
}

pub(crate) fn megabytes_per_second(bytes: u64, elapsed: Duration) -> f64 {
    let seconds = elapsed.as_secs_f64();
    if seconds <= 0.0 {
        return f64::INFINITY;
    }
    bytes as f64 / 1e6 / seconds
}

/// Microseconds as milliseconds with two decimals.
pub(crate) fn micros_as_millis(micros: u64) -> String {
    format!("{:.2}", micros as f64 / 1_000.0)
}

/// A signed difference of microseconds as milliseconds with an explicit sign.
pub(crate) fn signed_micros_as_millis(micros: i64) -> String {
    format!("{:+.2}", micros as f64 / 1_000.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binary_and_decimal_units_parse_to_their_byte_counts() {
        assert_eq!(parse_byte_size("64MiB"), Ok(ByteSize(64 << 20)));
        assert_eq!(parse_byte_size("1GiB"), Ok(ByteSize(1 << 30)));
        assert_eq!(parse_byte_size("4k"), Ok(ByteSize(4096)));
        assert_eq!(parse_byte_size("500MB"), Ok(ByteSize(500_000_000)));
        assert_eq!(parse_byte_size("1048576"), Ok(ByteSize(1 << 20)));
    }

    #[test]
    fn unknown_units_and_missing_numbers_are_rejected() {
        assert!(parse_byte_size("12 parsecs").is_err());
        assert!(parse_byte_size("MiB").is_err());
        assert!(parse_byte_size("99999999999999GiB").is_err());
    }

    #[test]
    fn sizes_display_in_the_largest_binary_unit() {
        assert_eq!(ByteSize(1 << 30).to_string(), "1GiB");
        assert_eq!(ByteSize(3 << 19).to_string(), "1.5MiB");
        assert_eq!(ByteSize(100).to_string(), "100B");
    }

    #[test]
    fn differences_carry_an_explicit_sign() {
        assert_eq!(signed_micros_as_millis(1_234), "+1.23");
        assert_eq!(signed_micros_as_millis(-50), "-0.05");
        assert_eq!(micros_as_millis(15_000), "15.00");
    }
}
