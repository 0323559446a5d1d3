//! MLflow's authentication as the collector sends it: never printed.

use std::fmt;

/// MLflow's authentication. Never printed.
#[derive(Clone, PartialEq, Eq)]
pub enum Auth {
    None,
    Bearer(String),
    Basic { username: String, password: String },
}

impl Auth {
    /// `Authorization` header value.
    pub fn header_value(&self) -> Option<String> {
        match self {
            Auth::None => None,
            Auth::Bearer(token) => Some(format!("Bearer {token}")),
            Auth::Basic { username, password } => Some(format!(
                "Basic {}",
                base64(format!("{username}:{password}").as_bytes())
            )),
        }
    }
}

impl fmt::Debug for Auth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Auth::None => "None",
            Auth::Bearer(_) => "Bearer(<redacted>)",
            Auth::Basic { .. } => "Basic(<redacted>)",
        })
    }
}

fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let n = (u32::from(chunk[0]) << 16)
            | (u32::from(*chunk.get(1).unwrap_or(&0)) << 8)
            | u32::from(*chunk.get(2).unwrap_or(&0));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(ALPHABET[(n >> (18 - 6 * i)) as usize & 63]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_pads_like_rfc_4648() {
        assert_eq!(base64(b"f"), "Zg==");
        assert_eq!(base64(b"fo"), "Zm8=");
        assert_eq!(base64(b"foo"), "Zm9v");
        assert_eq!(base64(b"user:pa55"), "dXNlcjpwYTU1");
    }
}
