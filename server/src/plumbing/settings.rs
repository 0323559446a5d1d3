//! How a component declares its settings, once: a struct of `Option` fields in the component's
//! own module that derives `clap::Args` (each field a long flag with its `MLSCOPE_*` environment
//! variable and its help) and `serde::Deserialize` (the same field a key of the TOML file, named
//! as the flag with `_` for `-`). `None` means "not given here". The component turns the given
//! values into its settings with its own defaults and checks them with its own rules; `config`
//! only gathers the structs and layers them (flag, then environment, then file, then default).
//!
//! This module holds what every component's settings share: how durations, sizes and times are
//! written, on the command line and in the file.

use std::time::{Duration, SystemTime};

use serde::Deserialize;

/// A duration flag: `500ms`, `30s`, `2m`, `14d`.
pub(crate) fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s).map_err(|e| format!("{e} (write e.g. 500ms, 30s, 2m)"))
}

/// A point in time flag, RFC 3339: `2027-03-01T00:00:00Z`.
pub(crate) fn parse_time(s: &str) -> Result<SystemTime, String> {
    humantime::parse_rfc3339_weak(s).map_err(|e| format!("{e} (write e.g. 2027-03-01T00:00:00Z)"))
}

/// `16MiB`, `512KiB`, `1GiB`, `1000000` (bytes); `MB`/`KB`/`GB` are decimal.
pub(crate) fn parse_size(s: &str) -> Result<usize, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (number, unit) = s.split_at(split);
    let number: usize = number
        .parse()
        .map_err(|_| format!("{s:?} is not a size (write e.g. 16MiB)"))?;
    let factor = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "KB" | "kB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        other => {
            return Err(format!(
                "unknown size unit {other:?} (use B, KiB, MiB, GiB)"
            ))
        }
    };
    number
        .checked_mul(factor)
        .ok_or_else(|| format!("{s:?} is too large"))
}

/// A size in the file: a number of bytes, or text as [`parse_size`] reads it
/// (`#[serde(default, deserialize_with = "crate::plumbing::settings::size")]`).
pub(crate) fn size<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<usize>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Size {
        Bytes(usize),
        Text(String),
    }
    match Option::<Size>::deserialize(d)? {
        None => Ok(None),
        Some(Size::Bytes(n)) => Ok(Some(n)),
        Some(Size::Text(t)) => parse_size(&t).map(Some).map_err(serde::de::Error::custom),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_written_with_binary_or_decimal_units() {
        assert_eq!(parse_size("16MiB"), Ok(16 << 20));
        assert_eq!(parse_size("2 KB"), Ok(2_000));
        assert_eq!(parse_size("1000"), Ok(1000));
        assert!(parse_size("12 parsecs").is_err());
        assert!(parse_size("99999999999999GiB")
            .unwrap_err()
            .contains("too large"));
    }
}
